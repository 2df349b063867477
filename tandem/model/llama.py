"""The Llama family (Llama 2/3, SmolLM), Mistral, Phi-3, Qwen2 (q/k/v bias), Qwen3 (q/k norm),
Qwen3-MoE (sparse mixture-of-experts MLPs: tandem.model.moe), Gemma 2 and 3 (GeGLU, norms on
each block's output too, a scaled embedding; Gemma 2's soft-capped logits, Gemma 3's local and
global RoPE).

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels import custom_ops
from tandem.model.attention import AttentionMetadata, paged_attention
from tandem.model.hf_config import sliding_window, tie_word_embeddings
from tandem.model.kv_cache import KVCache
from tandem.model.linear import DenseLinear, Linear
from tandem.model.moe import MoEConfig, SparseMoE

# HF architecture -> family. All share one layout; Phi-3's checkpoints hold
# Q/K/V and gate/up already fused (qkv_proj, gate_up_proj); Gemma adds to it
# (ModelConfig's activation, embed_scale, sandwich_norms, softcaps, local_rope_theta).
SUPPORTED_ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
# Gemma 3 4B-27B checkpoints (Gemma3ForConditionalGeneration: the text model beside a
# vision tower) nest the text model's config under text_config, leaving out what
# equals transformers' Gemma3TextConfig defaults: these.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "bos_token_id": 2, "eos_token_id": 1, "query_pre_attn_scalar": 256, "sliding_window": 4096,
}
# The gated MLP's activation: HF's name -> tandem's (ModelConfig.activation).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass
class ModelConfig:
    """The few fields of an HF config.json the model needs.

    ``sliding_window``: the window (W keys) of the layers in ``sliding_layers``
    (see tandem.model.hf_config.sliding_window); None when no layer's window hides a key (the layers
    still rotate by ``local_rope_theta`` where the model has one).
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
    # Gemma's differences from the Llama layout (the defaults are Llama's):
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # the embedding rows times this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # RMSNorm on attention's and the MLP's outputs too
    attn_scale: float | None = None  # query scale; None: head_dim ** -0.5
    local_rope_theta: float | None = None  # windowed layers' RoPE base, unscaled (None: global)
    attn_softcap: float | None = None  # attention scores cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits, likewise
    moe: MoEConfig | None = None  # the sparse MLP layers' router and experts (Qwen3-MoE)

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
        if "Gemma3ForConditionalGeneration" in archs:  # its text model is served
            cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True),
                   **_GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {}),
                   "architectures": ["Gemma3ForCausalLM"]}
            archs = cfg["architectures"]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; tandem supports "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        gemma = family in ("gemma2", "gemma3")
        field = "hidden_activation" if gemma else "hidden_act"
        act = cfg.get(field) or ("gelu_pytorch_tanh" if gemma else "silu")
        if ACTIVATIONS.get(act) != ("gelu_tanh" if gemma else "silu"):
            raise ValueError(f"{arch}: {field} {act!r} is not supported (tandem runs "
                             f"{'GELU-tanh' if gemma else 'SiLU'} in this family)")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{arch}: mlp_bias is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{arch}: use_bidirectional_attention is not supported")
        # Gemma 2's config class caps by default (a config.json may leave them out).
        softcaps = [cfg.get(k, d if family == "gemma2" else None) or None for k, d in (
            ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))]
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            # transformers 5 writes rope_theta and any scaling into rope_parameters
            # (Gemma 3: one set per layer type; its windowed layers' is local).
            rope_params = dict(cfg.get("rope_parameters") or {})
            local_theta = None
            if family == "gemma3":
                local = dict(rope_params.pop("sliding_attention", None) or {
                    "rope_theta": cfg.get("rope_local_base_freq", 10000.0)})
                rope_params = dict(rope_params.pop("full_attention", None) or rope_params)
                if (local.get("rope_type") or local.get("type")) not in (None, "default"):
                    raise ValueError(f"{arch}: scaled RoPE in windowed layers is not supported")
                local_theta = float(local.get("rope_theta", 10000.0))
                rope_params.setdefault("rope_theta", 1_000_000.0)
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
            window, sliding = sliding_window(cfg, family, max_pos)
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
                qk_norm=family in ("qwen3", "qwen3moe", "gemma3"),
                rope_scaling=rope_scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                sliding_window=window,
                sliding_layers=sliding,
                activation=ACTIVATIONS[act],
                embed_scale=math.sqrt(hidden) if gemma else 1.0,
                sandwich_norms=gemma,
                attn_scale=(float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
                            if gemma else None),
                local_rope_theta=local_theta,
                attn_softcap=None if softcaps[0] is None else float(softcaps[0]),
                final_softcap=None if softcaps[1] is None else float(softcaps[1]),
                moe=MoEConfig.from_hf(cfg, family),
            )
            rope_inv_freq(c)  # an unsupported rope_scaling fails here, before any weight is read
            return c
        except (KeyError, TypeError) as e:
            raise ValueError(f"config.json is missing or has a bad field: {e}") from None


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3's frequency-dependent scaling;
    ``local``: of the windowed layers' own unscaled base (Gemma 3)."""
    d = cfg.head_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = {} if local else cfg.rope_scaling or {}
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


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's final logit soft-capping, cap * tanh(logits / cap) (None: as they are)."""
    return logits if cap is None else torch.tanh(logits / cap).mul_(cap)


