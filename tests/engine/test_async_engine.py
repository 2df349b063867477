"""AsyncEngine: overlapping callers, abort on disconnect, phase timings."""

from __future__ import annotations

import asyncio

import pytest

from tandem import AsyncEngine, SamplingParams
from tandem.config import EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_config_path):
    eng = AsyncEngine(EngineConfig(model=tiny_config_path, load_format="dummy",
                                   skip_tokenizer_init=True, block_size=4,
                                   kv_cache_memory="1MiB", max_model_len=128))
    yield eng
    eng.shutdown()


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
