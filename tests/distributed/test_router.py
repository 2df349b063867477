"""PrefixRouter: prefix affinity, the overload and match thresholds, health."""

from __future__ import annotations

import pytest

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_cache_utils import chain_block_hashes
from tandem.core.request import Request
from tandem.distributed.router import PrefixRouter
from tandem.sampling_params import SamplingParams

BS = 4


def prompt(head: int, n: int, tail: int = 0) -> list[int]:
    """n tokens: a shared head (by seed) and then a distinct tail."""
    return [head * 1000 + i for i in range(n)] + [tail * 7 + 1] * 3


def test_router_hashes_are_the_prefix_caches():
    """The router hashes what the cache manager hashes (same function, same chain)."""
    ids = list(range(23))
    req = Request("r", ids, SamplingParams(), 4)
    kv = KVCacheManager(16, BS)
    kv.get_computed_blocks(req)  # fills req.block_hashes over (23 - 1) // 4 blocks
    assert PrefixRouter(2, BS).hashes(ids) == req.block_hashes
    assert chain_block_hashes(ids, BS, 5) == req.block_hashes


def test_shared_prefix_sticks_and_new_prefixes_spread():
    r = PrefixRouter(2, BS)
    first = r.choose(prompt(1, 40, tail=1))
    assert r.choose(prompt(1, 40, tail=2)) == first  # same 40-token head: the same replica
    assert r.num_prefix_routed == 1
    other = r.choose(prompt(2, 40))
    assert other != first  # a new prefix goes to the replica with fewer routed
    assert r.choose(prompt(2, 40, tail=5)) == other


def test_a_short_shared_head_does_not_bind():
    """A match under min_match of the prompt (say a template's default system
    prompt) leaves the choice to load."""
    r = PrefixRouter(2, BS, min_match=0.5)
    a = r.choose([9] * 8 + list(range(100, 140)))
    b = r.choose([9] * 8 + list(range(200, 240)))
    assert a != b and r.num_prefix_routed == 0


def test_overloaded_owner_is_passed_over():
    r = PrefixRouter(2, BS, max_waiting=2, max_kv_usage=0.9)
    owner = r.choose(prompt(1, 40))
    r.update(owner, num_waiting=2, kv_cache_usage=0.1, max_num_seqs=8)
    assert r.choose(prompt(1, 40)) != owner
    r.update(owner, num_waiting=0, kv_cache_usage=0.95, max_num_seqs=8)
    assert r.choose(prompt(1, 40)) != owner
    r.update(owner, num_waiting=0, kv_cache_usage=0.1, max_num_seqs=8)
    for _ in range(10):  # its own in-flight requests past its batch count as waiting
        r.started(owner)
    assert r.overloaded(owner)


def test_least_loaded_by_in_flight():
    r = PrefixRouter(3, BS)
    r.started(0), r.started(0), r.started(1)
    assert r.choose(list(range(50))) == 2
    r.finished(0), r.finished(0)
    assert r.choose(list(range(100, 150))) == 0


def test_unhealthy_and_excluded_replicas_get_nothing():
    r = PrefixRouter(2, BS)
    owner = r.choose(prompt(1, 40))
    r.set_healthy(owner, False)
    assert r.choose(prompt(1, 40)) == 1 - owner
    with pytest.raises(LookupError):
        r.choose(prompt(1, 40), exclude=[1 - owner])
    r.set_healthy(owner, True)
    r.forget(1 - owner)  # restarted: its cache is empty, its prefixes forgotten
    assert all(v != 1 - owner for v in r._owner.values())


def test_memory_is_bounded():
    r = PrefixRouter(2, BS, capacity=8)
    for head in range(10):
        r.choose(prompt(head, 40))
    assert len(r._owner) == 8


def test_bad_replica_count():
    with pytest.raises(ValueError, match="at least one replica"):
        PrefixRouter(0, BS)
