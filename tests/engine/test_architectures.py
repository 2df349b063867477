"""Llama, Mistral, Phi-3, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Qwen3-MoE, Gemma 2 and 3
against HF on tiny random models, through the one-call decode step (not MoE's), the per-op CPU
kernels and the torch reference paths; what tandem would compute differently from HF is
refused by name."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.model.llama import SUPPORTED_ARCHITECTURES, ModelConfig
from tandem.model.loader import DummyWeights, fuse_weights
from tandem.model.moe import SparseMoE
from tandem.sampling_params import SamplingParams

from .cpu_paths import CPU_PATHS, cpu_path

COMMON = dict(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.3,
              tie_word_embeddings=False, eos_token_id=0, bos_token_id=1, pad_token_id=0)
PROMPTS = [[5, 17, 33, 2, 64, 9, 11], [40, 41, 42], list(range(3, 40))]
# Llama 3's frequency-dependent RoPE scaling (transformers 5 writes it as rope_parameters).
LLAMA3_ROPE = dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=64))
# Gemma 3's shape: windowed layers around a global one (each with its RoPE base, the
# global one scaled as the 4B+ models'), a query scale of its own, a tied LM head.
# Gemma 2's: windowed layers around a global one, its logits soft-capped low enough
# (attention's at 5, the output's at 3) that tanh bends them. Gemma 3's weights are
# small enough that the next token's probability is not ~1 (at COMMON's 0.3 it was
# 1 - 1e-6, so a decode path's error could not move a greedy id).
GEMMA2 = dict(num_hidden_layers=3, sliding_window=10, query_pre_attn_scalar=24,
              tie_word_embeddings=True, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
GEMMA3 = dict(num_hidden_layers=3, sliding_window=10, query_pre_attn_scalar=24,
              initializer_range=0.02,
              tie_word_embeddings=True,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 1e6}})


def hf_model(arch: str, **overrides):
    """A tiny random HF model of ``arch`` (COMMON's shape, with ``overrides``)."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    if arch in ("gemma2", "gemma3"):
        overrides = {**(GEMMA2 if arch == "gemma2" else GEMMA3), **overrides}
    torch.manual_seed(0)
    # A copy: transformers adds rope_theta into a rope_scaling dict it is given.
    model = model_cls(cfg_cls(**copy.deepcopy({**COMMON, **overrides}))).eval()
    if arch == "qwen2":  # random q/k/v biases (HF starts them at 0), so a skipped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.uniform_(-0.5, 0.5)
    if arch in ("qwen3", "qwen3moe"):  # random q/k norm weights, so a skipped norm would show
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    if arch in ("gemma2", "gemma3"):  # every norm random (HF starts them at 0: a scale of 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.uniform_(-0.5, 0.5)
    return model


def _engine(path, **kw) -> LLMEngine:
    """An engine with an fp32 cache: its logits are compared with HF's to 1e-5 (the
    CPU default, fp16, rounds K/V)."""
    return LLMEngine(EngineConfig(model=str(path), skip_tokenizer_init=True,
                                  kv_cache_memory="8MiB", kv_cache_dtype="fp32",
                                  max_num_batched_tokens=16, **kw))


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("llama", LLAMA3_ROPE),
    ("qwen2", {}),
    ("qwen3", {}),
    # Mistral: an explicit head_dim wider than hidden / heads (as Mistral Nemo's 128 at 5120).
    ("mistral", dict(head_dim=32)),
    ("phi3", {}),  # fused qkv_proj and gate_up_proj
    ("gemma2", {}),  # the prompts run past the window of its windowed layers
    ("gemma3", {}),
], ids=["llama", "llama3-rope", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"])
def test_tiny_models_match_hf(arch, overrides, tmp_path):
    hf = hf_model(arch, **overrides)
    hf.save_pretrained(tmp_path)
    engine = _engine(tmp_path)
    assert engine.model_config.family == arch
    _assert_matches_hf(engine, hf, CPU_PATHS)


def _assert_matches_hf(engine: LLMEngine, hf, paths: tuple[str, ...]) -> None:
    """HF's logits of a prompt and greedy ids of PROMPTS on each of ``paths``."""
    n = 12
    with torch.no_grad():
        ref_logits = hf(torch.tensor([PROMPTS[2]])).logits[0]
        want = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    for path in paths:
        with cpu_path(engine, path):
            torch.testing.assert_close(engine.score_tokens(PROMPTS[2]), ref_logits,
                                       atol=1e-4, rtol=1e-4)
            # Chunked prefill (budget 16) and batched decodes, then greedy ids.
            reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n,
                                                         ignore_eos=True)) for p in PROMPTS]
            while engine.has_unfinished_requests():
                engine.step()
        assert [r.output_token_ids for r in reqs] == want, path


