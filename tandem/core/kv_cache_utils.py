"""KV cache utilities beside the manager (vLLM's v1/core/kv_cache_utils.py):
the chained block hash, a pool block's metadata, and the split of a model's
layers into KV cache groups over the one pool (decided once at start-up; the
engine's sizing, the runner and the planner read it, the manager only each
group's window).

A *full* block is identified by a chained hash: hash((parent_hash, its token
ids)). Python's ``hash`` of a tuple of ints is fast (C), 64-bit, and stable
across processes (only str/bytes hashing is salted), so it is cheap on the
scheduling path. A hash is only a lookup key: the manager checks every hit
(kv_cache_manager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

NONE_HASH = 0
MAX_KV_GROUPS = 8  # more block tables cost each step more host work than padding saves


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chained block hash (replaceable in tests to force collisions)."""
    return hash((parent_hash, tuple(token_ids)))


def chain_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    hash_fn: Callable[[int, Sequence[int]], int] = hash_block_tokens,
    parent: int = NONE_HASH,
    start: int = 0,
) -> list[int]:
    """The chained hashes of full blocks start..num_blocks-1, block start's parent
    being ``parent``. Also what a router outside the engine computes to know which
    replica's cache holds a prompt's first blocks: the hash of a tuple of ints is
    the same in every process."""
    out = []
    for i in range(start, num_blocks):
        parent = hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "parent_id", "generation",
                 "group", "parent_generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        # Group 0: the block matched before this one (-1 = first); another group's:
        # the group-0 block at its index. Both with that block's generation when
        # this one was registered.
        self.parent_id: int | None = None
        self.parent_generation = 0
        self.generation = 0  # bumped each time the block is taken fresh or unregistered
        self.group = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


@dataclass(frozen=True)
class KVCacheGroups:
    """How the layers share the pool: ``windows[g]`` is group g's window in keys
    (0: full attention; group 0 always is), ``layer_group[l]`` / ``layer_slot[l]``
    layer l's group and its place in the group's ``group_size`` layers. A pool
    block holds one group's layers, so it is ``group_size`` layers' KV; a
    group with fewer layers leaves the rest of its blocks unused."""

    group_size: int
    windows: tuple[int, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Pool blocks one request of num_tokens holds at most, its steps
        computing up to ``chunk`` tokens: a window group keeps the blocks of
        its last W - 1 keys and of the chunk being computed."""
        n = -(-num_tokens // block_size)
        return sum(n if not w else min(n, -(-(w - 1 + chunk) // block_size) + 1)
                   for w in self.windows)


def group_layers(layer_windows: Sequence[int], hybrid: bool = True,
                 max_len: int | None = None) -> KVCacheGroups:
    """Split the layers into KV cache groups by window. One group of every layer
    (no block released) unless ``hybrid`` and the model mixes full-attention
    layers with windowed ones: a group of windowed layers only saves memory
    beside a full-attention group 0 to check its prefix hits against. A window
    no shorter than ``max_len`` (the longest context) hides no key: such a
    layer groups as a full-attention one. The
    group size pads the fewest layers with at most MAX_KV_GROUPS groups
    (Gemma 3 1B's 4 full and 22 windowed layers: 7 groups of 4)."""
    if max_len is not None:
        layer_windows = [w if w < max_len else 0 for w in layer_windows]
    n = len(layer_windows)
    one = KVCacheGroups(n, (0,), (0,) * n, tuple(range(n)))
    kinds = sorted(set(layer_windows))
    if not hybrid or len(kinds) == 1 or kinds[0] != 0:
        return one
    members = [[i for i, w in enumerate(layer_windows) if w == k] for k in kinds]

    def cost(size: int) -> tuple[int, int]:  # (padded layers, groups)
        groups = sum(-(-len(m) // size) for m in members)
        return groups * size, groups

    size = min((s for s in range(1, min(map(len, members)) + 1)
                if cost(s)[1] <= MAX_KV_GROUPS), key=lambda s: (cost(s), -s), default=None)
    if size is None:
        return one
    windows: list[int] = []
    group, slot = [0] * n, [0] * n
    for k, m in zip(kinds, members):
        for j, layer in enumerate(m):
            if j % size == 0:
                windows.append(k)
            group[layer], slot[layer] = len(windows) - 1, j % size
    return KVCacheGroups(size, tuple(windows), tuple(group), tuple(slot))
