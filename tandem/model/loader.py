"""Resolve a model argument to (config, weights): GGUF file, HF directory or dummy.

A GGUF file is converted once to an HF-style directory in the cache (see
tandem.model.gguf), so every format ends in the same path: config.json plus
safetensors with HF names, fused here into the layout LlamaModel runs on.
``--load-format dummy`` fills any config.json with random weights, so large
configs can be benchmarked without their weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.model.gguf import default_model_path, gguf_to_hf_dir
from tandem.model.hugepages import HugePageArena
from tandem.model.linear import DenseLinear, Linear, make_linear
from tandem.model.llama import LlamaModel, ModelConfig

logger = logging.getLogger(__name__)


def resolve_model_dir(model: str | None, load_format: str) -> Path:
    """An HF-style directory (or, for dummy, a dir or config.json) for the argument."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (give a GGUF file or an HF "
                         "model directory with config.json)")
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if load_format == "gguf" or (load_format == "auto" and is_gguf):
        return gguf_to_hf_dir(path)
    if load_format == "dummy" and path.is_file() and path.name.endswith(".json"):
        return path
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a directory")
    if not (path / "config.json").exists():
        raise ValueError(f"{str(path)!r} has no config.json")
    return path


def read_hf_config(model_dir: Path) -> dict:
    cfg_path = model_dir if model_dir.is_file() else model_dir / "config.json"
    try:
        return json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {cfg_path}: {e}") from None


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(model_dir)!r} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read weights {f}: {e}") from None
    return tensors


def _dummy_weights(cfg: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random HF-named weights with the shapes of cfg (std 0.02, norms 1)."""
    g = torch.Generator().manual_seed(seed)
    hd, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hidden),
         "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rnd(cfg.vocab_size, hidden)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(nh * hd, hidden)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, hidden)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, hidden)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, nh * hd)
        if cfg.attention_bias:
            for n, k in (("q", nh), ("k", nkv), ("v", nkv)):
                w[p + f"self_attn.{n}_proj.bias"] = rnd(k * hd)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=dtype)
            w[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=dtype)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
        w[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    return w


def fuse_weights(
    cfg: ModelConfig,
    hf: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
) -> dict:
    """HF-named tensors -> LlamaModel's fused layout (consumes hf).

    Q/K/V become one matmul and gate/up another. With quantization, every
    layer matmul is quantized, the LM head to int8 whatever the layers' kind,
    and the embedding stays dense (a row lookup, not a matmul).
    """

    def take(name: str) -> torch.Tensor:
        try:
            return hf.pop(name)
        except KeyError:
            raise ValueError(f"the weights have no tensor {name!r}") from None

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    # Dense matmul weights on CPU go to huge pages (decode streams them ~4%
    # faster); quantized ones are repacked by their Linear anyway.
    arena = HugePageArena() if device.type == "cpu" else None

    def dense(t: torch.Tensor) -> torch.Tensor:
        return arena.copy(put(t)) if arena is not None else put(t)

    def lin(w: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        w = dense(w) if quantization == "none" else put(w)
        return make_linear(w, None if bias is None else put(bias), quantization)

    lm = hf.pop("lm_head.weight", None)
    if lm is None and not cfg.tie_word_embeddings:
        raise ValueError("the weights have no lm_head.weight and tie_word_embeddings is false")
    embed = take("model.embed_tokens.weight")
    # Only a dense tied LM head is streamed from the embedding; else it is a row lookup.
    embed = dense(embed) if lm is None and quantization == "none" else put(embed)
    # Quantized models get an int8 LM head (as llama.cpp's Q4/Q8 files have a
    # Q6_K/Q8_0 one): per-channel weights with activations in groups of 32
    # cost +0.003 NLL on the default model, and it is ~a third of what an int8
    # step reads otherwise. The row lookup keeps the float embedding.
    if quantization == "none":
        lm_head: Linear = DenseLinear(embed if lm is None else dense(lm))
    else:
        lm_head = make_linear(embed if lm is None else put(lm), None, "int8")
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
        w = {
            "qkv": lin(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]), qkv_bias),
            "o": lin(take(a + "o_proj.weight")),
            "gate_up": lin(torch.cat((take(m + "gate_proj.weight"), take(m + "up_proj.weight")))),
            "down": lin(take(m + "down_proj.weight")),
            "input_layernorm": put(take(p + "input_layernorm.weight")),
            "post_attention_layernorm": put(take(p + "post_attention_layernorm.weight")),
        }
        if cfg.qk_norm:
            w["q_norm"] = put(take(a + "q_norm.weight"))
            w["k_norm"] = put(take(a + "k_norm.weight"))
        layers.append(w)
    return {"embed": embed, "norm": put(take("model.norm.weight")), "lm_head": lm_head,
            "layers": layers}


def load_model(
    model_dir: Path,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quantization: str = "none",
) -> LlamaModel:
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    if load_format == "dummy":
        hf = _dummy_weights(cfg, dtype, seed)
    else:
        hf = _read_safetensors(model_dir)
    return LlamaModel(cfg, fuse_weights(cfg, hf, dtype, device, quantization))
