"""A whole decode step in one C++ call: CPU, fp32, dense weights.

At small batch a decode step is bound by reading the weights, and driven from
Python, op by op, it also leaves memory idle between ops: ~10 dispatches and
thread-team wake-ups per layer and MKL's ramp-up at the start of each small
matmul cost ~3.5 ms of a 22 ms step at batch 1 for the default model.
``torch.classes.tandem.DecodeStep`` (tandem/csrc/decode_step.h) runs the
embedding rows, every layer and the LM head in one OpenMP team instead, with
the same kernels as the per-op path (tandem._custom_ops) and its own
row-streaming matmul. It takes the steps where every scheduled sequence
decodes one token and samples; mixed prefill steps run LlamaModel.forward.
"""

from __future__ import annotations

import torch

from tandem.model.attention import AttentionMetadata
from tandem.model.kv_cache import KVCache
from tandem.model.linear import DenseLinear
from tandem.model.llama import LlamaModel


class DecodeStep:
    """Holds the model's weights and KV caches on the C++ side once."""

    def __init__(self, model: LlamaModel, kv_caches: list[KVCache], block_size: int) -> None:
        layers = model.layers
        args = [cache.kernel_args for cache in kv_caches]
        self._step = torch.classes.tandem.DecodeStep(
            model.embed, model.norm, model.lm_head.w, model.cos, model.sin,
            [layer.input_norm for layer in layers], [layer.post_norm for layer in layers],
            [layer.qkv.w for layer in layers],
            [layer.qkv.bias for layer in layers if layer.qkv.bias is not None],
            [layer.o.w for layer in layers], [layer.gate_up.w for layer in layers],
            [layer.down.w for layer in layers],
            [layer.q_norm for layer in layers if layer.q_norm is not None],
            [layer.k_norm for layer in layers if layer.k_norm is not None],
            [cache for cache, _ in args], [scale for _, scale in args if scale is not None],
            model.h, block_size, model.eps,
        )

    @staticmethod
    def supports(model: LlamaModel) -> bool:
        """Built kernels, CPU fp32 (model.fused) and dense layer weights."""
        return model.fused and all(
            isinstance(lin, DenseLinear)
            for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, vocab] of B decoding sequences and each row's argmax (the
        greedy token, so plain greedy sampling runs no torch op after the step);
        their new K/V go to the caches."""
        dec = meta.decode
        return self._step.forward(input_ids, positions, meta.slot_mapping, dec.block_table,
                                  dec.context_lens)
