"""A GGUF's metadata read as an HF model: config.json, tensor names, eos ids.

Whether a file is one tandem can serve is decided here (``checked``), before
anything is written or mapped: an unsupported architecture, a missing or
unknown tensor, a truncated or split file is one clear ValueError.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from tandem.model.gguf_meta import window_fields

_ARCHITECTURES = {
    # GGUF general.architecture -> (HF model_type, HF architectures[0])
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),  # its text model (vision: a separate file)
    "llama": ("llama", "LlamaForCausalLM"),  # also Mistral's: llama.cpp writes it as llama
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}

# The float GGML types (any other is a block format).
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


# Control tokens llama.cpp also treats as end-of-generation (llama-vocab.cpp):
# chat models end a turn with these even when tokenizer.ggml.eos_token_id names
# another token, so they go into generation_config.json's eos list.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "<|end_of_text|>",
    }
)


_TOKEN_TYPE_CONTROL = 3


# GGUF per-layer tensor name -> HF name (suffix after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# Phi-3 keeps HF's fused matmuls: attn_qkv is qkv_proj, ffn_up holds gate and up.
_PHI3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_up.weight"},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}


# Qwen3-MoE's every MLP is sparse: the router and each expert matrix stacked 3-D [E, ...],
# kept stacked under HF-like names (tandem.model.moe.SparseMoE.load).
_QWEN3MOE_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm.weight"},
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}


# Gemma 2 and 3 norm each block's input and output: ffn_norm is the MLP's input
# norm (HF's pre_feedforward_layernorm), post_attention_norm attention's output's.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class BadMetadata(ValueError):
    """A metadata value gguf cannot decode; _convert adds the file name."""


def checked(src: Path) -> tuple:
    """(reader, config, {hf name: (tensor, heads to unpermute or None)}), every
    tensor the model needs present and none it cannot use."""
    reader = _open_reader(src)
    arch = _str_field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{src}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    tensors = {t.name: t for t in reader.tensors}
    config, rope_freqs = _hf_config(reader, arch, tensors, src)
    names = _tensor_names(tensors, config, arch, src, skip={rope_freqs} - {None})
    return reader, config, names


def _open_reader(src: Path):
    """GGUFReader with every failure (bad magic, truncation, ...) as one clear ValueError."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(src, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/struct.error/...
        # A file cut short fails in the reader's numpy views of its header or its
        # last tensors: "cannot reshape array of size ...", "When changing to a
        # larger dtype ...", "index 0 is out of bounds" say nothing of why.
        if isinstance(e, (IndexError, struct.error)) or any(
                w in str(e) for w in ("reshape", "larger dtype", "out of bounds")):
            raise ValueError(f"{src} is not a valid GGUF file: it ends before its header or "
                             "tensors do (a truncated download?)") from e
        raise ValueError(f"{src} is not a valid GGUF file: {e}") from e
    size = src.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(
                f"{src} is not a valid GGUF file: tensor {t.name!r} ends past the end of the "
                f"file (truncated download?)"
            )
    if "general.architecture" not in reader.fields:
        raise ValueError(f"{src} is not a valid GGUF file: no general.architecture")
    split = _field(reader, "split.count")
    if split is not None and int(split) > 1:
        raise ValueError(
            f"{src} is one shard of a split GGUF ({split} shards); merge it first "
            f"(llama-gguf-split --merge)"
        )
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except Exception as e:  # e.g. a string that is not UTF-8
        raise BadMetadata(f"unreadable metadata {key!r}: {e}") from e
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _str_field(reader, key: str) -> str:
    value = _field(reader, key)
    return value if isinstance(value, str) else str(value)


def _uniform(value, what: str, src: Path) -> int:
    # Some GGUFs store per-layer arrays (e.g. head_count_kv); we support one value.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"{src}: per-layer {what} {value} is not supported")
        value = value[0]
    return int(value)


