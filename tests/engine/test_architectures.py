"""Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) against HF on tiny random models,
through the one-call decode step, the per-op CPU kernels and the torch reference paths."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

from .cpu_paths import CPU_PATHS, cpu_path

COMMON = dict(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.3,
              tie_word_embeddings=False, eos_token_id=0, bos_token_id=1)


def hf_model(arch: str, **overrides):
    """A tiny random HF model of ``arch`` (COMMON's shape, with ``overrides``)."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, **overrides})).eval()
    if arch == "qwen2":  # random q/k/v biases (HF starts them at 0), so a skipped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.uniform_(-0.5, 0.5)
    if arch == "qwen3":  # random q/k norm weights, so a skipped norm would show
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf(arch, tmp_path):
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                    kv_cache_memory="8MiB", max_num_batched_tokens=16))
    prompts = [[5, 17, 33, 2, 64, 9, 11], [40, 41, 42], list(range(3, 40))]
    n = 12
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompts[2]])).logits[0]
        want = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    for path in CPU_PATHS:
        with cpu_path(engine, path):
            torch.testing.assert_close(engine.score_tokens(prompts[2]), ref_logits,
                                       atol=1e-4, rtol=1e-4)
            # Chunked prefill (budget 16) and batched decodes, then greedy ids.
            reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n,
                                                         ignore_eos=True)) for p in prompts]
            while engine.has_unfinished_requests():
                engine.step()
        assert [r.output_token_ids for r in reqs] == want, path