class Layer:
    """One decoder layer's weights: norms as tensors, matmuls as Linear objects;
    the MLP is gate_up and down, or (an MoE layer) ``moe`` and neither."""

    def __init__(self, w: dict) -> None:
        self.input_norm = w["input_layernorm"]
        self.post_norm = w["post_attention_layernorm"]
        self.qkv: Linear = w["qkv"]  # hidden -> (H + 2 Hkv) * D, with Qwen2's bias
        self.o: Linear = w["o"]  # H * D -> hidden
        self.moe: SparseMoE | None = w.get("moe")
        self.gate_up: Linear | None = w.get("gate_up")  # hidden -> 2 * inter
        self.down: Linear | None = w.get("down")  # inter -> hidden
        self.window: int = w.get("window", 0)  # sliding window keys (0: full attention)
        self.local_rope: bool = w.get("local_rope", False)  # the windowed layers' RoPE tables
        self.q_norm = w.get("q_norm")
        self.k_norm = w.get("k_norm")
        # Gemma's norms on the attention and MLP outputs, before each residual add.
        self.attn_out_norm = w.get("attn_out_norm")
        self.mlp_out_norm = w.get("mlp_out_norm")

    @property
    def matmuls(self) -> tuple[Linear, ...]:
        """The layer's Linear matmuls (an MoE layer's experts are not among them)."""
        return tuple(lin for lin in (self.qkv, self.o, self.gate_up, self.down)
                     if lin is not None)


class ReferenceOps:
    """The layer's small ops in torch: any device and dtype, and the reference the
    fused kernels are tested against."""

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        if activation == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh") * up

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