# Qwen3-MoE's shape: 8 experts of 32, 2 per token; the MoE layers as the overrides say.
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("overrides", [
    dict(norm_topk_prob=True),
    dict(norm_topk_prob=False),
    dict(norm_topk_prob=True, mlp_only_layers=[0]),  # layer 0 a dense MLP
    dict(norm_topk_prob=False, decoder_sparse_step=2),  # only layer 1 sparse
], ids=["norm-topk", "raw-topk", "mlp-only-0", "sparse-step-2"])
def test_qwen3_moe_matches_hf(overrides, tmp_path):
    """Qwen3-MoE (softmax router, top-2 of 8 experts) on the per-op kernels and
    torch paths; the one-call decode step refuses its MoE layers, so every step
    runs LlamaModel.forward."""
    hf = hf_model("qwen3moe", **QWEN3_MOE, **overrides)
    hf.save_pretrained(tmp_path)
    engine = _engine(tmp_path)
    moe = engine.model_config.moe
    dense = {0} if overrides.get("mlp_only_layers") or overrides.get("decoder_sparse_step") else ()
    assert moe is not None and moe.layers == tuple(i for i in range(2) if i not in dense)
    assert engine.runner.decode_step is None
    layer = engine.model.layers[moe.layers[0]]
    assert layer.gate_up is None and layer.moe.gate_up.shape == (8, 64, COMMON["hidden_size"])
    # The prompt's tokens route to more experts than one token's 2: the groups are real.
    x = torch.randn(len(PROMPTS[2]), COMMON["hidden_size"])
    assert len(layer.moe.route(x)[0].unique()) > 4
    _assert_matches_hf(engine, hf, ("per-op-kernels", "torch-reference"))


def test_quantized_experts_are_refused():
    cfg = ModelConfig.from_hf(_cfg("Qwen3MoeForCausalLM", **QWEN3_MOE))
    for q in ("int8", "int4"):
        with pytest.raises(ValueError, match="quantized expert weights are not supported"):
            fuse_weights(cfg, DummyWeights(cfg, torch.float32, seed=0), torch.float32,
                         torch.device("cpu"), q)


def test_experts_of_the_wrong_shape_are_named():
    """Experts narrower than moe_intermediate_size says: a ValueError naming the tensor."""
    moe = ModelConfig.from_hf(_cfg("Qwen3MoeForCausalLM", **QWEN3_MOE)).moe
    hidden = COMMON["hidden_size"]

    def take(name: str) -> torch.Tensor:
        return torch.zeros(8 if name.endswith("mlp.gate.weight") else 16, hidden)

    with pytest.raises(ValueError, match=r"'mlp.experts.0.gate_proj.weight' has shape \(16, 96\)"):
        SparseMoE.load(moe, take, lambda t: t, None, "mlp.")


