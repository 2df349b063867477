"""A whole decode step in one C++ call (CPU: fp32, int8 or int4 weights).

At small batch a decode step is bound by reading the weights, and driven from
Python, op by op, it also leaves memory idle between ops: ~10 dispatches and
thread-team wake-ups per layer and MKL's ramp-up at the start of each small
matmul cost a sizeable share of a batch-1 step.
``torch.classes.tandem.DecodeStep`` (tandem/kernels/csrc/decode_step.h) runs the
embedding rows, every layer and the LM head in one OpenMP team instead, with
the same kernels as the per-op path (tandem.kernels.custom_ops) and, for fp32
weights, its own row-streaming matmul. The model runner gives it the steps
where every scheduled sequence decodes one token and samples, up to
``max_batch`` of them; other steps run LlamaModel.forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tandem.model.kv_cache import KVCache
from tandem.model.llama import KERNEL_ACTIVATIONS, LlamaModel, soft_cap

logger = logging.getLogger(__name__)

# Largest decode batch the step takes: measured on the default model, beyond
# this the per-op path's GEMMs are as fast or faster.
MAX_BATCH = 64


def _matmuls(model: LlamaModel) -> list:
    return [lin for layer in model.layers for lin in layer.matmuls]


class DecodeStep:
    """Holds the model's weights and KV caches on the C++ side once."""

    def __init__(self, model: LlamaModel, kv_caches: list[KVCache], block_size: int,
                 layer_group: Sequence[int]) -> None:
        cfg = model.cfg
        self.max_batch = MAX_BATCH
        self.block_size = block_size
        step = torch.classes.tandem.DecodeStep(
            model.embed, model.norm, model.cos, model.sin, model.h, cfg.head_dim,
            cfg.intermediate_size, block_size, model.eps)
        kind, tensors = model.lm_head.step_args
        step.set_lm_head(int(kind), *tensors, cfg.vocab_size)
        # Llama's layout is the defaults set_variant sets again; Gemma's differ.
        step.set_variant(KERNEL_ACTIVATIONS[cfg.activation], cfg.embed_scale, model.scale,
                         model.cos_local, model.sin_local, model.attn_softcap)
        self.final_softcap = cfg.final_softcap
        for layer, cache, group in zip(model.layers, kv_caches, layer_group):
            args = [lin.step_args for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            step.add_layer(layer.input_norm, layer.post_norm, [int(k) for k, _ in args],
                           [t for _, tensors in args for t in tensors], layer.qkv.bias,
                           layer.q_norm, layer.k_norm, *cache.kernel_args, layer.window,
                           layer.attn_out_norm, layer.mlp_out_norm, layer.local_rope, group)
        self._step = step

    @classmethod
    def build(cls, model: LlamaModel, kv_caches: list[KVCache], block_size: int,
              layer_group: Sequence[int]) -> DecodeStep | None:
        """The step for this model (layer i's KV cache group layer_group[i]), or
        None (LlamaModel.forward runs every step)."""
        if not cls.supports(model):
            return None
        try:
            return cls(model, kv_caches, block_size, layer_group)
        except RuntimeError as e:  # a shape the C++ side refuses: the per-op path still works
            logger.warning("tandem's one-call decode step is off: %s", str(e).splitlines()[0])
            return None

    @staticmethod
    def supports(model: LlamaModel) -> bool:
        """Built kernels, CPU fp32 activations (model.fused), no mixture-of-experts
        layer (the C++ layer is a dense MLP) and every matmul of a kind the step
        runs (the C++ side checks the shapes)."""
        return model.fused and all(layer.moe is None for layer in model.layers) and all(
            lin.step_args is not None for lin in (*_matmuls(model), model.lm_head))

    def __call__(self, tokens: torch.Tensor, block_tables: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, 2 + G] int64 (each decoding sequence's new token id, its
        position and its cache slot in each of the G KV cache groups),
        block_tables [G, B, blocks] int32 covering each position -> logits
        [B, vocab] and each row's argmax (the greedy token, so plain greedy
        sampling runs no torch op after the step). The new K/V go to the caches."""
        logits, argmax = self._step.forward(tokens, block_tables)
        if self.final_softcap is None:
            return logits, argmax
        # tanh keeps the order, but fp32's saturates past ~9x the cap, where the
        # capped logits tie and HF's greedy token is the first of them.
        logits = soft_cap(logits, self.final_softcap)
        return logits, logits.argmax(-1)
