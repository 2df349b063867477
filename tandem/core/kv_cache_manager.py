"""KV cache blocks: a pool with ref counts, an O(1) LRU free list and a prefix cache.

The pool is a fixed number of blocks of ``block_size`` token slots, decided
once at startup. A request owns a list of block ids (its block table).

Prefix caching (vLLM's automatic prefix caching):
* A *full* block is identified by a chained hash: hash((parent_hash, its token
  ids)). Python's ``hash`` of a tuple of ints is fast (C), 64-bit, and stable
  across processes (only str/bytes hashing is salted), so it costs ~1 µs per
  16 tokens on the scheduling path.
* A hash is only a lookup key, never trusted: a hit also checks the block's
  token ids and that its parent is the block matched just before it. By
  induction from the first block, a hit therefore holds exactly the KV of the
  same token prefix, whatever the hash collides with. For that, a block is only
  registered while its parent is: a parent_id never names a block that was
  evicted and reused since.
* Freed blocks keep their contents and hash and sit in the free list; they are
  evicted only when a fresh block is needed. Blocks without a hash go to the
  front (evicted first); a freed chain is appended tail first, so the tail of a
  chain is evicted before its head. Any hit on a child also touches its parent,
  so a cached block's parent is never evicted before it: the parent check
  above always compares against a live block.
* A cached block with ref count 0 counts as free (usage returns to ~0 at idle);
  reviving it takes it out of the free list, i.e. it consumes free capacity.

Invariant (tests assert it): once no request holds blocks, every ref count is 0
and every block is in the free list.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tandem.core.request import Request

logger = logging.getLogger(__name__)

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
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "parent_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent_id: int | None = None  # block matched before this one; -1 = first

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class KVCacheManager:
    """Allocates blocks to requests; optionally reuses cached prefix blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: Callable[[int, Sequence[int]], int] = hash_block_tokens,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order (first = least recently used).
        self.free_blocks: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[int, KVCacheBlock] = {}
        # Prefix-cache counters in tokens (vLLM's prefix_cache_queries / _hits),
        # advanced by the scheduler when a request is admitted, not per lookup.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free counts as free)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix cache
    def _update_block_hashes(self, request: Request, upto_tokens: int) -> None:
        """Extend request.block_hashes over its full blocks within upto_tokens."""
        hashes = request.block_hashes
        hashes.extend(chain_block_hashes(
            request.token_ids, self.block_size, upto_tokens // self.block_size, self.hash_fn,
            hashes[-1] if hashes else NONE_HASH, len(hashes)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and a token count.

        The last token is never served from cache: it must run through the model
        to produce logits for the next token.
        """
        if not self.enable_caching:
            return [], 0
        limit = request.num_tokens - 1
        self._update_block_hashes(request, limit)
        hits = self._match(request.block_hashes[: limit // self.block_size], request.token_ids)
        return hits, len(hits) * self.block_size

    def _match(self, hashes: Sequence[int], tokens: Sequence[int]) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of this hash chain, checked (see above)."""
        bs = self.block_size
        hits: list[KVCacheBlock] = []
        parent_id = -1
        for i, h in enumerate(hashes):
            block = self.cached.get(h)
            if (
                block is None
                or block.parent_id != parent_id
                or block.token_ids != tuple(tokens[i * bs : (i + 1) * bs])
            ):
                break
            hits.append(block)
            parent_id = block.block_id
        return hits

    def cached_prefix(self, token_ids: Sequence[int]) -> list[KVCacheBlock]:
        """The cached blocks of token_ids' longest cached full-block prefix."""
        n = len(token_ids) // self.block_size
        return self._match(chain_block_hashes(token_ids, self.block_size, n, self.hash_fn),
                           token_ids)

    def import_prefix(self, token_ids: Sequence[int]) -> tuple[list[KVCacheBlock], list[int]]:
        """Hold the chain of token_ids' full blocks in the prefix cache, for KV computed
        elsewhere (disaggregated prefill): blocks already cached are reused, the
        rest are taken fresh and registered. Returns the held blocks (``release``
        them once written) and the chain indices of the fresh ones, whose KV the
        caller must write. Stops early when the pool has no free block or another
        chain holds a hash; those tokens are then recomputed, as on a miss.
        """
        bs = self.block_size
        hashes = chain_block_hashes(token_ids, bs, len(token_ids) // bs, self.hash_fn)
        held = self._match(hashes, token_ids)
        for b in held:
            if b.ref_cnt == 0:
                del self.free_blocks[b.block_id]
            b.ref_cnt += 1
        fresh: list[int] = []
        for i in range(len(held), len(hashes)):
            if hashes[i] in self.cached or not self.free_blocks:
                break
            block = self._take_free()
            block.block_hash = hashes[i]
            block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            block.parent_id = held[-1].block_id if held else -1
            self.cached[hashes[i]] = block
            held.append(block)
            fresh.append(i)
        return held, fresh

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within num_tokens."""
        self._update_block_hashes(request, num_tokens)
        bs = self.block_size
        tokens = request.token_ids
        block_ids = request.block_ids
        num_full = num_tokens // bs
        for i in range(request.num_cached_blocks, num_full):
            block = self.blocks[block_ids[i]]
            if block.block_hash is not None:
                continue  # a prefix-cache hit: already registered
            if i and self.blocks[block_ids[i - 1]].block_hash is None:
                # The chain is broken: the parent is not in the cache (its hash
                # was already taken). A child registered under it could never be
                # hit now, and once the parent is evicted, reused and registered
                # under a colliding hash, the parent check would pass and serve
                # KV computed after other tokens. Register nothing past it.
                break
            h = request.block_hashes[i]
            if h in self.cached:
                continue  # same content computed twice, or a collision: keep the first
            block.block_hash = h
            block.token_ids = tuple(tokens[i * bs : (i + 1) * bs])
            block.parent_id = block_ids[i - 1] if i else -1
            self.cached[h] = block
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    # -------------------------------------------------------------- allocation
    def _take_free(self) -> KVCacheBlock:
        _, block = self.free_blocks.popitem(last=False)
        if block.block_hash is not None:  # evict its cached contents
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.parent_id = None
        block.ref_cnt = 1
        return block

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        reserve_blocks: int = 0,
    ) -> bool:
        """Make room for num_new_tokens more tokens; False (and no change) if full.

        new_computed_blocks: prefix-cache hits being attached at admission.
        reserve_blocks: free blocks that must remain afterwards (admission control
        keeps headroom for running requests so they are not preempted at once).
        """
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total += num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(request.block_ids)
        num_new_blocks -= len(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + revived + reserve_blocks > len(self.free_blocks):
            return False
        for b in new_computed_blocks:
            if b.ref_cnt == 0:
                del self.free_blocks[b.block_id]
            b.ref_cnt += 1
            request.block_ids.append(b.block_id)
        for _ in range(num_new_blocks):
            request.block_ids.append(self._take_free().block_id)
        if self.enable_caching:
            self._cache_full_blocks(request, total)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (the tail is evicted first)."""
        self.release(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, tail first; a block no one holds is free."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block_id] = block
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
