"""The running requests' block tables as one preallocated tensor.

Attention reads each sequence's block ids as a row of a [B, blocks] int tensor.
Rebuilding that from the requests' Python lists every step costs O(batch x
context). Here each request holds a row while it runs, and a step copies only
the block ids allocated since the last one, O(batch + new blocks).

Each KV cache group (tandem.core.kv_cache_utils.KVCacheGroups) has a table
of its own; every group's block list is as long as group 0's.

Invariant: a request's row holds exactly its ``block_ids`` (and each group's
``group_block_ids``) after ``rows()``, but for a window group's entries that
became NULL_BLOCK after they were copied (they keep the old id) or were copied
as NULL_BLOCK (0): attention does not read a block before the window (the
kernels start at it, the reference path masks it). It relies on the engine
releasing the row whenever a request stops running (finished, aborted,
preempted): until then its block lists only grow.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.core.request import Request


class BlockTable:
    def __init__(self, max_rows: int, max_blocks: int, num_groups: int = 1) -> None:
        self.array = np.zeros((num_groups, max_rows, max_blocks), dtype=np.int32)
        self.tensor = torch.from_numpy(self.array)  # shares the array's memory
        self._lens = [0] * max_rows  # block ids written per row
        self._rows: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))

    def rows(self, reqs: Sequence[Request]) -> list[int]:
        """Each request's row, first bringing it up to date with its block_ids."""
        out = []
        for r in reqs:
            row = self._rows.get(r.request_id)
            if row is None:
                row = self._rows[r.request_id] = self._free.pop()
            ids, n = r.block_ids, self._lens[row]
            m = len(ids)
            if m != n:
                self.array[0, row, n:m] = ids[n:]
                for g, group_ids in enumerate(r.group_block_ids, 1):
                    np.maximum(group_ids[n:], 0, out=self.array[g, row, n:m])  # NULL_BLOCK: 0
                self._lens[row] = m
            out.append(row)
        return out

    def table(self, rows: list[int], num_blocks: int) -> torch.Tensor:
        """[groups, len(rows), num_blocks] int32: the rows' first num_blocks block
        ids in each group (entries past a sequence's blocks are stale, never read;
        a window group's before its window are stale or 0: the kernels skip them,
        the reference path masks them)."""
        # numpy's gather may lay the result out groups-last.
        return torch.from_numpy(np.ascontiguousarray(self.array[:, rows, :num_blocks]))

    def release(self, request_id: str) -> None:
        """The request stopped running: its row is free (no-op if it had none)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._lens[row] = 0
            self._free.append(row)
