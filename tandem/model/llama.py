"""The Llama family (Llama 2/3, SmolLM), Mistral, Phi-3, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Written for the serving hot path, not for training: the batch is one flat
sequence of tokens from many requests ([T, hidden]); Q/K/V and gate/up are
fused into one matmul each (tandem.model.linear: dense or quantized, the
residual add fused where it can be); RoPE cos/sin are precomputed for every position;
K/V go into the paged cache with one indexed copy per layer. The logits are
computed only for the rows that sample.

On CPU in fp32, tandem's fused kernels (``FusedOps``: RMSNorm, RoPE plus the cache
write, SiLU-and-mul; decode attention in tandem.model.attention) replace ~15 small
ops per layer; ``ReferenceOps`` is the same layer in torch, used without them.
One forward, two implementations of its small ops, chosen once per call.
Steps where every sequence decodes skip this forward altogether: the model
runner hands them to tandem.worker.decode_step, one C++ call for all layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels import custom_ops
from tandem.model.attention import AttentionMetadata, paged_attention
from tandem.model.hf_config import tie_word_embeddings
from tandem.model.kv_cache import KVCache
from tandem.model.linear import DenseLinear, Linear

# HF architecture -> family. All share one layout; Phi-3's checkpoints hold
# Q/K/V and gate/up already fused (qkv_proj, gate_up_proj).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    """The few fields of an HF config.json the model needs.

    ``sliding_window``: the window (W keys) of the layers in ``sliding_layers``
    (see _sliding_window); None when no layer's window hides a key.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def layer_window(self, i: int) -> int:
        """Layer i's sliding window in keys, 0 for full attention."""
        return self.sliding_window if self.sliding_window and i in self.sliding_layers else 0

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """The config of a supported architecture; a ValueError naming any
        feature tandem would otherwise compute differently from HF."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; tandem supports "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{arch}: hidden_act {act!r} is not supported (tandem runs SiLU)")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{arch}: mlp_bias is not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            # transformers 5 writes rope_theta and any scaling into rope_parameters.
            rope_params = dict(cfg.get("rope_parameters") or {})
            rope_theta = rope_params.pop("rope_theta", 10000.0)
            if cfg.get("rope_theta") is not None:
                rope_theta = cfg["rope_theta"]
            partial = rope_params.pop("partial_rotary_factor",
                                      cfg.get("partial_rotary_factor", 1.0))
            if float(partial) != 1.0:
                raise ValueError(f"{arch}: partial_rotary_factor {partial} is not supported "
                                 "(tandem rotates the whole head)")
            rope_scaling = cfg.get("rope_scaling") or rope_params
            if (rope_scaling.get("rope_type") or rope_scaling.get("type")) in (None, "default"):
                rope_scaling = None
            max_pos = int(cfg.get("max_position_embeddings", 4096))
            window, sliding = _sliding_window(cfg, family)
            if window is not None and window >= max_pos:  # hides no key of any context
                window, sliding = None, ()
            c = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=max_pos,
                tie_word_embeddings=tie_word_embeddings(cfg, family),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                rope_scaling=rope_scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                sliding_window=window,
                sliding_layers=sliding,
            )
            rope_inv_freq(c)  # an unsupported rope_scaling fails here, before any weight is read
            return c
        except (KeyError, TypeError) as e:
            raise ValueError(f"config.json is missing or has a bad field: {e}") from None


def _sliding_window(cfg: dict, family: str) -> tuple[int | None, tuple[int, ...]]:
    """The window HF attends through (W keys: HF keeps key k for query q when
    q - k < W) and the layers that do, or (None, ()).

    HF's Mistral and Phi-3 window every layer when ``sliding_window`` is set;
    Qwen2/Qwen3 only with ``use_sliding_window``, and only the layers from
    ``max_window_layers`` on (``layer_types`` in transformers 5); Llama never.
    """
    window, n = cfg.get("sliding_window"), int(cfg["num_hidden_layers"])
    if family == "llama" or not window:
        return None, ()
    layers: tuple[int, ...] = tuple(range(n))
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return None, ()
        types = cfg.get("layer_types")
        if types is not None:
            layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        else:
            layers = tuple(range(int(cfg.get("max_window_layers", n)), n))
    return (int(window), layers) if layers else (None, ())


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3's frequency-dependent scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type") or rs.get("type")
    if kind == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (tandem runs default, "
                         "linear and llama3 RoPE)")
    return inv


class Layer:
    """One decoder layer's weights: norms as tensors, matmuls as Linear objects."""

    def __init__(self, w: dict) -> None:
        self.input_norm = w["input_layernorm"]
        self.post_norm = w["post_attention_layernorm"]
        self.qkv: Linear = w["qkv"]  # hidden -> (H + 2 Hkv) * D, with Qwen2's bias
        self.o: Linear = w["o"]  # H * D -> hidden
        self.gate_up: Linear = w["gate_up"]  # hidden -> 2 * inter
        self.down: Linear = w["down"]  # inter -> hidden
        self.window: int = w.get("window", 0)  # sliding window keys (0: full attention)
        self.q_norm = w.get("q_norm")
        self.k_norm = w.get("k_norm")


