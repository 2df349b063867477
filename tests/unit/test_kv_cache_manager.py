"""KVCacheManager: allocation, ref counts, LRU eviction, prefix hits and the collision guard."""

import pytest

from tandem.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tandem.core.kv_cache_utils import group_layers, hash_block_tokens
from tandem.core.request import Request
from tandem.sampling_params import SamplingParams

BS = 4


def req(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), 8)


def admit(kv, r):
    """What the scheduler does at admission: attach hits, allocate the rest."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    return n


def all_free(kv):
    return all(b.ref_cnt == 0 for b in kv.blocks) and kv.num_free_blocks == kv.num_blocks


def test_allocate_and_free_restores_pool():
    kv = KVCacheManager(8, BS)
    r = req(range(10))
    assert admit(kv, r) == 0
    assert len(r.block_ids) == 3
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(r)
    assert all_free(kv) and kv.usage == 0.0


def test_allocation_fails_without_change_when_full():
    kv = KVCacheManager(2, BS)
    r = req(range(12))
    assert not kv.allocate_slots(r, 12)
    assert r.block_ids == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots(r, 8)
    assert not kv.allocate_slots(req(range(3), "x"), 3)


def test_reserve_blocks_keeps_headroom():
    kv = KVCacheManager(4, BS)
    assert not kv.allocate_slots(req(range(12)), 12, reserve_blocks=2)
    assert kv.allocate_slots(req(range(8)), 8, reserve_blocks=2)


def test_full_hit_partial_hit_and_miss():
    kv = KVCacheManager(16, BS)
    a = req(range(12), "a")
    admit(kv, a)
    # Same 12 tokens: the last token is always recomputed -> 2 full blocks hit.
    b = req(range(12), "b")
    assert admit(kv, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert kv.blocks[a.block_ids[0]].ref_cnt == 2
    # Shares only the first block.
    c = req([0, 1, 2, 3, 9, 9, 9, 9, 9], "c")
    assert admit(kv, c) == 4
    # A different first block: a miss even though later blocks repeat.
    d = req([7, 1, 2, 3, 4, 5, 6, 7, 8], "d")
    assert admit(kv, d) == 0
    for r in (a, b, c, d):
        kv.free(r)
    assert all_free(kv)
    assert kv.prefix_cache_hits == 0  # counted by the scheduler at admission, not here


def test_freed_blocks_stay_cached_and_count_as_free():
    kv = KVCacheManager(8, BS)
    a = req(range(9), "a")
    admit(kv, a)
    kv.free(a)
    assert kv.usage == 0.0
    b = req(range(9), "b")
    free_before = kv.num_free_blocks
    assert admit(kv, b) == 8
    # Reviving 2 cached blocks and allocating 1 new one consumes 3 free blocks.
    assert kv.num_free_blocks == free_before - 3
    kv.free(b)
    assert all_free(kv)


def test_reviving_cached_blocks_respects_capacity():
    kv = KVCacheManager(3, BS)
    a = req(range(9), "a")
    admit(kv, a)  # 3 blocks, 2 of them full and cached
    kv.free(a)
    b = req(range(9), "b")
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.allocate_slots(b, 1, hits, reserve_blocks=1)
    assert kv.allocate_slots(b, 1, hits)
    assert kv.num_free_blocks == 0


def test_lru_evicts_uncached_first_then_tail_of_chain_first():
    kv = KVCacheManager(4, BS)
    a = req(range(10), "a")  # blocks: full, full, partial
    admit(kv, a)
    full0, full1, partial = a.block_ids
    kv.free(a)
    order = list(kv.free_blocks)
    assert order[0] == partial  # no hash: evicted first
    assert order.index(full1) < order.index(full0)  # tail of the chain before its head
    # Taking 2 fresh blocks evicts the partial and the unused one, keeping the chain.
    x = req([50] * 8, "x")
    kv.allocate_slots(x, 8)
    assert kv.cached and kv.blocks[full0].block_hash is not None
    assert kv.blocks[full1].block_hash is not None
    # One more evicts the chain's tail, never its head first.
    y = req([60] * 4, "y")
    kv.allocate_slots(y, 4)
    assert y.block_ids == [full1]
    assert kv.blocks[full0].block_hash is not None


def test_hit_moves_block_to_recent_end():
    kv = KVCacheManager(6, BS)
    a, b = req(range(5), "a"), req(range(100, 105), "b")
    admit(kv, a)
    admit(kv, b)
    a_head, b_head = a.block_ids[0], b.block_ids[0]
    kv.free(a)
    kv.free(b)
    a2 = req(range(5), "a2")
    assert admit(kv, a2) == 4
    kv.free(a2)
    order = list(kv.free_blocks)
    assert order.index(b_head) < order.index(a_head)  # a's block was used more recently


def test_collision_guard_checks_tokens_and_parent():
    # Every block hashes to the same value: only the token/parent checks stand
    # between a request and someone else's KV.
    kv = KVCacheManager(16, BS, hash_fn=lambda parent, toks: 42)
    a = req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(kv, a)
    b = req([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")  # second block's tokens equal a's
    assert admit(kv, b) == 0
    c = req([1, 2, 3, 4, 0, 0, 0, 0, 9], "c")
    assert admit(kv, c) == 4  # first block matches for real; second collides, refused
    kv.free(a)
    kv.free(b)
    kv.free(c)
    assert all_free(kv)


def test_shared_blocks_ref_counts():
    kv = KVCacheManager(16, BS)
    rs = [req(list(range(8)) + [100 + i], f"r{i}") for i in range(5)]
    for r in rs:
        admit(kv, r)
    first = rs[0].block_ids[0]
    assert kv.blocks[first].ref_cnt == 5
    for r in rs[:4]:
        kv.free(r)
    assert kv.blocks[first].ref_cnt == 1
    kv.free(rs[4])
    assert all_free(kv)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_caching=False)
    a, b = req(range(9), "a"), req(range(9), "b")
    admit(kv, a)
    assert admit(kv, b) == 0
    assert not kv.cached


def test_hash_is_chained():
    assert hash_block_tokens(0, [1, 2]) != hash_block_tokens(1, [1, 2])
    assert hash_block_tokens(5, [1, 2]) == hash_block_tokens(5, (1, 2))


def test_bad_pool_size():
    with pytest.raises(ValueError):
        KVCacheManager(0, BS)


def test_usage_counts_shared_blocks_once():
    kv = KVCacheManager(10, BS)
    prefix = list(range(8))  # two full blocks, shared by every request below
    a, b, c = (req(prefix + [100 + i], f"r{i}") for i in range(3))
    admit(kv, a)
    assert kv.usage == pytest.approx(3 / 10)
    assert admit(kv, b) == 8 and admit(kv, c) == 8
    # 2 shared blocks + one private tail each: 5 blocks held, not 9.
    assert kv.usage == pytest.approx(5 / 10)
    assert kv.num_free_blocks == 5
    kv.free(a)
    kv.free(b)  # the shared blocks are still held by c
    assert kv.usage == pytest.approx(3 / 10)
    assert [kv.blocks[i].ref_cnt for i in c.block_ids] == [1, 1, 1]
    kv.free(c)
    assert kv.usage == 0.0 and all_free(kv)
    assert len(kv.cached) == 2  # idle, yet the prefix is still cached
    # Reviving the cached prefix takes it out of the free capacity again.
    d = req(prefix + [7], "d")
    assert admit(kv, d) == 8
    assert kv.usage == pytest.approx(3 / 10)
    kv.free(d)
    assert all_free(kv)


def test_eviction_order_follows_a_sequence_of_frees():
    kv = KVCacheManager(12, BS)
    a = req(range(0, 9), "a")  # 2 full blocks + 1 partial
    b = req(range(20, 29), "b")
    c = req(range(40, 48), "c")  # exactly 2 full blocks
    for r in (a, b, c):
        admit(kv, r)
    a0, a1, a2 = a.block_ids
    b0, b1, b2 = b.block_ids
    c0, c1 = c.block_ids
    unused = [i for i in range(12) if i not in a.block_ids + b.block_ids + c.block_ids]
    kv.free(b)
    kv.free(a)
    kv.free(c)
    # A hit on b's head makes it the most recently used (b's tail stays where it was).
    d = req(list(range(20, 24)) + [99], "d")
    assert admit(kv, d) == 4
    assert d.block_ids[1] == a2  # the front of the free list: a's uncached tail
    kv.free(d)
    evicted = []
    for i in range(kv.num_blocks):
        x = req([1000 + i] * BS, f"x{i}")
        assert kv.allocate_slots(x, BS)
        evicted.append(x.block_ids[0])
    # Uncached blocks first (the most recently freed at the very front), then the
    # never-used ones, then cached chains tail first in the order they were freed.
    assert evicted[:2] == [a2, b2]
    assert evicted[2:2 + len(unused)] == unused
    assert evicted[2 + len(unused):] == [b1, a1, a0, c1, c0, b0]


def test_collision_never_serves_kv_computed_after_other_tokens():
    # Two different first blocks collide. b's first block loses the race for the
    # hash, so it is not registered; its second block must not be registered
    # under it either, or after b's first block is reused for a's tokens the
    # parent check would pass and serve KV that was computed after b's tokens.
    a0, b0, y1 = (1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9)

    def colliding(parent, toks):
        toks = tuple(toks)
        return hash_block_tokens(parent, a0 if toks == b0 else toks)

    kv = KVCacheManager(8, BS, hash_fn=colliding)
    r1 = req(a0 + (0,), "r1")
    admit(kv, r1)
    r2 = req(b0 + y1 + (0,), "r2")
    assert admit(kv, r2) == 0  # the collision guard refuses a's block
    r2_head = r2.block_ids[0]
    kv.free(r1)
    filler = req([50] * (BS * kv.num_free_blocks), "filler")
    admit(kv, filler)  # evicts r1's block: a0's hash is free again
    kv.free(filler)
    kv.free(r2)
    w = req(a0 + (0,), "w")
    assert admit(kv, w) == 0
    assert w.block_ids[0] == r2_head  # b's old block now holds a0
    q = req(a0 + y1 + (0,), "q")
    assert admit(kv, q) == 4  # a0 only: y1 was computed after b0, not a0
    for r in (w, q):
        kv.free(r)
    assert all_free(kv)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("windows", [(0,), (0, 3)], ids=["one-group", "window-group"])
def test_random_workload_hits_only_kv_of_the_same_prefix(windows, seed):
    """Model-based: every block remembers the token prefix its KV was computed
    with, and every hit must be exactly that prefix, under heavy hash collisions
    (3 hash values, 2 token values, 2-token blocks, 8 blocks a group); ref
    counts, the free list and usage must stay exact throughout. With a second
    KV cache group whose layers see their last 3 keys (Gemma's windowed
    layers): its hits hold the same prefix's KV, a hit has every block its
    window needs, and a running request holds only those."""
    import random

    rng = random.Random(seed)
    bs = 2
    kv = KVCacheManager(4 + 4 * len(windows), bs, hash_fn=lambda p, t: hash((p, tuple(t))) % 3,
                        windows=windows)
    computed: dict[int, tuple[int, ...]] = {}  # block id -> prefix its KV was computed with
    live: list[Request] = []

    def compute(r, start):
        for ids in (r.block_ids, *r.group_block_ids):
            for i in range(start // bs, len(ids)):
                assert ids[i] != NULL_BLOCK
                computed[ids[i]] = tuple(r.token_ids[: min((i + 1) * bs, r.num_tokens)])

    def first_needed(w, pos):
        return max(0, pos - w + 1) // bs

    for step in range(1000):
        op = rng.random()
        if op < 0.45 and len(live) < 5:
            r = req([rng.randrange(2) for _ in range(rng.randrange(1, 9))], f"{seed}-{step}")
            hits, n = kv.get_computed_blocks(r)
            assert n == len(hits.blocks) * bs < r.num_tokens
            for j, blk in enumerate(hits.blocks):
                assert computed[blk.block_id] == tuple(r.token_ids[: (j + 1) * bs])
            for w, group_hits in zip(windows[1:], hits.groups, strict=True):
                assert len(group_hits) == len(hits.blocks)
                for j, blk in enumerate(group_hits):
                    assert (blk is None) == (j < first_needed(w, n))
                    assert blk is None or computed[blk.block_id] == tuple(
                        r.token_ids[: (j + 1) * bs])
            if kv.allocate_slots(r, r.num_tokens - n, hits):
                compute(r, n)
                r.num_computed_tokens = r.num_tokens
                live.append(r)
            else:
                assert r.block_ids == [] and r.group_block_ids in ([], [[]])
        elif op < 0.75 and live:  # decode one token
            r = rng.choice(live)
            r.append_token(rng.randrange(2))
            if kv.allocate_slots(r, 1):
                for w, ids in zip(windows[1:], r.group_block_ids, strict=True):
                    first = first_needed(w, r.num_computed_tokens)
                    assert [b == NULL_BLOCK for b in ids] == [i < first for i in range(len(ids))]
                compute(r, r.num_computed_tokens)
                r.num_computed_tokens += 1
            else:
                kv.free(r)  # out of blocks: dropped (the scheduler would preempt it)
                live.remove(r)
        elif live:
            kv.free(live.pop(rng.randrange(len(live))))
        held = [b for r in live for ids in (r.block_ids, *r.group_block_ids) for b in ids
                if b != NULL_BLOCK]
        for b in kv.blocks:
            assert b.ref_cnt == held.count(b.block_id)
            assert (b.ref_cnt == 0) == (b.block_id in kv.free_blocks)
            if b.block_hash is not None and b.group == 0:
                assert kv.cached[b.block_hash] is b
                parent = kv.blocks[b.parent_id] if b.parent_id != -1 else None
                if parent is not None and parent.generation == b.parent_generation:
                    assert parent.block_hash is not None  # its parent, not taken since
        assert kv.usage == pytest.approx(len(set(held)) / kv.num_blocks)
    for r in live:
        kv.free(r)
    assert all_free(kv)


def test_a_window_group_releases_what_slid_out_and_hits_need_only_the_window():
    kv = KVCacheManager(40, 4, windows=(0, 6))
    r = req(range(40))
    assert kv.allocate_slots(r, 40)
    assert len(r.block_ids) == len(r.group_block_ids[0]) == 10  # a chunk needs all its blocks
    r.num_computed_tokens = 40
    r.append_token(7)
    assert kv.allocate_slots(r, 1)  # the next query (position 40) sees keys 35-40
    assert r.group_block_ids[0][:8] == [NULL_BLOCK] * 8
    assert kv.num_free_blocks == 40 - 11 - 3
    kv.free(r)
    assert all_free(kv)
    # The same prompt again: a hit of 40 tokens holding only the window's blocks.
    again = req(list(range(40)) + [7, 8], "again")
    hits, n = kv.get_computed_blocks(again)
    assert n == 40 and hits.groups[0][:8] == [None] * 8
    assert all(b is not None for b in hits.groups[0][8:])
    # Evicting a group-0 block makes the window block registered beside it stale.
    peer = hits.blocks[9]
    kv.free_blocks.move_to_end(peer.block_id, last=False)
    kv._take_free(0)
    hits, n = kv.get_computed_blocks(again)
    assert n == 36  # block 9 is gone from group 0; the window's 7 and 8 remain cached


def test_group_layers_pads_the_fewest_layers_in_at_most_eight_groups():
    gemma3_1b = [0 if (i + 1) % 6 == 0 else 512 for i in range(26)]
    g = group_layers(gemma3_1b)
    assert (g.group_size, g.windows) == (4, (0, 512, 512, 512, 512, 512, 512))
    assert [g.layer_group[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert sorted(zip(g.layer_group, g.layer_slot)) == sorted(set(zip(g.layer_group,
                                                                      g.layer_slot)))
    gemma2 = [4096 if i % 2 == 0 else 0 for i in range(26)]
    assert group_layers(gemma2).windows == (0, 4096)
    # One group: no windowed layers, every layer windowed, or asked for.
    for windows, hybrid in (([0] * 4, True), ([8] * 4, True), (gemma2, False)):
        g = group_layers(windows, hybrid)
        assert (g.group_size, g.windows, g.layer_slot) == (len(windows), (0,), tuple(range(
            len(windows))))
    # Blocks one request holds: the window group keeps its window and a chunk.
    assert g.blocks_for(1000, 16, 64) == 63
    g = group_layers(gemma2)
    assert g.blocks_for(1000, 16, 64) == 63 + 63  # a window of 4096 holds them all
    assert group_layers([0, 32, 32, 0]).blocks_for(1000, 16, 64) == 63 + 7


def test_a_hit_shortened_by_a_window_still_caches_what_the_request_computes():
    """A hit cut short because a window group's blocks were evicted recomputes
    blocks group 0 still holds: their window blocks are registered beside the
    cached ones and the chain goes on, so the next turn hits the whole prompt."""
    kv = KVCacheManager(64, 4, windows=(0, 6))
    first = req(range(40), "first")
    assert kv.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    kv.free(first)
    for i in (8, 9):  # evict the window group's last two blocks
        block = kv.group_cached[0][first.block_hashes[i]]
        kv.free_blocks.move_to_end(block.block_id, last=False)
        kv.release([kv._take_free(0).block_id])
    second = req(list(range(40)) + list(range(50, 58)), "second")
    hits, n = kv.get_computed_blocks(second)
    assert n == 32  # the window of a hit at 40 or 36 tokens is gone
    assert kv.allocate_slots(second, second.num_tokens - n, hits)
    second.num_computed_tokens = second.num_tokens
    kv.free(second)
    third = req(second.token_ids + [60, 61], "third")
    hits, n = kv.get_computed_blocks(third)
    assert n == 48
    assert kv.usage == 0


def test_a_chain_whose_ancestor_was_taken_gives_its_hashes_to_the_next_one():
    """A shortened hit continues from an equal cached block it does not hold;
    once that block is evicted, the chain registered after it cannot be reached,
    and a request computing the same prompt again registers its own in its place
    (it stopped at the first such block and the next turn hit less)."""
    kv = KVCacheManager(64, 4, windows=(0, 6))
    first = req(range(40), "first")
    assert kv.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    kv.free(first)

    def evict(block):
        kv.free_blocks.move_to_end(block.block_id, last=False)
        kv.release([kv._take_free(0).block_id])

    for i in (8, 9):  # the window group's last blocks: the next hit is shortened
        evict(kv.group_cached[0][first.block_hashes[i]])
    tokens = list(range(40)) + list(range(50, 58))

    def run(name):
        r = req(tokens, name)
        hits, n = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, r.num_tokens - n, hits)
        r.num_computed_tokens = r.num_tokens
        kv.free(r)
        return r, n

    second, n = run("second")
    assert n == 32
    evict(kv.cached[first.block_hashes[9]])  # the equal block the second chain continued from
    third, n = run("third")
    assert n == 36  # block 9 is gone: recomputed from there, the second's 10 and 11 replaced
    fourth, n = run("fourth")
    assert n == 44  # the whole prompt but its last token's block
    assert kv.usage == 0
