"""KV cache blocks: a pool with ref counts, an O(1) LRU free list and a prefix cache.

The pool is a fixed number of blocks of ``block_size`` token slots, decided
once at startup. A request owns a list of block ids (its block table).

Prefix caching (vLLM's automatic prefix caching):
* A *full* block is identified by a chained hash (kv_cache_utils).
* A hash is only a lookup key, never trusted: a hit also checks the block's
  token ids and that its parent is the block matched just before it, as it
  was when the child was registered (its id and ``generation``, bumped each
  time a block is taken fresh or leaves the cache). By induction from the
  first block, a hit therefore holds exactly the KV of the same token prefix,
  whatever the hash collides with. A block whose chain no lookup can reach
  any more (an ancestor was taken since) gives its hash to the next block
  registered under it.
* A block computed again while an equal one is cached (same hash, same parent
  and tokens: a request whose hit was shortened) stays unregistered; the
  cached one stands for that prefix, the request's next block is registered
  as its child, and its window blocks beside it.
* Freed blocks keep their contents and hash and sit in the free list; they are
  evicted only when a fresh block is needed. Blocks without a hash go to the
  front (evicted first); a freed chain is appended tail first, so the tail of a
  chain is evicted before its head (a hit needs the head).
* A cached block with ref count 0 counts as free (usage returns to ~0 at idle);
  reviving it takes it out of the free list, i.e. it consumes free capacity.

Sliding-window groups (vLLM's hybrid KV cache manager): in a model that mixes
full-attention layers with layers that see only their last W keys (Gemma 2 and
3), the layers are split into groups of equally many
(kv_cache_utils.group_layers), each group with a block table of its own over
the one pool; a block holds one group's layers. Group 0 and the other
full-attention groups keep every block of a request; a window group releases
the blocks that slid out of its window for every query to come (``NULL_BLOCK``
takes their place), so a long request holds ~W tokens of those layers, not its
whole context. A window group's block is only a prefix-cache hit when the
full-attention block at its index is (checked as above) and is the very block
it was registered beside (its id and ``generation``, bumped on every reuse): so
a window block holds exactly the KV of the prefix the group-0 chain checked. A
hit needs the window groups' blocks of the W - 1 keys before the hit, not the
ones before.

Invariant (tests assert it): once no request holds blocks, every ref count is 0
and every block is in the free list.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.core.kv_cache_utils import (
    NONE_HASH,
    KVCacheBlock,
    chain_block_hashes,
    hash_block_tokens,
)
from tandem.core.request import Request

logger = logging.getLogger(__name__)

NULL_BLOCK = -1  # a window group's entry for a block that slid out of its window


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: group 0's blocks and, per other group, its blocks at
    the same indices (None where its window has passed)."""

    blocks: list[KVCacheBlock]
    groups: list[list[KVCacheBlock | None]]

    def held(self) -> list[KVCacheBlock]:
        return self.blocks + [b for g in self.groups for b in g if b is not None]


