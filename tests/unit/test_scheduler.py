"""Scheduler without a model: how a step's token budget is shared between decodes and prompts."""

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request
from tandem.core.scheduler import Scheduler
from tandem.sampling_params import SamplingParams


def scheduler(budget: int, prompt_cap: int | None, max_num_seqs: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(256, 4, False), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_prefill_tokens_with_decodes=prompt_cap)


def start_decoding(sched: Scheduler, n: int) -> None:
    """n running requests, each with its prompt computed and one token to decode."""
    for i in range(n):
        sched.add_request(Request(f"d{i}", [1, 2, 3], SamplingParams(max_tokens=8), 8))
    assert sched.schedule(0.0).num_scheduled_tokens == [3] * n
    for r in sched.running:
        r.num_computed_tokens = r.num_tokens
        r.append_token(7)


def test_decodes_come_first_and_prompts_get_the_cap_beside_them():
    sched = scheduler(budget=512, prompt_cap=24)
    start_decoding(sched, 5)
    sched.add_request(Request("p1", list(range(1, 21)), SamplingParams(max_tokens=1), 1))
    sched.add_request(Request("p2", list(range(1, 101)), SamplingParams(max_tokens=1), 1))
    out = sched.schedule(1.0)
    # Five decodes, then p1 whole and p2 chunked to what the cap leaves.
    assert out.num_scheduled_tokens == [1] * 5 + [20, 4]
    # The next step continues p2's chunk under the same cap.
    for r, n in zip(out.requests, out.num_scheduled_tokens):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
    assert sched.schedule(2.0).num_scheduled_tokens == [1] * 6 + [24]


def test_without_decodes_or_cap_prompts_take_the_whole_budget():
    sched = scheduler(budget=100, prompt_cap=16)
    sched.add_request(Request("p", list(range(1, 301)), SamplingParams(max_tokens=1), 1))
    assert sched.schedule(0.0).num_scheduled_tokens == [100]  # nobody decodes
    uncapped = scheduler(budget=100, prompt_cap=None)  # an explicit budget: vLLM's semantics
    start_decoding(uncapped, 3)
    uncapped.add_request(Request("p", list(range(1, 301)), SamplingParams(max_tokens=1), 1))
    assert uncapped.schedule(1.0).num_scheduled_tokens == [1, 1, 1, 97]


def test_max_num_seqs_holds_back_admission_not_decodes():
    sched = scheduler(budget=512, prompt_cap=None, max_num_seqs=4)
    start_decoding(sched, 4)
    sched.add_request(Request("p", [1, 2, 3], SamplingParams(max_tokens=1), 1))
    assert sched.schedule(1.0).num_scheduled_tokens == [1, 1, 1, 1]
    assert sched.num_waiting == 1


def advance(out) -> None:
    """What the engine does after a step: count the computed tokens, sample at the end."""
    for r, n in zip(out.requests, out.num_scheduled_tokens):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)


def prompt(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), 4)


def test_a_short_prompt_does_not_wait_out_a_long_prompts_prefill():
    sched = scheduler(budget=512, prompt_cap=8)
    start_decoding(sched, 1)
    sched.add_request(prompt("long", 300))
    out = sched.schedule(1.0)
    assert out.num_scheduled_tokens == [1, 8]
    advance(out)
    sched.add_request(prompt("short", 10))
    # The long prompt keeps half of the cap; the short one gets the rest.
    out = sched.schedule(2.0)
    assert [r.request_id for r in out.requests] == ["d0", "long", "short"]
    assert out.num_scheduled_tokens == [1, 4, 4]
    advance(out)
    out = sched.schedule(3.0)
    assert out.num_scheduled_tokens == [1, 4, 4]
    advance(out)
    # Two prompts in progress: the short one's last 2 tokens, the long one the rest.
    out = sched.schedule(3.5)
    assert out.num_scheduled_tokens == [1, 6, 2]
    advance(out)
    assert sched.running[2].num_output_tokens == 1  # the short prompt's first token
    assert sched.schedule(4.0).num_scheduled_tokens == [1, 8, 1]  # and it decodes


