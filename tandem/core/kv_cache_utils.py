"""KV cache utilities beside the manager (vLLM's v1/core/kv_cache_utils.py):
the chained block hash and a pool block's metadata.

A *full* block is identified by a chained hash: hash((parent_hash, its token
ids)). Python's ``hash`` of a tuple of ints is fast (C), 64-bit, and stable
across processes (only str/bytes hashing is salted), so it costs ~1 µs per
16 tokens on the scheduling path. A hash is only a lookup key: the manager
checks every hit (kv_cache_manager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

NONE_HASH = 0


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