def _hf_config(reader, arch: str, tensors: dict, src: Path) -> tuple[dict, str | None]:
    """config.json from GGUF metadata; also returns the name of a consumed rope_freqs tensor."""
    model_type, hf_arch = _ARCHITECTURES[arch]

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key):
        value = get(key)
        if value is None:
            raise ValueError(f"{src}: GGUF metadata lacks {arch}.{key}")
        return _uniform(value, key, src)

    hidden = need("embedding_length")
    n_layers = need("block_count")
    n_heads = need("attention.head_count")
    n_kv = need("attention.head_count_kv") if get("attention.head_count_kv") else n_heads
    # qwen3moe files may have no dense MLP size: every layer is sparse.
    ffn = need("feed_forward_length" if arch != "qwen3moe" or get("feed_forward_length")
               else "expert_feed_forward_length")
    rope_dims = get("rope.dimension_count")
    if arch == "phi3":  # its rope.dimension_count is the rotated part of a head
        head_dim = int(get("attention.key_length") or hidden // n_heads)
    else:
        head_dim = int(get("attention.key_length") or rope_dims or hidden // n_heads)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ValueError(f"{src}: GGUF has no token_embd.weight tensor")
    rope_theta = float(get("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0))
    context = int(get("context_length", 2048))
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": context,
        # The embedding's row count, not len(tokens): some GGUFs pad the matrix.
        "vocab_size": int(emb.shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
        "attention_bias": arch == "qwen2",
    }
    if rope_dims is not None and int(rope_dims) != head_dim:
        config["partial_rotary_factor"] = int(rope_dims) / head_dim
    config.update(window_fields(arch, get, n_layers, src))
    if arch in ("gemma2", "gemma3"):
        # What llama.cpp assumes of a Gemma file: queries scaled by the head
        # size, but the 27Bs' (gemma2: 46 layers, gemma3: 62) by hidden / heads;
        # gemma2's even layers windowed (ModelConfig's default), gemma3's every
        # 6th layer global and the others windowed with RoPE base 10000. Soft-caps
        # the file leaves out are the config class's defaults (ModelConfig).
        big = n_layers == (46 if arch == "gemma2" else 62)
        config.update(hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=hidden // n_heads if big else head_dim)
        del config["hidden_act"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                config[key] = float(get(key))
    if arch == "qwen3moe":  # llama.cpp renormalizes qwen3moe's top-k weights unless told not to
        if get("expert_gating_func", 1) != 1 or get("expert_shared_count", 0):
            raise ValueError(f"{src}: only a softmax router without shared experts is supported")
        config.update(num_experts=need("expert_count"), num_experts_per_tok=need(
            "expert_used_count"), moe_intermediate_size=need("expert_feed_forward_length"),
            norm_topk_prob=bool(get("expert_weights_norm", True)))
    if arch == "gemma3":  # Ollama's files may name the windowed layers' RoPE base
        config["rope_local_base_freq"] = float(get("rope.local.freq_base", 10000.0))
    special = (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
    for key, name in special:
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)

    if "rope_factors_long.weight" in tensors:
        raise ValueError(f"{src}: rope scaling 'longrope' (rope_factors_long / rope_factors_short "
                         "tensors) is not supported")
    rope_freqs = "rope_freqs.weight" if "rope_freqs.weight" in tensors else None
    scaling_type = get("rope.scaling.type")
    if rope_freqs is not None:
        from gguf.quants import dequantize

        factors = dequantize(tensors[rope_freqs].data, tensors[rope_freqs].tensor_type)
        config["rope_scaling"] = _llama3_rope_scaling(
            np.asarray(factors, dtype=np.float64).reshape(-1), head_dim, rope_theta, src
        )
    elif scaling_type in ("linear", "yarn"):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        orig = get("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        config["rope_scaling"] = scaling
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{src}: rope scaling type {scaling_type!r} is not supported")
    return config, rope_freqs


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, src: Path) -> dict:
    """Recover HF's llama3 rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores the per-frequency divisors instead of the parameters; the
    curve only determines them up to a common scale, so we try the parameters
    Meta's Llama 3.x models use and check they reproduce the tensor exactly.
    """
    factor = float(factors.max())
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    for orig, low, high in ((8192, 1.0, 4.0),):
        smooth = (orig / wavelen - low) / (high - low)
        expect = np.where(
            wavelen < orig / high,
            1.0,
            np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if expect.shape == factors.shape and np.allclose(expect, factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ValueError(f"{src}: rope_freqs tensor does not match a known llama3 rope scaling")


def _tensor_names(tensors: dict, config: dict, arch: str, src: Path, skip: set) -> dict:
    """{hf_name: (tensor, heads)} for every tensor, checked against what the model
    needs; heads: llama's Q/K rows to unpermute (their head count), else None."""
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    layer_names = {"phi3": _PHI3_LAYER_NAMES, "gemma2": _GEMMA_LAYER_NAMES,
                   "gemma3": _GEMMA_LAYER_NAMES, "qwen3moe": _QWEN3MOE_LAYER_NAMES,
                   }.get(arch, _LAYER_NAMES)
    names, unknown = {}, []
    for gname, t in tensors.items():
        if gname in skip:
            continue
        if arch == "gemma3" and gname.startswith(("v.", "mm.")):
            continue  # Ollama's files hold the vision tower too: the text model is served
        hf = _GLOBAL_NAMES.get(gname)
        if hf is None and gname.startswith("blk."):
            _, layer, rest = gname.split(".", 2)
            suffix = layer_names.get(rest)
            if suffix is not None and layer.isdigit():
                hf = f"model.layers.{int(layer)}.{suffix}"
        if hf is None:
            unknown.append(gname)
            continue
        if "_exps." in gname and t.tensor_type.name not in FLOAT_TYPES:
            raise ValueError(f"{src}: quantized expert tensors ({gname}: "
                             f"{t.tensor_type.name}) are not supported yet")
        heads = None
        if arch == "llama" and ".attn_q." in gname:
            heads = n_heads
        elif arch == "llama" and ".attn_k." in gname:
            heads = n_kv
        names[hf] = (t, heads)
    if unknown:
        raise ValueError(f"{src}: unsupported tensors for {arch}: {', '.join(unknown[:8])}")
    missing = sorted(_expected_names(config, arch) - set(names))
    if missing:
        raise ValueError(f"{src}: GGUF lacks tensors {', '.join(missing[:8])}")
    return names


def _expected_names(config: dict, arch: str) -> set[str]:
    layer = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    if arch == "qwen2":
        layer |= {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        layer |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    if arch == "qwen3moe":
        layer -= {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
        layer |= {"mlp.gate.weight", *(f"mlp.experts.{n}_proj.weight" for n in
                                       ("gate", "up", "down"))}
    if arch in ("gemma2", "gemma3"):
        layer |= {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"}
    if arch == "phi3":
        layer -= {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight"}
        layer |= {"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"}
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{s}" for s in layer}
    return names


def eos_ids(reader) -> list[int]:
    """eos, eot, eom ids, then control tokens llama.cpp also ends generation on."""
    ids = []
    for name in ("eos", "eot", "eom"):
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        kinds = types.contents()
        for i, text in enumerate(tokens.contents()):
            if text in _EOG_TEXTS and kinds[i] == _TOKEN_TYPE_CONTROL and i not in ids:
                ids.append(i)
    return ids