def test_without_decodes_the_short_prompt_is_admitted_in_the_same_step():
    sched = scheduler(budget=100, prompt_cap=16)
    sched.add_request(prompt("long", 300))
    advance(sched.schedule(0.0))
    sched.add_request(prompt("short", 30))
    out = sched.schedule(1.0)
    assert out.num_scheduled_tokens == [70, 30]
    # A prompt longer than the one in progress waits its turn, as before.
    sched = scheduler(budget=100, prompt_cap=16)
    sched.add_request(prompt("long", 120))
    advance(sched.schedule(0.0))
    sched.add_request(prompt("longer", 300))
    assert sched.schedule(1.0).num_scheduled_tokens == [20, 80]


def test_short_arrivals_never_starve_the_oldest_prompt():
    sched = scheduler(budget=512, prompt_cap=8)
    start_decoding(sched, 1)
    sched.add_request(prompt("long", 100))
    long_req = sched.waiting[0]
    for step in range(10):
        done = long_req.num_computed_tokens
        sched.add_request(prompt(f"s{step}", 8))  # the whole cap
        advance(sched.schedule(float(step)))
        assert long_req.num_computed_tokens - done >= 4  # half the cap


def test_a_share_the_queues_head_cannot_take_goes_back():
    # 19 blocks of 4 tokens: the long prompt's second chunk leaves too few for the head.
    sched = Scheduler(KVCacheManager(19, 4, False), max_num_seqs=8, max_num_batched_tokens=40)
    sched.add_request(prompt("long", 76))
    advance(sched.schedule(0.0))
    sched.add_request(prompt("short", 8))
    out = sched.schedule(1.0)
    assert [r.request_id for r in out.requests] == ["long"]
    assert out.num_scheduled_tokens == [36]
    assert sched.num_waiting == 1


def test_a_short_prompt_is_admitted_past_a_long_one_queued_ahead_of_it():
    sched = scheduler(budget=512, prompt_cap=8)
    start_decoding(sched, 1)
    sched.add_request(prompt("long1", 40))
    advance(sched.schedule(1.0))  # long1 in progress
    sched.add_request(prompt("long2", 300))
    sched.add_request(prompt("short", 4))
    out = sched.schedule(2.0)
    # long1, the oldest, keeps half; the short one is admitted past long2.
    assert [r.request_id for r in out.requests] == ["d0", "long1", "short"]
    assert out.num_scheduled_tokens == [1, 4, 4]
    assert [r.request_id for r in sched.waiting] == ["long2"]
    advance(out)
    # While long1 runs, long2 waits; each step long1 keeps its half.
    for step in range(3, 12):
        sched.add_request(prompt(f"s{step}", 8))
        out = sched.schedule(float(step))
        advance(out)
        ids = [r.request_id for r in out.requests]
        if "long2" in ids:
            break
        assert ids[1] == "long1" and out.num_scheduled_tokens[1] >= 4
    # Once long1 is done, long2 is the oldest prompt: admitted with half, despite the shorts.
    assert out.num_scheduled_tokens[ids.index("long2")] == 4


def test_waiting_for_kv_counts_only_what_the_pool_could_not_take():
    """Requests held back by the token budget are not waiting for blocks (the server's
    admission gives them their slots); ones the pool could not take are."""
    sched = scheduler(budget=8, prompt_cap=None)
    for i in range(3):
        sched.add_request(Request(f"p{i}", list(range(1, 41)), SamplingParams(max_tokens=1), 1))
    sched.schedule(0.0)
    assert sched.num_waiting == 2 and sched.num_waiting_for_kv == 0
    full = Scheduler(KVCacheManager(4, 4, False), max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):  # 8 tokens = 2 of the 4 blocks each (one kept spare per runner)
        full.add_request(Request(f"q{i}", list(range(1, 9)), SamplingParams(max_tokens=1), 1))
    full.schedule(0.0)
    assert full.num_running == 1 and full.num_waiting_for_kv == full.num_waiting == 2