# ModelConfig.activation -> the kernels' Activation (layer_ops.h).
KERNEL_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class FusedOps(ReferenceOps):
    """tandem's CPU kernels (fp32), each replacing several torch ops per layer."""

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:  # Qwen3's per-head q/k norms
            return ReferenceOps.rms_norm(x, w, eps)
        return torch.ops.tandem.rms_norm(x, w, eps)

    @staticmethod
    def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return torch.ops.tandem.act_and_mul(gate_up, KERNEL_ACTIVATIONS[activation])

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
        self.scale = cfg.attn_scale or self.d**-0.5
        self.attn_softcap = cfg.attn_softcap or 0.0  # the kernels' "none" is 0
        self.embed = weights["embed"]  # [vocab, hidden]
        self.norm = weights["norm"]
        self.lm_head: Linear = weights["lm_head"]  # dense, or int8 in quantized models
        local = cfg.local_rope_theta is not None
        self.layers = [Layer({**w, "window": cfg.layer_window(i),
                              "local_rope": local and i in cfg.sliding_layers})
                       for i, w in enumerate(weights["layers"])]
        self.window = cfg.sliding_window or 0  # the windowed layers' (build_group's window)
        dev, dt = self.norm.device, self.norm.dtype
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)

        def tables(inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            freqs = torch.outer(pos, inv_freq)  # [P, D/2]
            # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: one op fewer than cat.
            return (torch.cat((freqs.cos(), freqs.cos()), -1).to(dev, dt),
                    torch.cat((-freqs.sin(), freqs.sin()), -1).to(dev, dt))

        self.cos, self.sin = tables(rope_inv_freq(cfg))
        # In the model's dtype, as HF rounds Gemma's sqrt(hidden) (bf16: 2048 ** 0.5 -> 45.25).
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=dt, device=dev)
                            if cfg.embed_scale != 1.0 else None)
        # Gemma 3's windowed layers rotate by their own base (else the same tables).
        self.cos_local, self.sin_local = (tables(rope_inv_freq(cfg, local=True)) if local
                                          else (self.cos, self.sin))
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
        kv_caches: Sequence[KVCache],
        metas: Sequence[AttentionMetadata],
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Run the flat batch; returns fp32 logits for the rows in logits_indices.
        Layer i reads and writes kv_caches[i] through metas[i] (its KV cache
        group's slots and block tables)."""
        h, hkv, d, eps = self.h, self.hkv, self.d, self.eps
        t = input_ids.shape[0]
        ops = FusedOps if self.fused else ReferenceOps
        rope = ops.rope(self.cos, self.sin, positions)
        rope_local = (ops.rope(self.cos_local, self.sin_local, positions)
                      if self.cos_local is not self.cos else rope)
        x = self.embed.index_select(0, input_ids).to(self.dtype)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        act = self.cfg.activation

        def act_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
            return ops.act_and_mul(gate_up, act)

        for layer, cache, meta in zip(self.layers, kv_caches, metas, strict=True):
            qkv = layer.qkv(ops.rms_norm(x, layer.input_norm, eps)).view(t, h + 2 * hkv, d)
            if layer.q_norm is not None:  # a fresh tensor: normalized in place
                qkv[:, :h] = ops.rms_norm(qkv[:, :h], layer.q_norm, eps)
                qkv[:, h : h + hkv] = ops.rms_norm(qkv[:, h : h + hkv], layer.k_norm, eps)
            q = ops.rope_and_cache(qkv, rope_local if layer.local_rope else rope, h, hkv, cache,
                                   meta.slot_mapping)
            attn = paged_attention(q, cache, meta, self.scale, layer.window, self.attn_softcap)
            if layer.attn_out_norm is None:
                x = layer.o.add(x, attn)
                if layer.moe is not None:
                    x = x + layer.moe(ops.rms_norm(x, layer.post_norm, eps), act_and_mul)
                else:
                    x = layer.down.add(x, act_and_mul(
                        layer.gate_up(ops.rms_norm(x, layer.post_norm, eps))))
            else:  # the residual adds what the output norms make of each block's output
                x = x + ops.rms_norm(layer.o(attn), layer.attn_out_norm, eps)
                y = layer.down(act_and_mul(layer.gate_up(ops.rms_norm(x, layer.post_norm, eps))))
                x = x + ops.rms_norm(y, layer.mlp_out_norm, eps)
        if logits_indices is None:
            return None
        x = ops.rms_norm(x.index_select(0, logits_indices), self.norm, eps)
        return soft_cap(self.lm_head(x).float(), self.cfg.final_softcap)

    @property
    def nbytes(self) -> int:
        """Bytes the weights occupy (a tied LM head is the embedding itself)."""
        norms = self.norm.numel() + sum(
            n.numel() for layer in self.layers
            for n in (layer.input_norm, layer.post_norm, layer.attn_out_norm, layer.mlp_out_norm)
            if n is not None
        )
        head = self.lm_head
        tied = isinstance(head, DenseLinear) and head.w.data_ptr() == self.embed.data_ptr()
        embed = 0 if tied else self.embed.numel() * self.embed.element_size()
        return self.weight_bytes + embed + norms * self.norm.element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer matmul and the LM head
        (and every expert: the most an MoE step reads)."""
        return self.lm_head.nbytes + sum(
            sum(lin.nbytes for lin in layer.matmuls) + (layer.moe.nbytes if layer.moe else 0)
            for layer in self.layers)