class ReferenceOps:
    """The layer's small ops in torch: any device and dtype, and the reference the
    fused kernels are tested against."""

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up

    @staticmethod
    def rope(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Per-forward RoPE inputs (the tables gathered once, not per layer)."""
        return (cos.index_select(0, positions).unsqueeze(1),  # [T, 1, D]
                sin.index_select(0, positions).unsqueeze(1))

    @staticmethod
    def rope_and_cache(qkv: torch.Tensor, rope: tuple, h: int, hkv: int, cache: KVCache,
                       slots: torch.Tensor) -> torch.Tensor:
        """RoPE on Q and K, K and V into their cache slots; returns Q."""
        cos, sin = rope
        t, _, d = qkv.shape
        qk = qkv[:, : h + hkv]
        qk = qk * cos + qk.roll(d // 2, -1) * sin
        cache.write(slots, torch.cat((qk[:, h:], qkv[:, h + hkv :]), 1).view(t, 2, hkv, d))
        return qk[:, :h]


class FusedOps(ReferenceOps):
    """tandem's CPU kernels (fp32), each replacing several torch ops per layer."""

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:  # Qwen3's per-head q/k norms
            return ReferenceOps.rms_norm(x, w, eps)
        return torch.ops.tandem.rms_norm(x, w, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.tandem.silu_and_mul(gate_up)

    @staticmethod
    def rope(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple:
        return cos, sin, positions

    @staticmethod
    def rope_and_cache(qkv: torch.Tensor, rope: tuple, h: int, hkv: int, cache: KVCache,
                       slots: torch.Tensor) -> torch.Tensor:
        cos, sin, positions = rope  # in place on Q and K
        torch.ops.tandem.rotary_embedding_and_cache(
            qkv, positions, cos, sin, h, hkv, *cache.kernel_args, slots)
        return qkv[:, :h]


class LlamaModel:
    """Forward over a flat batch: (token ids, positions, attention metadata)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.d**-0.5
        self.embed = weights["embed"]  # [vocab, hidden]
        self.norm = weights["norm"]
        self.lm_head: Linear = weights["lm_head"]  # dense, or int8 in quantized models
        self.layers = [Layer({**w, "window": cfg.layer_window(i)})
                       for i, w in enumerate(weights["layers"])]
        self.window = cfg.sliding_window or 0  # the windowed layers' (build_group's window)
        dev, dt = self.norm.device, self.norm.dtype
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(pos, rope_inv_freq(cfg))  # [P, D/2]
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: one op fewer than cat.
        self.cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(dev, dt)
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), -1).to(dev, dt)
        # Which implementation of the small ops runs (tests flip it to compare paths).
        self.fused = dev.type == "cpu" and dt == torch.float32 and custom_ops.available()

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (a quantized model's embedding is fp16, a row lookup)."""
        return self.norm.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Run the flat batch; returns fp32 logits for the rows in logits_indices."""
        h, hkv, d, eps = self.h, self.hkv, self.d, self.eps
        t = input_ids.shape[0]
        ops = FusedOps if self.fused else ReferenceOps
        rope = ops.rope(self.cos, self.sin, positions)
        x = self.embed.index_select(0, input_ids).to(self.dtype)
        slots = meta.slot_mapping
        for layer, cache in zip(self.layers, kv_caches):
            qkv = layer.qkv(ops.rms_norm(x, layer.input_norm, eps)).view(t, h + 2 * hkv, d)
            if layer.q_norm is not None:  # a fresh tensor: normalized in place
                qkv[:, :h] = ops.rms_norm(qkv[:, :h], layer.q_norm, eps)
                qkv[:, h : h + hkv] = ops.rms_norm(qkv[:, h : h + hkv], layer.k_norm, eps)
            q = ops.rope_and_cache(qkv, rope, h, hkv, cache, slots)
            attn = paged_attention(q, cache, meta, self.scale, layer.window)
            x = layer.o.add(x, attn)
            x = layer.down.add(x, ops.silu_and_mul(
                layer.gate_up(ops.rms_norm(x, layer.post_norm, eps))))
        if logits_indices is None:
            return None
        x = ops.rms_norm(x.index_select(0, logits_indices), self.norm, eps)
        return self.lm_head(x).float()

    @property
    def nbytes(self) -> int:
        """Bytes the weights occupy (a tied LM head is the embedding itself)."""
        norms = self.norm.numel() + sum(
            layer.input_norm.numel() + layer.post_norm.numel() for layer in self.layers
        )
        head = self.lm_head
        tied = isinstance(head, DenseLinear) and head.w.data_ptr() == self.embed.data_ptr()
        embed = 0 if tied else self.embed.numel() * self.embed.element_size()
        return self.weight_bytes + embed + norms * self.norm.element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer matmul and the LM head."""
        return self.lm_head.nbytes + sum(
            lin.nbytes for layer in self.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
