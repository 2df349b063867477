"""AsyncEngine.request_states: the per-request snapshot the dashboard's table shows,
taken by the engine thread between steps; and the step-composition counters."""

from __future__ import annotations

import asyncio

from tandem.sampling_params import SamplingParams
from tests.server.conftest import slow_down, tiny_engine


def test_states_follow_a_request_through_queue_prefill_decode_and_preemption(
        tiny_config_path):
    # 8 blocks of 4 tokens (128 B a token, fp16): two requests growing to 28 tokens
    # cannot both fit, and a 4-token budget prefills a 12-token prompt in three chunks.
    engine = slow_down(tiny_engine(tiny_config_path, kv_cache_memory="4KiB", max_model_len=32,
                                   max_num_seqs=2, max_num_batched_tokens=4), 0.005)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    seen: dict[str, set[str]] = {"a": set(), "b": set(), "c": set()}
    rows: list = []

    async def run() -> None:
        async def gen(rid: str, prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, params, request_id=rid):
                pass

        tasks = [asyncio.ensure_future(gen("a", list(range(1, 13)))),
                 asyncio.ensure_future(gen("b", list(range(20, 32)))),
                 asyncio.ensure_future(gen("c", [5, 6, 7]))]
        while not all(t.done() for t in tasks):
            for r in await engine.request_states():
                seen[r.request_id].add(r.state)
                rows.append(r)
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert seen["c"] >= {"queued"}  # a third request waits for one of the two slots
    assert "prefill" in seen["a"] | seen["b"] and "decode" in seen["a"] | seen["b"]
    assert "preempted" in set().union(*seen.values()) and stats.num_preemptions > 0
    for r in rows:
        assert 0 <= r.num_computed_tokens <= r.num_prompt_tokens + r.num_output_tokens
        if r.state == "prefill":
            assert r.num_computed_tokens < r.num_prompt_tokens + r.num_output_tokens - 1
        if r.state == "queued":
            assert r.num_computed_tokens == 0 and r.num_output_tokens == 0
        if r.output_tokens_per_s is not None:
            assert r.num_output_tokens > 1 and r.output_tokens_per_s > 0
    # Every token computed was scheduled, prompts (and their recomputes) as prefill.
    assert stats.num_steps > 0
    assert stats.scheduled_tokens_total >= stats.generation_tokens_total
    assert 12 + 12 + 3 + 3 * 15 <= stats.scheduled_tokens_total
    assert stats.prefill_tokens_total >= 12 + 12 + 3
    # decodes compute each output token but the last
    assert stats.scheduled_tokens_total - stats.prefill_tokens_total <= 3 * 15
    assert stats.num_kv_blocks == 8


def test_states_of_an_idle_or_stopped_engine(tiny_config_path):
    engine = tiny_engine(tiny_config_path)
    assert asyncio.run(engine.request_states()) == []  # answered while the loop sleeps
    engine.shutdown()
    assert asyncio.run(engine.request_states()) == []  # and once it is gone
