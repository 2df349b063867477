"""Reading a model's shape into a ModelSpec: a built-in preset, an HF
config.json (or a directory holding one) or a GGUF file's header, as the
model loader reads them (tandem.model's torch-free hf_config and gguf_meta).

Mixture-of-experts and latent-attention models are refused with a clear error
rather than counted wrongly.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from tandem.model.gguf_meta import ArrayLen, read_gguf_header, window_fields
from tandem.model.hf_config import sliding_window, tie_word_embeddings
from tandem.tools.plan.model_spec import ModelSpec
from tandem.tools.plan.presets import PRESETS

_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16"}
# HF model_type (a GGUF's general.architecture) -> the family whose sliding-window
# rules tandem.model.hf_config.sliding_window knows; other types plan every layer
# at full attention.
_WINDOW_FAMILIES = {"gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
                    "mistral": "mistral", "phi3": "phi3", "qwen2": "qwen2", "qwen3": "qwen3"}


def _layer_windows(cfg: dict[str, Any], model_type: str,
                   max_positions: int | None) -> tuple[int, ...]:
    """ModelSpec.layer_windows of a config.json-shaped ``cfg``, as the model loader
    reads them; () for a type of no known window rules."""
    family = _WINDOW_FAMILIES.get(model_type)
    window, sliding = sliding_window(cfg, family, max_positions) if family else (None, ())
    if not window:
        return ()
    return tuple(window if i in sliding else 0 for i in range(int(cfg["num_hidden_layers"])))


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def spec_from_hf_config(cfg: dict[str, Any], name: str, source: str = "config.json") -> ModelSpec:
    """Read the fields of an HF config.json; multimodal configs use their text_config."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "_outer_tie": cfg.get("tie_word_embeddings")}
    model_type = str(cfg.get("model_type", "llama"))
    if _first(cfg, "num_experts", "num_local_experts", "n_routed_experts"):
        raise ValueError(
            f"model {name}: mixture-of-experts configs ({model_type}) are not supported by "
            "the planner (only active experts are read per token; it counts dense models)"
        )
    if cfg.get("kv_lora_rank"):
        raise ValueError(
            f"model {name}: multi-head latent attention ({model_type}) is not supported: "
            "its KV cache is not 2 x kv_heads x head_dim per layer"
        )
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head")
    inter = _first(cfg, "intermediate_size", "n_inner", "ffn_dim")
    vocab = cfg.get("vocab_size")
    missing = [
        k for k, v in (
            ("hidden_size", hidden), ("num_hidden_layers", layers),
            ("num_attention_heads", heads), ("intermediate_size", inter), ("vocab_size", vocab),
        ) if v is None
    ]
    if missing:
        raise ValueError(f"model {name}: config has no {', '.join(missing)}")
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        tie = cfg.get("_outer_tie")
    if tie is None:
        tie = tie_word_embeddings(cfg)
    qkv_bias = bool(cfg.get("attention_bias", False)) or model_type == "qwen2"
    windows = _layer_windows({**cfg, "num_hidden_layers": int(layers)}, model_type,
                             cfg.get("max_position_embeddings"))
    dtype = _TORCH_DTYPES.get(str(_first(cfg, "torch_dtype", "dtype")), "bf16")
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        bits = quant.get("bits") or quant.get("weight_bits")
        method = str(quant.get("quant_method", ""))
        if bits == 4 or "4bit" in method or quant.get("load_in_4bit"):
            dtype = "int4"
        elif bits == 8 or method == "fp8" or quant.get("load_in_8bit"):
            dtype = "int8"
    return ModelSpec(
        name=name,
        source=source,
        num_layers=int(layers),
        hidden_size=int(hidden),
        intermediate_size=int(inter),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=int(vocab),
        tie_word_embeddings=bool(tie),
        max_context=cfg.get("max_position_embeddings"),
        model_type=model_type,
        qkv_bias=qkv_bias,
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "olmo2", "gemma3", "gemma3_text"),
        default_dtype=dtype,
        layer_windows=windows,
    )


def _gguf_scalar(meta: dict[str, Any], key: str) -> Any:
    v = meta.get(key)
    if isinstance(v, ArrayLen):
        raise ValueError(f"GGUF {key} is a {v.count}-element array, expected one value")
    if isinstance(v, list):
        if not v:
            return None
        if len(set(v)) > 1:
            raise ValueError(f"GGUF {key} varies per layer ({v[:4]}...): not supported")
        v = v[0]
    return v


