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
