"""A model's shape for the planner (ModelSpec) and the parameters it counts.

The planner needs only the shape of a model (layers, widths, head counts,
vocabulary, tied or not), never its weights: that is enough to count
parameters, weight bytes and KV bytes per token.

Counting assumes the Llama family's layout (which Mistral, Qwen2/3 and SmolLM
share): pre-norm RMSNorm blocks, q/k/v/o projections with grouped KV heads,
and a gated MLP (gate, up, down).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

_SANDWICH_NORMS = ("gemma2", "gemma3", "gemma3_text")  # RMSNorm on each block's output too


@dataclass(frozen=True)
class Linear:
    """``count`` matrices of ``n_in`` x ``n_out`` (quantization needs the shapes)."""

    name: str
    n_in: int
    n_out: int
    count: int

    @property
    def params(self) -> int:
        return self.n_in * self.n_out * self.count


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    attention: int
    mlp: int
    norms: int
    lm_head: int  # 0 when tied: the embedding matrix serves as the LM head

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.lm_head

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as capacity depends on it."""

    name: str
    source: str  # "preset (Hub id)", "config.json (path)", "gguf (path)"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_context: int | None = None
    model_type: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # --dtype auto: the checkpoint's own dtype ("file" for GGUF tensors as stored).
    default_dtype: str = "bf16"
    # GGUF only: bytes of all tensors as stored, and of the token embedding.
    file_weight_bytes: int | None = None
    file_embedding_bytes: int | None = None
    file_params: int | None = None
    file_type: str | None = None
    # Each layer's sliding window in keys (0: full attention); () when none is.
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "num_layers", "hidden_size", "intermediate_size", "num_heads",
            "num_kv_heads", "head_dim", "vocab_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model {self.name}: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: {self.num_heads} attention heads is not a multiple "
                f"of {self.num_kv_heads} KV heads"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"model {self.name}: {len(self.layer_windows)} layer windows "
                             f"for {self.num_layers} layers")

    def attended_keys(self, context: int) -> float:
        """Keys a query at position ``context`` attends to, averaged over the
        layers: a windowed layer sees its window's only."""
        if not self.layer_windows:
            return float(context)
        return sum(min(context, w or context) for w in self.layer_windows) / self.num_layers

    def causal_pairs(self, prompt: int) -> float:
        """(query, key) pairs of a causal prefill of ``prompt`` tokens, averaged
        over the layers: ~prompt^2 / 2, each windowed layer's capped at W per query."""
        def pairs(w: int) -> float:
            if not w or prompt <= w:
                return prompt * prompt / 2
            return w * w / 2 + (prompt - w) * w
        windows = self.layer_windows or (0,)
        return sum(map(pairs, windows)) / len(windows)

    def linears(self) -> list[Linear]:
        """Every matmul weight, the LM head included even when tied (it is read)."""
        h, L = self.hidden_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [
            Linear("q_proj", h, q, L),
            Linear("k_proj", h, kv, L),
            Linear("v_proj", h, kv, L),
            Linear("o_proj", q, h, L),
            Linear("gate_proj", h, self.intermediate_size, L),
            Linear("up_proj", h, self.intermediate_size, L),
            Linear("down_proj", self.intermediate_size, h, L),
            Linear("lm_head", h, self.vocab_size, 1),
        ]

    def small_params(self) -> dict[str, int]:
        """Vectors kept at full precision even when the matmuls are quantized."""
        h, L = self.hidden_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn_bias = (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp_bias = 2 * self.intermediate_size + h if self.mlp_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return {
            "attention": L * (attn_bias + qk_norm),
            "mlp": L * mlp_bias,
            # input + post-attention norm per layer (Gemma: also on both blocks' outputs),
            # the final norm
            "norms": L * (4 if self.model_type in _SANDWICH_NORMS else 2) * h + h,
        }

    def param_counts(self) -> ParamCounts:
        lin = {x.name: x.params for x in self.linears()}
        small = self.small_params()
        attention = sum(lin[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
        mlp = sum(lin[k] for k in ("gate_proj", "up_proj", "down_proj"))
        return ParamCounts(
            embedding=self.vocab_size * self.hidden_size,
            attention=attention + small["attention"],
            mlp=mlp + small["mlp"],
            norms=small["norms"],
            lm_head=0 if self.tie_word_embeddings else lin["lm_head"],
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["params"] = self.param_counts().to_dict()
        return d
