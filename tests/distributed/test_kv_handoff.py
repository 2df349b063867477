"""The KV hand-off API: export a finished prefill's blocks, import them into
another engine's pool as prefix-cache blocks (no Ray: two engines in-process)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.distributed.replica import PackedKV, continued_request
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.client import EngineDeadError
from tandem.engine.kv_handoff import KVBlocks
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

BS = 4  # the cache manager tests' block size


def test_import_prefix_registers_a_chain_then_frees_it():
    kv = KVCacheManager(8, BS)
    ids = list(range(10))  # two full blocks and a partial one
    held, fresh = kv.import_prefix(ids)
    assert fresh == [0, 1] and [b.ref_cnt for b in held] == [1, 1]
    assert held[1].parent_id == held[0].block_id
    kv.release([b.block_id for b in held])
    assert kv.num_free_blocks == 8  # held by no one: free, and still cached
    assert [b.block_id for b in kv.cached_prefix(ids)] == [b.block_id for b in held]
    # a second import of a longer prompt reuses the cached head, writes only the rest
    held2, fresh2 = kv.import_prefix(list(range(13)))
    assert fresh2 == [2] and [b.block_id for b in held2[:2]] == [b.block_id for b in held]
    kv.release([b.block_id for b in held2])
    assert kv.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.blocks)


def test_import_prefix_stops_when_the_pool_is_held():
    kv = KVCacheManager(2, BS)
    held, fresh = kv.import_prefix(list(range(16)))  # four blocks wanted, two exist
    assert len(held) == 2 and fresh == [0, 1]
    kv.release([b.block_id for b in held])


@pytest.fixture(scope="module")
def engines():
    """Two engines of the default model (a random tiny model decodes one token
    forever, whatever its KV holds), prompts chunked 16 tokens a step, fp32
    weights: with activations quantized per group, a prompt computed in other
    chunks (the decoder recomputes the partial last block) may flip a near-tie."""
    kw = dict(kv_cache_memory="32MiB", max_num_batched_tokens=16, num_threads=1,
              quantization="none")
    return LLMEngine(**kw), LLMEngine(**kw)


def _run(engine: LLMEngine, req):
    engine.add_request(req)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out if out.finished else last
    return last


def test_handoff_decodes_what_one_engine_decodes(engines):
    """Prefill on one engine (first token), KV exported and imported, decode on the
    other: greedy ids equal one engine's run; the prompt's whole blocks are hits."""
    a, b = engines
    ids = a.tokenizer.encode("Once upon a time, in a kingdom by the sea, there lived " * 3)
    bs = a.config.block_size
    whole = len(ids) // bs * bs
    assert whole and whole < len(ids)  # a partial block too, recomputed by the decoder
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = _run(b, b.make_request(ids, params, "ref")).outputs[0].token_ids
    first = _run(b, b.make_request(ids, SamplingParams(temperature=0, max_tokens=1), "p"))
    kv = b.export_kv(ids)
    assert len(kv.token_ids) == whole
    assert kv.nbytes == whole * b.kv_bytes_per_token
    assert a.kv_manager.cached_prefix(ids) == []  # a never saw this prompt: all written
    assert a.import_kv(kv) == whole
    out = _run(a, continued_request(a, ids, params, "d", first.outputs[0].token_ids[0]))
    assert out.outputs[0].token_ids == ref
    assert out.metrics.num_cached_tokens == whole
    assert a.kv_manager.num_free_blocks == a.kv_manager.num_blocks  # nothing left held


def test_import_converts_16_bit_kv_and_refuses_int8():
    """auto is bf16 or fp16 by each CPU's features: a prefill replica's fp16 K/V
    go into a bf16 pool rounded once; int8 K/V (with scales) do not fit a float pool."""
    kw = dict(kv_cache_memory="32MiB", max_num_batched_tokens=16, num_threads=1,
              quantization="none")
    fp16, bf16, q8 = (LLMEngine(kv_cache_dtype=d, **kw) for d in ("fp16", "bf16", "int8"))
    ids = fp16.tokenizer.encode("The history of the printing press begins " * 3)
    _run(fp16, fp16.make_request(ids, SamplingParams(temperature=0, max_tokens=1), "p"))
    kv = fp16.export_kv(ids)
    assert kv.tensors[0].dtype == torch.float16
    assert bf16.import_kv(kv) == len(kv.token_ids)
    back = bf16.export_kv(ids)
    assert back.tensors[0].dtype == torch.bfloat16
    assert torch.equal(back.tensors[0], kv.tensors[0].to(torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        q8.import_kv(kv)
    _run(q8, q8.make_request(ids, SamplingParams(temperature=0, max_tokens=1), "q"))
    with pytest.raises(ValueError, match="do not fit"):
        fp16.import_kv(q8.export_kv(ids))


def test_import_refuses_kv_of_another_model(engines, tiny_config_path):
    a, _ = engines
    tiny = LLMEngine(model=tiny_config_path, load_format="dummy", skip_tokenizer_init=True,
                     kv_cache_memory="1MiB", max_num_batched_tokens=8, num_threads=1)
    ids = list(range(1, 40))
    _run(tiny, tiny.make_request(ids, SamplingParams(temperature=0, max_tokens=1), "p"))
    with pytest.raises(ValueError, match="do not fit"):
        a.import_kv(tiny.export_kv(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_packed_kv_round_trip(dtype):
    """What the object store carries: raw bytes and back, any dtype (numpy has no bf16)."""
    tensors = [(torch.randn(3, 8, 2, 4) * 50).to(dtype), torch.rand(3, 8, 2, 1)]
    kv = KVBlocks(list(range(8)), 4, tensors)
    back = PackedKV.pack(kv).unpack()
    assert back.token_ids == kv.token_ids and back.nbytes == kv.nbytes
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(back.tensors, tensors))


def test_async_engine_call_runs_on_the_engine_thread(tiny_config_path):
    """The hook the export and import go through: fn(engine) between two steps, on
    the thread that owns the pool; its exception comes back; none after shutdown."""
    engine = AsyncEngine(model=tiny_config_path, load_format="dummy", skip_tokenizer_init=True,
                         kv_cache_memory="1MiB", max_num_batched_tokens=8, num_threads=1)

    async def calls() -> None:
        assert await engine.call(lambda e: threading.current_thread().name) == "tandem-engine"
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda e: 1 / 0)

    asyncio.run(calls())
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.call(lambda e: None))
