"""KVCacheManager: allocation, ref counts, LRU eviction, prefix hits and the collision guard."""

import pytest

from tandem.engine.block_manager import KVCacheManager, hash_block_tokens
from tandem.engine.request import Request
from tandem.sampling_params import SamplingParams

BS = 4


def req(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), 8, None)


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