def spec_from_gguf(path: str) -> ModelSpec:
    """Read the shape from GGUF metadata and the stored bytes from its tensor table."""
    try:
        meta, tensor_list = read_gguf_header(path)
    except (OSError, ValueError, KeyError, struct.error) as e:  # truncated or foreign file
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    stored = sum(t.n_bytes for t in tensor_list)
    if os.path.getsize(path) < stored:  # serve refuses it too
        raise ValueError(f"{path}: not a readable GGUF file (its tensors are {stored:,} bytes, "
                         "more than the file: a truncated download?)")
    arch = _gguf_scalar(meta, "general.architecture")
    if not arch:
        raise ValueError(f"{path}: GGUF has no general.architecture")

    def key(suffix: str) -> Any:
        return _gguf_scalar(meta, f"{arch}.{suffix}")

    if key("expert_count"):
        raise ValueError(f"{path}: mixture-of-experts GGUF ({arch}) is not supported")
    hidden, layers, heads = key("embedding_length"), key("block_count"), key("attention.head_count")
    if not (hidden and layers and heads):
        raise ValueError(f"{path}: GGUF lacks {arch}.embedding_length/block_count/head_count")
    tensors = {t.name: t for t in tensor_list}
    vocab = key("vocab_size")
    if vocab is None:
        toks = meta.get("tokenizer.ggml.tokens")
        if isinstance(toks, ArrayLen):
            vocab = toks.count
        elif "token_embd.weight" in tensors:
            vocab = tensors["token_embd.weight"].shape[-1]
    inter = key("feed_forward_length")
    if inter is None and "blk.0.ffn_up.weight" in tensors:
        inter = tensors["blk.0.ffn_up.weight"].shape[-1]
    if vocab is None or inter is None:
        raise ValueError(f"{path}: GGUF has no vocabulary size or feed-forward length")
    embd = tensors.get("token_embd.weight")
    windows = _layer_windows(
        {"num_hidden_layers": int(layers),
         **window_fields(str(arch), lambda k: meta.get(f"{arch}.{k}"), int(layers), path)},
        str(arch), key("context_length"))
    by_type: dict[str, int] = {}
    for t in tensor_list:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    return ModelSpec(
        name=os.path.basename(path),
        source=f"gguf ({path})",
        num_layers=int(layers),
        hidden_size=int(hidden),
        intermediate_size=int(inter),
        num_heads=int(heads),
        num_kv_heads=int(key("attention.head_count_kv") or heads),
        head_dim=int(key("attention.key_length") or hidden // heads),
        vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in tensors,
        max_context=key("context_length"),
        model_type=str(arch),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        default_dtype="file",
        file_weight_bytes=sum(t.n_bytes for t in tensor_list),
        file_embedding_bytes=embd.n_bytes if embd is not None else None,
        file_params=sum(t.n_elements for t in tensor_list),
        # The type holding the most bytes (e.g. Q4_1): what the file "is".
        file_type=max(by_type, key=lambda k: by_type[k]) if by_type else "unknown",
        layer_windows=windows,
    )


def load_model(ref: str) -> ModelSpec:
    """A preset name, a config.json, a directory holding one, or a .gguf file."""
    if ref in PRESETS:
        cfg = PRESETS[ref]
        return spec_from_hf_config(cfg, ref, source=f"preset ({cfg['_source']})")
    if os.path.isdir(ref):
        cfg_path = os.path.join(ref, "config.json")
        if os.path.isfile(cfg_path):
            return _load_config(cfg_path, os.path.basename(os.path.normpath(ref)))
        ggufs = sorted(f for f in os.listdir(ref) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return spec_from_gguf(os.path.join(ref, ggufs[0]))
        raise ValueError(f"{ref}: directory has no config.json (nor exactly one .gguf file)")
    if os.path.isfile(ref):
        with open(ref, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return spec_from_gguf(ref)
        if ref.endswith(".gguf"):
            raise ValueError(f"{ref}: not a GGUF file (it does not start with b'GGUF')")
        return _load_config(ref, os.path.splitext(os.path.basename(ref))[0])
    looks_like_path = os.sep in ref or ref.endswith((".json", ".gguf"))
    if looks_like_path:
        raise ValueError(f"{ref}: no such file or directory")
    raise ValueError(
        f"unknown model {ref!r}: not a preset ({', '.join(PRESETS)}) nor an existing path"
    )


def _load_config(path: str, name: str) -> ModelSpec:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: config.json is not a JSON object")
    return spec_from_hf_config(cfg, name, source=f"config.json ({path})")
