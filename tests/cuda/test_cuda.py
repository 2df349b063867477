"""The CUDA paths against HF on the same GPU: tiny random models, fp32 and bf16,
quantized weights (dequantized per call), GGUF block formats, preemption and
the GPU KV pool sizing. Skipped without a CUDA device (CI has none)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.model.linear import Int4Linear, Int8Linear
from tandem.sampling_params import SamplingParams

from ..engine.test_architectures import PROMPTS, hf_model
from ..engine.test_gguf import _write_tiny_gguf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLMEngine(EngineConfig(model=str(path), skip_tokenizer_init=True, device="cuda", **kw))


def _greedy(engine: LLMEngine, prompts, n: int = 12) -> list[list[int]]:
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in reqs]


def _hf_greedy(hf, prompts, n: int = 12) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp32_greedy_matches_hf_on_gpu(arch, tmp_path):
    """fp32 on the GPU: continuous batching and chunked prefill (budget 16) give
    HF's greedy ids and logits."""
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path)
    engine = _engine(tmp_path, dtype="float32", max_num_batched_tokens=16)
    assert engine.device.type == "cuda"
    hf = hf.cuda()
    assert _greedy(engine, PROMPTS) == _hf_greedy(hf, PROMPTS)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]], device="cuda")).logits[0].float()
    torch.testing.assert_close(engine.score_tokens(PROMPTS[2]).float(), ref, atol=1e-3,
                               rtol=1e-3)


def test_bf16_default_dtype_tracks_hf_bf16(tmp_path):
    """The GPU default dtype (bf16) against HF's bf16 forward of the same weights."""
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    engine = _engine(tmp_path)
    assert engine.dtype == torch.bfloat16
    hf = hf.to("cuda", torch.bfloat16)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]], device="cuda")).logits[0].float()
    got = engine.score_tokens(PROMPTS[2]).float()
    assert (got - ref).abs().max() / ref.abs().max() < 0.03
    assert all(len(ids) == 12 for ids in _greedy(engine, PROMPTS))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_on_gpu_match_their_dequantized_model(quantization, tmp_path):
    """int8 / int4 on CUDA hold the quantized bytes and dequantize per call: the
    logits are the dequantized weights' (fp32) up to rounding."""
    hf_model("llama").save_pretrained(tmp_path)
    q = _engine(tmp_path, dtype="float32", quantization=quantization)
    cls = Int8Linear if quantization == "int8" else Int4Linear
    assert isinstance(q.model.layers[0].qkv, cls) and not q.model.layers[0].qkv.kernel
    ref = _engine(tmp_path, dtype="float32")
    for layer, ref_layer in zip(q.model.layers, ref.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            lin, ref_lin = getattr(layer, name), getattr(ref_layer, name)
            x = torch.randn(5, ref_lin.w.shape[1], device="cuda")
            deq = lin.dequantize() if quantization == "int8" else lin._weight.dequantize()
            torch.testing.assert_close(lin(x), x @ deq.t().to(x.dtype), atol=1e-4, rtol=1e-4)
    assert all(len(ids) == 12 for ids in _greedy(q, PROMPTS))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_block_formats_on_gpu_match_hf(qtype, tmp_path):
    """A GGUF's own formats on CUDA (fp32 activations, dequantized per call) give
    HF's logits of the dequantized file (up to cuBLAS's summation order)."""
    from transformers import AutoModelForCausalLM

    src = _write_tiny_gguf(tmp_path / "m.gguf", "llama", heads=4, kv=2, head_dim=16,
                           hidden=64, ffn=96, qtype=qtype, std=0.1)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=src.name,
                                              dtype=torch.float32).eval().cuda()
    engine = _engine(src, dtype="float32", quantization="auto")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]], device="cuda")).logits[0]
    torch.testing.assert_close(engine.score_tokens(PROMPTS[2]), ref, atol=5e-3, rtol=5e-3)


def test_preemption_on_gpu_keeps_greedy_output(tmp_path):
    """A pool too small for every request preempts by recompute: the same ids as a
    roomy pool, and every block back at the end."""
    hf_model("llama").save_pretrained(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 96) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    roomy = _engine(tmp_path, dtype="float32", max_num_batched_tokens=32)
    # fp32, 2 layers x K,V x 2 kv heads x 16 x 4 bytes = 512 bytes per token: 12 blocks of 16.
    small = _engine(tmp_path, dtype="float32", max_num_batched_tokens=32,
                    kv_cache_memory=12 * 16 * 512, max_model_len=64)
    assert _greedy(small, prompts, 24) == _greedy(roomy, prompts, 24)
    assert small.scheduler.num_preemptions > 0
    assert small.kv_manager.num_free_blocks == small.kv_manager.num_blocks


def test_gpu_kv_pool_is_sized_from_free_memory(tmp_path):
    """Without --kv-cache-memory the pool takes the utilization target minus the
    weights and a warm-up step's peak; the warm-up fits the model's 256 positions
    under the default budget of 8192 tokens."""
    hf_model("llama").save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                    device="cuda", gpu_memory_utilization=0.05))
    total = torch.cuda.mem_get_info()[1]
    pool = engine.kv_manager.num_blocks * engine.config.block_size * engine.kv_bytes_per_token
    assert 0 < pool <= 0.05 * total
    assert all(len(ids) == 12 for ids in _greedy(engine, PROMPTS))


def test_grammar_bitmask_and_sampler_on_gpu():
    """A grammar's packed bitmask applied to CUDA logits (the torch unpack path)
    bans what the CPU path bans, and the sampler on GPU draws only allowed tokens."""
    from tandem.worker.sampler import Sampler
    from tandem.worker.sampling_metadata import SamplingMetadata
    from tandem.worker.structured_output import apply_token_bitmask_

    g = torch.Generator().manual_seed(0)
    vocab = 1000
    words = torch.randint(-2**31, 2**31 - 1, (2, -(-vocab // 32)), generator=g, dtype=torch.int64)
    bitmask = words.to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    rows = torch.tensor([2, 0])
    want = logits.clone()
    apply_token_bitmask_(want, rows, bitmask)
    got = logits.cuda()
    apply_token_bitmask_(got, rows.cuda(), bitmask.cuda())
    assert torch.equal(got.cpu(), want)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    meta = SamplingMetadata.build(params, [None] * 3, [[]] * 3, [[]] * 3, [], vocab, "cuda")
    meta.grammar_mask = (rows.cuda(), bitmask.cuda())
    for _ in range(10):
        out = Sampler()(logits.cuda(), meta).sampled_token_ids.tolist()
        assert want[2, out[2]] != -float("inf") and want[0, out[0]] != -float("inf")
