"""CPU weights in transparent huge pages: decode streams them 4-12% faster.

A decode step reads every weight once. In 4 KiB pages that is a TLB miss and
a hardware-prefetcher restart every 4 KiB; Linux backs anonymous memory
advised ``MADV_HUGEPAGE`` with 2 MiB pages (the common THP setting,
"madvise", does exactly this), where the prefetcher runs on. Measured on
the default model's matmul weights (2-core CI machine, one OpenMP team):
32.4 GB/s in huge pages vs 31.0 GB/s as torch allocates them. Packed int8
weights of a 1.66B model's shape cycled through DRAM at batch 1 (a 2-vCPU
Zen 4 VM): 58 vs 51.5 GB/s; that model's Q8_0 / Q4_0 decode 27.0 -> 27.8 and
43.3 -> 44.8 tok/s.

Where THP is off or unsupported, the advice is a no-op and the weights are
simply copied into ordinary anonymous memory.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys
from collections.abc import Callable, Iterable

import torch

# Where a tensor is placed: (shape, dtype) -> a new CPU tensor (torch.empty's,
# or a HugePageArena's).
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]

_ALIGN = 64  # bytes: every tensor starts on a cache line


class HugePageArena:
    """Places tensors (new ones, or copies) in large anonymous mappings advised
    MADV_HUGEPAGE.

    Mappings of ``chunk_bytes`` (a larger tensor gets its own) are filled one
    after another; a mapping lives as long as any tensor in it. Memory is
    committed as it is written, so copying the tensors of a model one by one
    (each original freed after its copy) peaks at about one tensor over the
    model's size.
    """

    def __init__(self, chunk_bytes: int = 128 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._buf: torch.Tensor | None = None
        self._used = 0

    def _map(self, nbytes: int) -> torch.Tensor:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(m, dtype=torch.uint8)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor in the arena, zero-filled (fresh anonymous memory)."""
        n = math.prod(shape) * dtype.itemsize
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        if n > self.chunk_bytes:
            dest = self._map(n)
        else:
            if self._buf is None or self._used + n > self.chunk_bytes:
                self._buf, self._used = self._map(self.chunk_bytes), 0
            dest = self._buf[self._used : self._used + n]
            self._used += -(-n // _ALIGN) * _ALIGN
        return dest.view(dtype).view(shape)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor ``t`` in the arena."""
        out = self.empty(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out


MADV_POPULATE_WRITE = 23  # Linux >= 5.14
POPULATE_CHUNK = 32 << 20  # bytes a call: madvise holds the process's map lock over its range


def populate(tensors: Iterable[torch.Tensor],
             keep_going: Callable[[int], bool] = lambda left: True) -> bool:
    """Commit the memory under contiguous CPU tensors now, their contents kept:
    Linux's MADV_POPULATE_WRITE faults each page in as a write would, without
    writing. ctypes releases the GIL for each call, so a thread can run it
    beside the engine's. ``keep_going(bytes left)`` is asked before each chunk
    of POPULATE_CHUNK bytes; False stops there and returns False. Raises
    OSError where the kernel lacks it (before 5.14) or refuses."""
    if sys.platform != "linux":
        raise OSError(errno.ENOSYS, "MADV_POPULATE_WRITE is Linux's")
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ranges = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("populate takes contiguous CPU tensors")
        start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
        ranges.append((start, t.data_ptr() + t.numel() * t.element_size()))
    left = sum(end - start for start, end in ranges)
    for start, end in ranges:
        for a in range(start, end, POPULATE_CHUNK):
            n = min(POPULATE_CHUNK, end - a)
            if not keep_going(left):
                return False
            if madvise(a, n, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
            left -= n
    return True
