"""A GGUF served in its own block formats (--quantization auto) against HF's
dequantized load of the same file, through every CPU path."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine, served_quantization
from tandem.model.linear import DenseLinear, Int4Linear, Int8Linear
from tandem.sampling_params import SamplingParams

from .cpu_paths import CPU_PATHS, cpu_path
from .test_gguf import _write_tiny_gguf

PROMPTS = [[5, 17, 33, 2, 64, 9, 11], [40, 41, 42], list(range(3, 40))]


def _mixed(name: str) -> str:
    """Q4_K_M's pattern: Q4 matmuls with Q8 V and down projections (and output)."""
    return "Q8_0" if name in ("attn_v", "ffn_down") else "Q4_1"


def _engine_and_hf(tmp_path, qtype, quantization="auto", arch="llama"):
    from transformers import AutoModelForCausalLM

    src = _write_tiny_gguf(tmp_path / "m.gguf", arch, heads=4, kv=2, head_dim=16,
                           hidden=64, ffn=96, qtype=qtype, std=0.1, tied=arch != "phi3")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=src.name,
                                              dtype=torch.float32).eval()
    # An fp32 cache: float weights are compared with HF's logits to 1e-5 (the CPU
    # default, fp16, rounds K/V).
    engine = LLMEngine(EngineConfig(model=str(src), skip_tokenizer_init=True,
                                    quantization=quantization, kv_cache_memory="8MiB",
                                    kv_cache_dtype="fp32", max_num_batched_tokens=16))
    return engine, hf


def _greedy(engine: LLMEngine, n: int = 8) -> list[list[int]]:
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p in PROMPTS]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "mixed"])
def test_gguf_formats_run_as_stored_and_agree_on_every_path(tmp_path, qtype):
    """Q4_0 runs as int4 (tied head too), Q8_0 as int8 with its group scales, a
    Q4_K_M-like mix gives each fused matmul its widest part's format; all with
    activations quantized per group of 32 (W4A8 / W8A8). The decode step, the
    per-op kernels and torch agree; the logits stay within 8-bit activations'
    error of HF's."""
    engine, hf = _engine_and_hf(tmp_path, _mixed if qtype == "mixed" else qtype)
    m = engine.model
    layer = m.layers[0]
    # What /api/show reports: the format of most of the layer bytes, as served
    # (in this tiny mix Q/K/V and down, int8 groups, outweigh o and gate/up).
    assert served_quantization(engine) == {"Q4_0": "Q4_0", "Q8_0": "Q8_0", "mixed": "Q8_0"}[qtype]
    if qtype == "mixed":
        # Q/K in Q4_1 beside a Q8_0 V: int8 groups part by part
        assert isinstance(layer.qkv, Int8Linear) and layer.qkv.grouped
        assert isinstance(layer.o, Int4Linear)
        assert isinstance(layer.gate_up, Int4Linear) and isinstance(layer.down, Int8Linear)
        assert engine.runner.decode_step is not None  # per-matmul formats in one step
    elif qtype == "Q8_0":
        assert isinstance(layer.qkv, Int8Linear) and layer.qkv.grouped
    else:
        assert all(isinstance(lin, Int4Linear) for layer in m.layers
                   for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        assert isinstance(m.lm_head, Int4Linear) and m.embed.dtype == torch.float16
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0]
    ids, logits = {}, {}
    for path in CPU_PATHS:
        with cpu_path(engine, path):
            logits[path] = engine.score_tokens(PROMPTS[2])
            assert ((logits[path] - ref).abs().max() / ref.abs().max()) < 0.05, path
            ids[path] = _greedy(engine)
    assert ids["decode-step"] == ids["per-op-kernels"]
    torch.testing.assert_close(logits["per-op-kernels"], logits["torch-reference"],
                               atol=1e-3, rtol=1e-3)


def test_none_dequantizes_a_quantized_gguf_to_float(tmp_path):
    engine, hf = _engine_and_hf(tmp_path, "Q4_1", quantization="none")
    assert isinstance(engine.model.lm_head, DenseLinear) and engine.model.embed.dtype == (
        torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0]
    torch.testing.assert_close(engine.score_tokens(PROMPTS[2]), ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
def test_phi3_gguf_matches_hf_on_every_path(tmp_path, qtype):
    """Phi-3's fused attn_qkv and gate+up ffn_up against HF's load of the same
    file: F32 to float rounding with HF's greedy ids; Q4_0 served as stored
    (int4 fused matmuls, in the one-call step too) within quantized
    activations' error, the kernels' paths agreeing."""
    engine, hf = _engine_and_hf(tmp_path, qtype, arch="phi3")
    layer = engine.model.layers[0]
    assert engine.model_config.family == "phi3"
    if qtype == "Q4_0":
        assert isinstance(layer.qkv, Int4Linear) and isinstance(layer.gate_up, Int4Linear)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0]
        want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    ids = {}
    for path in CPU_PATHS:
        with cpu_path(engine, path):
            err = (engine.score_tokens(PROMPTS[2]) - ref).abs().max() / ref.abs().max()
            assert err < (1e-5 if qtype == "F32" else 0.05), path
            ids[path] = _greedy(engine)
    if qtype == "F32":
        assert all(got == want for got in ids.values())
    else:
        assert ids["decode-step"] == ids["per-op-kernels"]
