"""Sparse mixture-of-experts MLP (Qwen3-MoE): a softmax router picks k of E
SwiGLU experts per token and the layer's output is their weighted sum.

A step runs only the experts some token routes to, each once for all of its
tokens: the step's (token, expert) pairs are sorted by expert, each touched
expert's gate/up and down run on its group of rows, and the weighted outputs
are scatter-added back. What a decode step reads thus grows with the number
of distinct experts the batch touches, not with E. The group sizes are read
on the host (one sync per MoE layer on a GPU). The experts are stacked at load
into [E, 2I, hidden] (gate, up) and [E, hidden, I] (down) in the model's float
dtype; quantized experts are refused (tandem.model.loader). The one-call C++
decode step has no MoE layer: tandem.worker.decode_step refuses such models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Families whose MLP can be a sparse MoE block.
MOE_FAMILIES = frozenset({"qwen3moe"})


@dataclass(frozen=True)
class MoEConfig:
    """The router and experts of the MoE layers (``layers``; the others run the
    dense MLP of ``intermediate_size``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (HF's moe_intermediate_size)
    norm_topk_prob: bool  # renormalize the k chosen probabilities to sum to 1
    layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], family: str) -> MoEConfig | None:
        """The MoE block of an HF config, None for a dense family; ValueError for
        what tandem would compute differently from HF.

        HF's Qwen3-MoE makes layer i sparse unless i is in ``mlp_only_layers``
        or (i + 1) is not a multiple of ``decoder_sparse_step``.
        """
        if family not in MOE_FAMILIES:
            return None
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{family}: use_sliding_window is not supported")
        # The Hub's configs say num_experts; transformers 5 saves num_local_experts.
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
        top_k = int(cfg.get("num_experts_per_tok", 8))
        if experts > 0 and not 0 < top_k <= experts:
            raise ValueError(f"{family}: num_experts_per_tok {top_k} of {experts} experts")
        n = int(cfg["num_hidden_layers"])
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(n)
                       if experts > 0 and i not in dense and (i + 1) % step == 0)
        return cls(experts, top_k, int(cfg.get("moe_intermediate_size", 768)),
                   bool(cfg.get("norm_topk_prob", False)), layers)

    def expert_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """An MoE layer's HF tensor names under ``mlp.`` and their shapes."""
        i = self.intermediate_size
        s: dict[str, tuple[int, ...]] = {"gate.weight": (self.num_experts, hidden)}
        for e in range(self.num_experts):
            s |= {f"experts.{e}.gate_proj.weight": (i, hidden),
                  f"experts.{e}.up_proj.weight": (i, hidden),
                  f"experts.{e}.down_proj.weight": (hidden, i)}
        return s


# How a loaded tensor becomes the model's: device, dtype, contiguous.
Put = Callable[[Any], torch.Tensor]
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class SparseMoE:
    """One layer's router and stacked experts; called on the MLP's normalized input."""

    def __init__(self, cfg: MoEConfig, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> None:
        e, i = cfg.num_experts, cfg.intermediate_size
        if router.shape[0] != e or gate_up.shape[:2] != (e, 2 * i) or down.shape[::2] != (e, i):
            raise ValueError(f"expert weights {tuple(gate_up.shape)}, {tuple(down.shape)} do "
                             f"not match {e} experts of {i}")
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.router = router  # [E, hidden]
        self.gate_up = gate_up  # [E, 2I, hidden]: gate rows, then up rows
        self.down = down  # [E, hidden, I]

    @classmethod
    def load(cls, cfg: MoEConfig, take: Callable[[str], Any], put: Put, empty: Empty | None,
             prefix: str, stacked: bool = False) -> SparseMoE:
        """The layer's experts taken by HF name under ``prefix`` (``...mlp.``), one
        at a time into their stacked tensors (``empty``: where those live);
        ``stacked``: the source holds each matrix of all experts as one 3-D
        tensor, ``experts.{gate,up,down}_proj.weight`` (a GGUF's ffn_*_exps)."""
        router = put(take(prefix + "gate.weight"))
        e, i, hidden = cfg.num_experts, cfg.intermediate_size, router.shape[1]
        new = empty or (lambda shape, dtype: torch.empty(shape, dtype=dtype,
                                                         device=router.device))
        gate_up, down = new((e, 2 * i, hidden), router.dtype), new((e, hidden, i), router.dtype)

        def into(dst: torch.Tensor, name: str) -> None:
            t = put(take(name))
            if t.shape != dst.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}; {e} experts "
                                 f"of {i} need {tuple(dst.shape)}")
            dst.copy_(t)

        parts = [(gate_up[:, :i], "gate_proj"), (gate_up[:, i:], "up_proj"), (down, "down_proj")]
        for j in [None] if stacked else range(e):
            p = f"{prefix}experts." if j is None else f"{prefix}experts.{j}."
            for dst, name in parts:
                into(dst if j is None else dst[j], f"{p}{name}.weight")
        return cls(cfg, router, gate_up, down)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.router, self.gate_up, self.down))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> each token's k experts [T, k] and their weights [T, k]
        (HF's order: softmax in fp32, top-k, optionally renormalized)."""
        probs = F.linear(x, self.router).float().softmax(-1)
        weights, experts = probs.topk(self.top_k, -1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def __call__(self, x: torch.Tensor,
                 act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The weighted sum of each token's experts' outputs, [T, hidden]."""
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # the (token, expert) pairs grouped by expert
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order].unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[start : start + n]
            y = F.linear(act_and_mul(F.linear(x.index_select(0, rows), self.gate_up[e])),
                         self.down[e])
            out.index_add_(0, rows, y.mul_(pair_weights[start : start + n]))
            start += n
        return out
