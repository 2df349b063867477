"""AsyncEngine: overlapping callers, abort on disconnect, phase timings."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tandem import AsyncEngine, SamplingParams
from tandem.config import EngineConfig
from tandem.engine import llm_engine
from tandem.engine.client import EngineDeadError
from tandem.engine.llm_engine import LLMEngine
from tests.unit.test_kv_cache import needs_populate, resident_fraction


@pytest.fixture(scope="module")
def engine(tiny_config_path):
    eng = AsyncEngine(EngineConfig(model=tiny_config_path, load_format="dummy",
                                   skip_tokenizer_init=True, block_size=4,
                                   kv_cache_memory="1MiB", max_model_len=128))
    yield eng
    eng.shutdown()


@needs_populate
def test_the_kv_pool_is_committed_beside_the_engine(tiny_config_path):
    """A server's engine faults its whole CPU pool in from a thread of its own
    right after start-up (LLMEngine.commit_kv_pool), so no step does later."""
    eng = AsyncEngine(EngineConfig(model=tiny_config_path, load_format="dummy",
                                   skip_tokenizer_init=True, kv_cache_memory="32MiB"))
    try:
        eng._commit.join(timeout=60)
        pool = [t for c in eng.engine.kv_caches for t in c.tensors]
        assert sum(t.numel() * t.element_size() for t in pool) >= 31 << 20
        assert all(resident_fraction(t) == 1.0 for t in pool)
    finally:
        eng.shutdown()


def test_a_pool_larger_than_free_memory_is_not_committed(tiny_config_path, monkeypatch,
                                                         caplog):
    """Committing a pool the machine cannot hold would end the server within
    seconds of starting: it is left to fault in as it fills, with a warning."""
    engine = LLMEngine(EngineConfig(model=tiny_config_path, load_format="dummy",
                                    skip_tokenizer_init=True, kv_cache_memory="32MiB"))
    monkeypatch.setattr(llm_engine, "host_memory", lambda: (1 << 30, 16 << 20))
    with caplog.at_level(logging.WARNING, logger="tandem.engine.llm_engine"):
        engine.commit_kv_pool()
    assert "lower --kv-cache-memory" in caplog.text
    pool = [t for c in engine.kv_caches for t in c.tensors]
    assert all(resident_fraction(t) < 0.5 for t in pool)


async def collect(engine, ids, n):
    outs = [o async for o in engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True))]
    return outs


def test_many_callers_overlap(engine):
    async def main():
        return await asyncio.gather(*[collect(engine, [1 + i, 2, 3], 5 + i) for i in range(8)])

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert [len(o.new_token_ids) for o in outs] == [1] * (5 + i)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5 + i
        m = outs[-1].metrics
        assert m.first_token_time <= m.finished_time and m.num_output_tokens == 5 + i
    # They overlapped: some request's first token came before another finished.
    firsts = [r[-1].metrics.first_token_time for r in results]
    lasts = [r[-1].metrics.finished_time for r in results]
    assert max(firsts) < min(lasts)


def test_consumer_leaving_aborts_and_frees_blocks(engine):
    kv = engine.engine.kv_manager

    async def main():
        gen = engine.generate([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        async for _ in gen:
            break  # the client went away after the first token
        await gen.aclose()
        for _ in range(200):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not engine.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_bad_input_raises_before_queueing(engine):
    async def main():
        with pytest.raises(ValueError):
            async for _ in engine.generate([], SamplingParams()):
                pass

    asyncio.run(main())


def test_one_cross_thread_call_per_step_and_stop_strings_on_the_loop(default_model_dir):
    """Outputs cross to the event loop as one batch per step; a stop string found
    there ends the stream at once and the engine frees the request's blocks."""
    eng = AsyncEngine(EngineConfig(kv_cache_memory="64MiB", max_model_len=256))
    calls = []
    real = asyncio.BaseEventLoop.call_soon_threadsafe

    def counting(loop, cb, *args, **kwargs):
        calls.append(cb)
        return real(loop, cb, *args, **kwargs)

    try:
        async def main():
            free = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
            plain = [o async for o in eng.generate("One, two, three, four,", free)]
            text = "".join(o.delta_text for o in plain)
            stop = text.split()[2]  # a word the greedy continuation reaches
            before = eng.engine.num_steps
            asyncio.BaseEventLoop.call_soon_threadsafe = counting
            gens = [eng.generate("One, two, three, four,", SamplingParams(
                max_tokens=12, ignore_eos=True, temperature=0, stop=[stop]))
                for _ in range(4)]
            stopped = await asyncio.gather(*[_collect(g) for g in gens])
            asyncio.BaseEventLoop.call_soon_threadsafe = real
            return text, stop, stopped, eng.engine.num_steps - before

        text, stop, stopped, steps = asyncio.run(main())
        for outs in stopped:
            final = outs[-1]
            assert final.finished and final.outputs[0].finish_reason == "stop"
            assert final.outputs[0].stop_reason == stop
            assert "".join(o.delta_text for o in outs) == text[:text.index(stop)]
            assert final.outputs[0].text == text[:text.index(stop)]
        # four streams, one batch per step (not one call per request per step)
        assert 0 < len(calls) <= steps
        for _ in range(200):
            if eng.engine.kv_manager.usage == 0 and not eng.engine.has_unfinished_requests():
                break
            time.sleep(0.01)
        assert eng.engine.kv_manager.usage == 0 and not eng.engine.requests
    finally:
        asyncio.BaseEventLoop.call_soon_threadsafe = real
        eng.shutdown()


async def _collect(gen):
    return [o async for o in gen]


def test_an_id_a_stop_string_freed_can_be_used_again_at_once(default_model_dir):
    """A stop string ends the stream before the engine lets the request go: the
    same id sent again at once reached the engine first, add_request raised in
    the engine thread and killed it, and every later call waited forever."""
    eng = AsyncEngine(EngineConfig(kv_cache_memory="64MiB", max_model_len=256))
    try:
        async def main():
            free = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
            text = "".join([o.delta_text async for o in eng.generate("One, two, three,", free)])
            params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0,
                                    stop=[text.split()[1]])
            finals = []
            for _ in range(3):
                outs = [o async for o in eng.generate("One, two, three,", params,
                                                      request_id="X")]
                finals.append(outs[-1].outputs[0])
            return finals

        finals = asyncio.run(asyncio.wait_for(main(), 60))
        assert all(f.finish_reason == "stop" for f in finals) and not eng.dead
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_callers_of_a_dead_engine_thread_hear_so(engine, monkeypatch):
    """However the engine thread ends, a caller waiting gets EngineDeadError and a
    new one is refused at once (they waited forever)."""
    eng = AsyncEngine(engine=engine.engine)

    def broken(req):
        raise RuntimeError("not a step's failure")

    async def main():
        gen = eng.generate([1, 2, 3], SamplingParams(max_tokens=4))
        monkeypatch.setattr(eng.engine, "add_request", broken)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        eng._thread.join(timeout=10)
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=4)):
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        monkeypatch.undo()
        eng.shutdown()