class KVCacheManager:
    """Allocates blocks to requests; optionally reuses cached prefix blocks.

    ``windows``: each KV cache group's window (KVCacheGroups.windows); groups
    past the first keep their block ids in ``request.group_block_ids``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: Callable[[int, Sequence[int]], int] = hash_block_tokens,
        windows: Sequence[int] = (0,),
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if not windows or windows[0] != 0 or any(w < 0 for w in windows):
            raise ValueError(f"KV cache group 0 must be full attention, got windows {windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.windows = tuple(windows[1:])  # the groups past group 0
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order (first = least recently used).
        self.free_blocks: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[int, KVCacheBlock] = {}
        self.group_cached: list[dict[int, KVCacheBlock]] = [{} for _ in self.windows]
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

    def _first_needed(self, g: int, num_tokens: int) -> int:
        """Group g+1's first block a query at position num_tokens (or later) sees."""
        w = self.windows[g]
        return max(0, num_tokens - w + 1) // self.block_size if w else 0

    # ------------------------------------------------------------ prefix cache
    def _update_block_hashes(self, request: Request, upto_tokens: int) -> None:
        """Extend request.block_hashes over its full blocks within upto_tokens."""
        hashes = request.block_hashes
        hashes.extend(chain_block_hashes(
            request.token_ids, self.block_size, upto_tokens // self.block_size, self.hash_fn,
            hashes[-1] if hashes else NONE_HASH, len(hashes)))

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """The longest cached prefix of the request, as blocks and a token count.

        The last token is never served from cache: it must run through the model
        to produce logits for the next token; nor is a prompt whose logprobs are
        still to be computed.
        """
        if not self.enable_caching or request.prompt_logprobs_pending:
            return ComputedBlocks([], [[] for _ in self.windows]), 0
        limit = request.num_tokens - 1
        self._update_block_hashes(request, limit)
        hashes = request.block_hashes[: limit // self.block_size]
        hits = self._match(hashes, request.token_ids)
        if not self.windows:
            return ComputedBlocks(hits, []), len(hits) * self.block_size
        # Per other group, its blocks peered with the hits and how many run
        # unbroken up to each index; the hit shrinks until each group has the
        # blocks its window needs.
        found, runs = [], []
        for cached in self.group_cached:
            blocks, run, r = [], [], 0
            for h, peer in zip(hashes, hits):
                b = cached.get(h)
                if b is not None and (b.parent_id != peer.block_id
                                      or b.parent_generation != peer.generation):
                    b = None
                r = r + 1 if b is not None else 0
                blocks.append(b)
                run.append(r)
            found.append(blocks)
            runs.append(run)
        n = len(hits)
        bs = self.block_size
        while n and any(run[n - 1] < n - self._first_needed(g, n * bs)
                        for g, run in enumerate(runs)):
            n -= 1
        groups = [[None] * self._first_needed(g, n * bs)
                  + blocks[self._first_needed(g, n * bs): n] for g, blocks in enumerate(found)]
        return ComputedBlocks(hits[:n], groups), n * bs

    def _match(self, hashes: Sequence[int], tokens: Sequence[int]) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of this hash chain, checked (see above)."""
        bs = self.block_size
        hits: list[KVCacheBlock] = []
        parent = (-1, 0)
        for i, h in enumerate(hashes):
            block = self.cached.get(h)
            if block is None or not self._continues(block, parent, tokens[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
            parent = (block.block_id, block.generation)
        return hits

    @staticmethod
    def _continues(block: KVCacheBlock, parent: tuple[int, int], tokens: Sequence[int]) -> bool:
        """The block was registered as the child of ``parent`` (id, generation)
        holding these tokens."""
        return ((block.parent_id, block.parent_generation) == parent
                and block.token_ids == tuple(tokens))

    def cached_prefix(self, token_ids: Sequence[int]) -> list[KVCacheBlock]:
        """The cached blocks of token_ids' longest cached full-block prefix (group 0)."""
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
        Group 0 only: the engine refuses KV hand-off with window groups.
        """
        bs = self.block_size
        hashes = chain_block_hashes(token_ids, bs, len(token_ids) // bs, self.hash_fn)
        held = self._match(hashes, token_ids)
        self._hold(held)
        fresh: list[int] = []
        for i in range(len(held), len(hashes)):
            if hashes[i] in self.cached or not self.free_blocks:
                break
            block = self._take_free(0)
            block.block_hash = hashes[i]
            block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            block.parent_id, block.parent_generation = (
                (held[-1].block_id, held[-1].generation) if held else (-1, 0))
            self.cached[hashes[i]] = block
            held.append(block)
            fresh.append(i)
        return held, fresh

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within num_tokens (every
        group's at an index group 0 registers there)."""
        bs = self.block_size
        num_full = num_tokens // bs
        if num_full <= request.num_cached_blocks:
            return  # most decode steps: no block filled up
        self._update_block_hashes(request, num_tokens)
        tokens = request.token_ids
        block_ids = request.block_ids
        parent = request.cached_tail  # the chain's block at num_cached_blocks - 1
        for i in range(request.num_cached_blocks, num_full):
            if parent is None or not self._registered(parent):
                # A collision broke the chain, or the block standing for the prefix
                # so far was taken since: nothing registered past it could be hit.
                parent = None
                break
            block = self.blocks[block_ids[i]]
            if block.block_hash is not None:  # a prefix-cache hit: already registered
                parent = (block.block_id, block.generation)
                continue
            h = request.block_hashes[i]
            equal = self.cached.get(h)
            if equal is not None:  # computed again (a shortened hit), a collision, or stale
                if self._continues(equal, parent, tokens[i * bs : (i + 1) * bs]):
                    self._register_beside(request, i, equal)
                    parent = (equal.block_id, equal.generation)
                    continue
                if self._reachable(equal):  # another prefix's block under this hash
                    parent = None
                    continue
                self._unregister(equal)  # no lookup reaches it: this block takes its hash
            block.block_hash = h
            block.token_ids = tuple(tokens[i * bs : (i + 1) * bs])
            block.parent_id, block.parent_generation = parent
            self.cached[h] = block
            self._register_beside(request, i, block)
            parent = (block.block_id, block.generation)
        request.num_cached_blocks = num_full
        request.cached_tail = parent

    def _registered(self, ref: tuple[int, int]) -> bool:
        """The block (id, generation) is registered as it was then (-1: the root)."""
        block_id, generation = ref
        if block_id == -1:
            return True
        block = self.blocks[block_id]
        return block.generation == generation and block.block_hash is not None

    def _reachable(self, block: KVCacheBlock) -> bool:
        """A lookup can still reach the registered block: each block up its chain
        is registered as it was when its child was. A chain's block stops being
        reachable when an equal block stood for its prefix (a shortened hit's)
        and was then taken fresh."""
        while block.parent_id != -1:
            if not self._registered((block.parent_id, block.parent_generation)):
                return False
            block = self.blocks[block.parent_id]
        return True

    def _unregister(self, block: KVCacheBlock) -> None:
        """Take an unreachable block out of the prefix cache; its generation moves
        on, so the blocks registered as its children or beside it are stale too."""
        del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent_id = None
        block.generation += 1
        if block.ref_cnt == 0:  # an unregistered free block is evicted first
            self.free_blocks.move_to_end(block.block_id, last=False)

    def _register_beside(self, request: Request, i: int, peer: KVCacheBlock) -> None:
        """Register the other groups' blocks at index i (computed this step: not
        released) beside group 0's registered ``peer`` for that prefix."""
        for ids, cached in zip(request.group_block_ids, self.group_cached):
            block = self.blocks[ids[i]]
            block.block_hash, block.token_ids = peer.block_hash, peer.token_ids
            block.parent_id, block.parent_generation = peer.block_id, peer.generation
            cached[peer.block_hash] = block  # an entry beside an evicted peer is replaced

    # -------------------------------------------------------------- allocation
    def _take_free(self, group: int) -> KVCacheBlock:
        _, block = self.free_blocks.popitem(last=False)
        if block.block_hash is not None:  # evict its cached contents
            cached = self.group_cached[block.group - 1] if block.group else self.cached
            if cached.get(block.block_hash) is block:
                del cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.parent_id = None
        block.ref_cnt = 1
        block.generation += 1  # (also when a block leaves the cache unreachable: _unregister)
        block.group = group
        return block

    def _hold(self, blocks: Sequence[KVCacheBlock]) -> None:
        """One more reference to each block (a free one leaves the free list)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_blocks[b.block_id]
            b.ref_cnt += 1

    def _remove_skipped_blocks(self, request: Request) -> None:
        """Release each window group's blocks that no query of the request from
        its next token on sees (vLLM's name): they stay cached while free."""
        for g, ids in enumerate(request.group_block_ids):
            i = min(self._first_needed(g, request.num_computed_tokens), len(ids)) - 1
            while i >= 0 and ids[i] != NULL_BLOCK:
                self.release((ids[i],))
                ids[i] = NULL_BLOCK
                i -= 1

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks | None = None,
        reserve_blocks: int = 0,
    ) -> bool:
        """Make room for num_new_tokens more tokens; False (and no change, but
        that blocks which slid out of a window are released) if full.

        new_computed_blocks: prefix-cache hits being attached at admission.
        reserve_blocks: free blocks that must remain afterwards (admission control
        keeps headroom for running requests so they are not preempted at once).
        """
        hits = new_computed_blocks
        num_hits = 0 if hits is None else len(hits.blocks)
        if self.windows:
            if not request.group_block_ids:
                request.group_block_ids = [[] for _ in self.windows]
            self._remove_skipped_blocks(request)
        total = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        # Every group's list is as long as group 0's (hits included): each takes as many.
        num_new = max(-(-total // self.block_size) - len(request.block_ids) - num_hits, 0)
        held = () if hits is None else hits.held()
        revived = sum(1 for b in held if b.ref_cnt == 0)
        if num_new * (1 + len(self.windows)) + revived + reserve_blocks > len(self.free_blocks):
            return False
        if hits is not None:
            self._hold(held)
            request.block_ids.extend(b.block_id for b in hits.blocks)
            for ids, g in zip(request.group_block_ids, hits.groups):
                ids.extend(NULL_BLOCK if b is None else b.block_id for b in g)
        if num_new:
            for group, ids in enumerate((request.block_ids, *request.group_block_ids)):
                for _ in range(num_new):
                    ids.append(self._take_free(group).block_id)
        if self.enable_caching:
            self._cache_full_blocks(request, total)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (the tail is evicted first)."""
        for ids in request.group_block_ids:
            self.release([b for b in ids if b != NULL_BLOCK])
        self.release(request.block_ids)
        request.block_ids = []
        request.group_block_ids = []
        request.num_cached_blocks = 0
        request.cached_tail = (-1, 0)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, tail first; a block no one holds is free."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block_id] = block
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