def _greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy ids by a full forward per token (no KV cache to differ in)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch, w, overrides", [
    ("mistral", 10, {}),  # a window inside one 16-slot block: starts mid-block
    ("mistral", 24, {}),
    ("phi3", 20, {}),
    # Qwen2 windows only the layers from max_window_layers on: layer 1 here.
    ("qwen2", 10, dict(use_sliding_window=True, max_window_layers=1)),
], ids=["mistral-10", "mistral-24", "phi3-20", "qwen2-layer1-10"])
def test_sliding_window_matches_hf_past_the_window(arch, w, overrides, tmp_path):
    """Where HF attends through a sliding window of W keys, tandem serves the
    model's whole context and attends as HF does past W: prefill logits (chunks
    of 16, so later chunks start past the window) and greedy ids whose decodes
    run past it, on every CPU path."""
    hf = hf_model(arch, sliding_window=w, **overrides)
    hf.save_pretrained(tmp_path)
    long = list(range(3, 3 + 2 * w + 5))
    with torch.no_grad():  # the same weights without the window
        windowed = hf(torch.tensor([long])).logits[0]
        full = hf_model(arch)(torch.tensor([long])).logits[0]
    # The window is real: past it HF's logits are not full attention's.
    torch.testing.assert_close(windowed[:w], full[:w])
    assert not torch.allclose(windowed[w:], full[w:], atol=1e-3)
    n = 12
    prompts = [PROMPTS[0], long[: w + 3], long]
    want = [_greedy(hf, p, n) for p in prompts]
    engine = _engine(tmp_path)
    assert engine.max_model_len == 256 and engine.model_config.sliding_window == w
    for path in CPU_PATHS:
        with cpu_path(engine, path):
            torch.testing.assert_close(engine.score_tokens(long), windowed, atol=1e-4,
                                       rtol=1e-4)
            reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n,
                                                         ignore_eos=True)) for p in prompts]
            while engine.has_unfinished_requests():
                engine.step()
        assert [r.output_token_ids for r in reqs] == want, path


def _cfg(arch: str, **overrides) -> dict:
    return {"architectures": [arch], **COMMON, **overrides}


@pytest.mark.parametrize("overrides, window, layers", [
    (dict(sliding_window=4096, use_sliding_window=False, max_window_layers=1), None, ()),
    (dict(sliding_window=24, use_sliding_window=True, max_window_layers=2), None, ()),
    (dict(sliding_window=24, use_sliding_window=True, max_window_layers=1), 24, (1,)),
    (dict(sliding_window=24, use_sliding_window=True,
          layer_types=["sliding_attention", "full_attention"]), 24, (0,)),
    # A window as long as the context hides no key.
    (dict(sliding_window=256, use_sliding_window=True, max_window_layers=0), None, (0, 1)),
])
def test_qwen_sliding_window_only_where_hf_uses_it(overrides, window, layers):
    """Qwen2.5 configs carry a sliding_window HF ignores unless use_sliding_window
    (and then only from layer max_window_layers on); the context is the config's."""
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cfg = ModelConfig.from_hf(_cfg(arch, **overrides))
        assert (cfg.sliding_window, cfg.sliding_layers) == (window, layers)
        assert [cfg.layer_window(i) for i in range(2)] == [
            window if window and i in layers else 0 for i in range(2)]
        assert cfg.max_position_embeddings == 256
    # Llama has no window, whatever its config says; Mistral windows every layer.
    assert ModelConfig.from_hf(_cfg("LlamaForCausalLM", sliding_window=24)).sliding_window is None
    assert ModelConfig.from_hf(_cfg("MistralForCausalLM", sliding_window=24)).sliding_layers == (
        0, 1)


