"""The KV hand-off of disaggregated prefill: a prefill engine exports a prompt's
cached blocks (``export_kv``), a decode engine writes them into its pool as
prefix-cache blocks (``import_kv``), so the request is admitted there as a hit.

Both run on the engine thread, between two steps (``AsyncEngine.call``): they
touch the KV manager and the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_cache_utils import KVCacheGroups
from tandem.model.kv_cache import KVCache


@dataclass
class KVBlocks:
    """KV exported by one engine for another: the first ``len(token_ids)`` tokens
    (whole blocks) of a prompt, one tensor per cache part (K/V, plus scales for
    an int8 cache) shaped [layers, tokens, ...]."""

    token_ids: list[int]
    block_size: int
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def export_kv(kv_manager: KVCacheManager, kv_caches: list[KVCache], groups: KVCacheGroups,
              block_size: int, token_ids: Sequence[int]) -> KVBlocks:
    """The KV of token_ids' longest cached full-block prefix, copied out of the
    pool: a prefill engine's hand-off once the request finished (its blocks
    stay cached until evicted)."""
    check_kv_handoff(groups)
    blocks = kv_manager.cached_prefix(token_ids)
    n = len(blocks) * block_size
    slots = _slots([b.block_id for b in blocks], block_size, _device(kv_caches))
    tensors = []
    for part in zip(*(c.tensors for c in kv_caches)):  # K/V (, scales)
        out = torch.empty((len(part), n, *part[0].shape[1:]), dtype=part[0].dtype)
        for layer, t in enumerate(part):
            if t.device == out.device:  # one copy, straight into the export
                torch.index_select(t, 0, slots, out=out[layer])
            else:
                out[layer] = t.index_select(0, slots)
        tensors.append(out)
    return KVBlocks(list(token_ids[:n]), block_size, tensors)


def import_kv(kv_manager: KVCacheManager, kv_caches: list[KVCache], groups: KVCacheGroups,
              block_size: int, kv: KVBlocks) -> int:
    """Write another engine's exported KV into this pool as prefix-cache blocks
    (free and cached, as a finished request leaves them), so a request with
    that prompt is admitted as a hit. Returns the tokens now cached."""
    check_kv_handoff(groups)
    mine = kv_caches[0].tensors
    # Float K/V convert (auto is bf16 or fp16 by each CPU's features, so a
    # prefill and a decode replica on different CPUs hold different ones).
    if kv.block_size != block_size or len(kv.tensors) != len(mine) or any(
            src.shape[0] != len(kv_caches) or src.shape[2:] != t.shape[1:]
            or (src.dtype != t.dtype
                and not (src.is_floating_point() and t.is_floating_point()))
            for src, t in zip(kv.tensors, mine)):
        raise ValueError("the exported KV blocks do not fit this engine's cache "
                         "(another model, block size or KV dtype)")
    held, fresh = kv_manager.import_prefix(kv.token_ids)
    if fresh:
        device = _device(kv_caches)
        slots = _slots([held[i].block_id for i in fresh], block_size, device)
        rows = _slots(fresh, block_size, device).to(torch.device("cpu"))
        for layer, cache in enumerate(kv_caches):
            for t, src in zip(cache.tensors, kv.tensors):
                t.index_copy_(0, slots, src[layer].index_select(0, rows).to(t.device, t.dtype))
    kv_manager.release([b.block_id for b in held])
    return len(held) * block_size


def check_kv_handoff(groups: KVCacheGroups) -> None:
    """KV hand-off moves group 0's blocks, which hold every layer only in one group."""
    if groups.hybrid:
        raise ValueError(
            "KV hand-off needs every layer's KV in one block table; this model's "
            "sliding-window layers have their own: start its engines with "
            "--disable-hybrid-kv-cache-manager")


def _device(kv_caches: list[KVCache]) -> torch.device:
    return kv_caches[0].tensors[0].device


def _slots(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    """Every slot of the blocks, in order."""
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    return (ids[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)
