"""Scheduler/engine invariants on a tiny random-weight model (no tokenizer, fast).

After every workload: all blocks free with ref count 0, no request lost, every
step within the token budget and the sequence cap, and outputs independent of
how the work was scheduled (chunking, preemption, batch composition).
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.config import EngineConfig
from tandem.core.request import RequestStatus
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

BLOCK = 4
# Per token: 2 layers x K,V x 2 kv heads x head_dim 8 x 4 bytes (fp32) = 256 bytes,
# x 2 bytes (fp16, auto's on CPU) = 128, or x (8 + 4-byte scale) bytes with the int8
# cache = 96.
BYTES_PER_TOKEN = {"fp32": 256, "auto": 128, "fp16": 128, "bf16": 128, "int8": 96}


def make_engine(tiny_config_path, num_blocks=64, kv_cache_dtype="auto", **kw) -> LLMEngine:
    kw.setdefault("max_model_len", min(num_blocks * BLOCK, 256))
    engine = LLMEngine(EngineConfig(
        model=tiny_config_path, load_format="dummy", skip_tokenizer_init=True,
        block_size=BLOCK, kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=num_blocks * BLOCK * BYTES_PER_TOKEN[kv_cache_dtype], **kw,
    ))
    assert engine.kv_manager.num_blocks == num_blocks
    return engine


def run_workload(engine: LLMEngine, arrivals: list[tuple[int, list[int], int]]):
    """arrivals: (step at which to add, prompt ids, max_tokens). Checks per-step limits."""
    sched = engine.scheduler
    pending = sorted(arrivals, key=lambda a: a[0])
    rids, done = [], {}
    step = 0
    original_schedule = sched.schedule

    def checked_schedule(now):
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running)
        left = {id(r): r.num_tokens - r.num_computed_tokens for r in sched.running}
        out = original_schedule(now)
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        prompt = sum(n for r, n in zip(out.requests, out.num_scheduled_tokens)
                     if left.get(id(r)) != 1)
        cap = sched.max_prefill_tokens_with_decodes
        if decoding and cap is not None:  # a chunk delays every decoding stream
            assert prompt <= cap
        assert len(sched.running) <= sched.max_num_seqs
        assert len(out.requests) == len({id(r) for r in out.requests})
        assert all(n >= 1 for n in out.num_scheduled_tokens)
        # Only the last scheduled request may stop short of its tokens (a chunk),
        # unless prompts shared the step's prompt tokens and spent them all
        # (a 1-token prompt counts as a decode above), or the pool had no block
        # for another token of each request stopped short.
        short = [(r, n) for r, n in zip(out.requests, out.num_scheduled_tokens)
                 if r.num_computed_tokens + n < r.num_tokens]
        spent = ((decoding and cap is not None and prompt >= cap - sum(
                    1 for r in out.requests if left.get(id(r), r.num_tokens) == 1))
                 or out.total_num_scheduled_tokens == sched.max_num_batched_tokens)
        no_room = all(-(-(r.num_computed_tokens + n + 1) // BLOCK) - len(r.block_ids)
                      > sched.kv.num_free_blocks for r, n in short)
        assert [r for r, _ in short] in ([], out.requests[-1:]) or spent or no_room
        return out

    sched.schedule = checked_schedule
    try:
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, ids, n = pending.pop(0)
                p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                rids.append(engine.add_request(ids, p).request_id)
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in done
                    done[out.request_id] = out
            step += 1
            assert step < 10_000, "engine made no progress"
    finally:
        sched.schedule = original_schedule
    assert set(done) == set(rids), "a request was lost"
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.blocks)
    assert not engine.requests
    return [done[r] for r in rids]


def test_continuous_batching_joins_and_leaves(tiny_config_path):
    engine = make_engine(tiny_config_path, max_num_seqs=2)
    outs = run_workload(engine, [(0, [5, 6, 7], 3), (0, [8, 9], 10), (0, [10, 11, 12], 4)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 10, 4]
    # The third request joined as soon as the first left, not after the second.
    third, second = outs[2].metrics, outs[1].metrics
    assert third.first_token_time < second.finished_time


@pytest.mark.parametrize("quantization,kv_cache_dtype",
                         [("none", "fp32"), ("none", "auto"), ("int8", "auto"), ("int4", "int8")])
def test_preemption_keeps_output_identical(tiny_config_path, quantization, kv_cache_dtype):
    rng = random.Random(0)
    arrivals = [(0, [rng.randrange(1, 128) for _ in range(rng.randint(3, 20))], 24)
                for _ in range(6)]
    kw = {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    ref = [o.outputs[0].token_ids
           for o in run_workload(make_engine(tiny_config_path, **kw), arrivals)]
    small = make_engine(tiny_config_path, num_blocks=14, max_model_len=48, **kw)
    outs = run_workload(small, arrivals)
    assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_chunked_prefill_mixes_with_decodes(tiny_config_path):
    engine = make_engine(tiny_config_path, max_num_batched_tokens=8)
    seen_mixed = []
    original = engine.scheduler.schedule

    def spy(now):
        out = original(now)
        ns = out.num_scheduled_tokens
        if 1 in ns and any(n > 1 for n in ns):
            seen_mixed.append(ns)
        return out

    engine.scheduler.schedule = spy
    run_workload(engine, [(0, list(range(1, 6)), 20), (3, list(range(1, 60)), 5)])
    assert seen_mixed, "a prefill chunk never ran in the same step as a decode"


def test_a_short_prompt_overtakes_a_chunked_long_one_with_the_same_output(tiny_config_path):
    long_ids, short_ids = [(7 * i) % 120 + 1 for i in range(150)], [3, 1, 4, 1, 5, 9]
    alone = [run_workload(make_engine(tiny_config_path), [(0, ids, 4)])[0].outputs[0].token_ids
             for ids in (long_ids, short_ids)]
    engine = make_engine(tiny_config_path, max_num_batched_tokens=8)
    long_out, short_out = run_workload(engine, [(0, long_ids, 4), (2, short_ids, 4)])
    assert short_out.metrics.first_token_time < long_out.metrics.first_token_time
    assert [long_out.outputs[0].token_ids, short_out.outputs[0].token_ids] == alone


def test_abort_frees_blocks(tiny_config_path):
    engine = make_engine(tiny_config_path)
    r = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert r.block_ids
    out = engine.abort_request(r.request_id)
    assert out.status is RequestStatus.FINISHED_ABORTED and out.new_token_ids == []
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert not engine.has_unfinished_requests()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    reqs=st.lists(
        st.tuples(st.integers(0, 12), st.integers(1, 24), st.integers(1, 12)),
        min_size=1, max_size=10,
    ),
    caching=st.booleans(),
    prompt_cap=st.one_of(st.none(), st.integers(1, 16)),
    seed=st.integers(0, 1000),
    quantization=st.sampled_from(["none", "int8", "int4"]),
    kv_cache_dtype=st.sampled_from(["auto", "fp32", "bf16", "int8"]),
)
def test_random_workloads_keep_invariants(
    tiny_config_path, num_blocks, budget, max_seqs, reqs, caching, prompt_cap, seed,
    quantization, kv_cache_dtype,
):
    rng = random.Random(seed)
    max_len = num_blocks * BLOCK
    arrivals = []
    for at, plen, n in reqs:
        plen = min(plen, max_len - n)
        if plen < 1:
            continue
        # Repeated prefixes so the prefix cache is exercised.
        ids = [rng.choice([1, 2, 3]) if i < 8 else rng.randrange(1, 128) for i in range(plen)]
        arrivals.append((at, ids, n))
    if not arrivals:
        return
    arrivals.sort(key=lambda a: a[0])  # run_workload returns outputs in arrival order
    engine = make_engine(
        tiny_config_path, num_blocks=num_blocks, max_num_batched_tokens=budget,
        max_num_seqs=max_seqs, enable_prefix_caching=caching, max_model_len=max_len,
        quantization=quantization, kv_cache_dtype=kv_cache_dtype,
    )
    # The CPU default's cap on prompt tokens in steps with decodes.
    engine.scheduler.max_prefill_tokens_with_decodes = prompt_cap
    outs = run_workload(engine, arrivals)
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, _, n in arrivals]


def test_bad_requests_are_value_errors(tiny_config_path):
    engine = make_engine(tiny_config_path, max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="context length"):
        engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="30 in the prompt"):
        engine.add_request(list(range(1, 31)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 500])
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text without a tokenizer")
    assert not engine.has_unfinished_requests()


def test_cpu_token_budget_follows_the_models_cost(tiny_config_path, monkeypatch):
    """Without --max-num-batched-tokens a CPU engine measures a step's cost (t1 for
    one token, c per further token): prompts get 2 t1 / c tokens in steps with
    decodes, and the total leaves room for every sequence beside them."""
    t1, c = 0.03, 0.003

    def timed_forward(self, token_ids, logits_rows=None):
        time.sleep(t1 + (len(token_ids) - 1) * c)

    monkeypatch.setattr(LLMEngine, "score_tokens", timed_forward)
    engine = make_engine(tiny_config_path, max_num_seqs=8)
    cap = engine.scheduler.max_prefill_tokens_with_decodes
    assert 16 <= cap <= 21  # 2 t1 / c = 20, less any timer overshoot
    assert engine.max_num_batched_tokens >= 8 + cap
    assert engine.max_num_batched_tokens >= 70  # prompt-only steps: ~1 + 8 t1 / c
    monkeypatch.undo()
    explicit = make_engine(tiny_config_path, max_num_batched_tokens=32)
    assert explicit.scheduler.max_prefill_tokens_with_decodes is None  # vLLM's semantics