@pytest.mark.parametrize("arch, overrides, feature", [
    ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias"),
    ("LlamaForCausalLM", dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "'yarn'"),
    ("LlamaForCausalLM", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "'dynamic'"),
    # Phi-3-mini-128k / Phi-3.5 (transformers 4's rope_scaling, 5's rope_parameters).
    ("Phi3ForCausalLM", dict(rope_scaling=dict(type="su", short_factor=[1.0] * 8,
                                                long_factor=[2.0] * 8)), "'su'"),
    ("Phi3ForCausalLM", dict(rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 8, long_factor=[2.0] * 8)),
     "'longrope'"),
    # Phi-4-mini rotates 3/4 of each head.
    ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75"),
    ("Phi3ForCausalLM", dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor 0.5"),
    ("GemmaForCausalLM", {}, "unsupported architecture"),
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True, sliding_window=24),
     "use_sliding_window"),
    ("Gemma3ForCausalLM", dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    ("Gemma3ForCausalLM", dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    # EmbeddingGemma attends both ways.
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional"),
    ("Gemma3ForCausalLM", dict(rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_theta": 1e6}}), "scaled RoPE in windowed layers"),
])
def test_unsupported_features_are_refused_by_name(arch, overrides, feature):
    with pytest.raises(ValueError, match=feature):
        ModelConfig.from_hf(_cfg(arch, **overrides))


def test_gemma3_hub_config_is_read():
    """gemma-3-4b-it's text config as the Hub has it (transformers 4's fields):
    every 6th layer global, its RoPE base and linear scaling; the others windowed
    with their own base; the query scaled by query_pre_attn_scalar."""
    cfg = ModelConfig.from_hf(_cfg(
        "Gemma3ForCausalLM", num_hidden_layers=12, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling=dict(rope_type="linear", factor=8.0), sliding_window=16,
        sliding_window_pattern=6, model_type="gemma3_text"))
    assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert cfg.sliding_window == 16 and [cfg.layer_window(i) for i in (4, 5)] == [16, 0]
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.activation == "gelu_tanh" and cfg.attn_scale == 256**-0.5
    assert cfg.embed_scale == 96**0.5 and cfg.sandwich_norms and cfg.qk_norm
    assert cfg.tie_word_embeddings is False  # COMMON's; Gemma's own default is tied
    assert ModelConfig.from_hf({k: v for k, v in _cfg("Gemma3ForCausalLM").items()
                                if k != "tie_word_embeddings"}).tie_word_embeddings


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A Gemma 3 4B-27B checkpoint (Gemma3ForConditionalGeneration): its text
    model's weights under language_model., beside a vision tower that is not
    read; HF's text logits on every CPU path."""
    import transformers

    torch.manual_seed(0)
    text = {k: v for k, v in {**COMMON, **GEMMA3}.items() if k != "tie_word_embeddings"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95,
        boi_token_index=93, eoi_token_index=94)).eval()
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.data.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPTS[2]])).logits[0]
    engine = _engine(tmp_path)
    assert engine.model_config.architecture == "Gemma3ForCausalLM"
    for path in CPU_PATHS:
        with cpu_path(engine, path):
            torch.testing.assert_close(engine.score_tokens(PROMPTS[2]), want, atol=1e-4,
                                       rtol=1e-4)


def test_gemma3_multimodal_hub_config_takes_transformers_defaults():
    """gemma-3-4b-it's config.json names only what differs from Gemma3TextConfig's
    defaults in its text_config; the rest are those defaults."""
    cfg = ModelConfig.from_hf({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024}})
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 256)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (262_208, 131_072)
    assert cfg.sliding_window == 1024 and len(cfg.sliding_layers) == 34 - 5
    assert cfg.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert cfg.tie_word_embeddings and cfg.attn_scale == 256**-0.5


def test_transformers5_rope_parameters_are_read(tmp_path):
    """rope_theta and the scaling nested in rope_parameters, as transformers 5 saves them."""
    hf_model("llama", rope_theta=5e5, **LLAMA3_ROPE).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in raw and "rope_theta" not in raw  # both in rope_parameters
    cfg = ModelConfig.from_hf(raw)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("arch", sorted(SUPPORTED_ARCHITECTURES))
def test_dummy_weights_have_each_architectures_names(arch):
    """--load-format dummy makes exactly the tensors the loader takes, for every family."""
    extra = (dict(attention_bias=True) if arch == "LlamaForCausalLM" else
             dict(**QWEN3_MOE, mlp_only_layers=[0]) if arch == "Qwen3MoeForCausalLM" else {})
    cfg = ModelConfig.from_hf(_cfg(arch, **extra))
    src = DummyWeights(cfg, torch.float32, seed=0)
    weights = fuse_weights(cfg, src, torch.float32, torch.device("cpu"))
    assert not src._shapes and len(weights["layers"]) == 2
    hd, h, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    assert weights["layers"][0]["qkv"].w.shape == ((h + 2 * hkv) * hd, cfg.hidden_size)
    assert weights["layers"][0]["gate_up"].w.shape == (2 * cfg.intermediate_size,
                                                       cfg.hidden_size)
    if cfg.moe is not None:  # layer 1 sparse
        assert weights["layers"][1]["moe"].down.shape == (8, cfg.hidden_size, 32)
