"""Each of a plan's numbers as the formula that gives it, with the numbers filled
in, so that every figure in the report can be checked by hand."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.tools.plan.arithmetic import (
    COMPUTE_EFFICIENCY,
    INT4_GROUP,
    decode_flops_per_token,
    dense_bytes,
    kv_groups,
    prefill_flops,
)
from tandem.tools.plan.devices import GB
from tandem.tools.plan.text import gb, plural

if TYPE_CHECKING:
    from tandem.tools.plan.capacity import Plan


def add_formulas(p: Plan) -> None:
    """Fill ``p.formulas``, in the order the report shows them."""
    _weights(p)
    _kv_cache(p)
    _decode_ceilings(p)
    _concurrency(p)
    _speed(p)


def _weights(p: Plan) -> None:
    s, f = p.model, p.formulas
    pc = s.param_counts()
    if p.dtype == "file":
        f["weights"] = f"{s.file_type} GGUF tensors as stored = {gb(p.weight_bytes)}"
    elif p.dtype in ("int8", "int4"):
        scale = (
            "1 B + fp32 scale per output channel" if p.dtype == "int8"
            else f"0.5 B + fp16 scale and zero per {INT4_GROUP} weights"
        )
        f["weights"] = (
            f"{pc.total / 1e9:.2f} B params, matmuls at {p.dtype} ({scale}), "
            f"norms/biases{'' if s.tie_word_embeddings else ' and input embedding'} 16-bit "
            f"= {gb(p.weight_bytes)}"
        )
    else:
        f["weights"] = (
            f"{pc.total:,} params x {dense_bytes(p.dtype)} B ({p.dtype}) = {gb(p.weight_bytes)}"
        )
    if p.embedding_bytes:
        f["weights_read"] = (
            f"{gb(p.weight_bytes)} - {gb(p.embedding_bytes)} input embedding (a row lookup) "
            f"= {gb(p.weight_bytes_read_per_token)}"
        )


def _kv_cache(p: Plan) -> None:
    """KV per token and per conversation, the cache's share of memory, what it holds."""
    s, d, f = p.model, p.device, p.formulas
    f["kv_per_token"] = (
        f"2 x {s.num_layers} layers x {s.num_kv_heads} KV heads x {s.head_dim} head_dim x "
        f"{p.kv_element_bytes:g} B ({p.kv_cache_dtype}) = {p.kv_bytes_per_token:,.0f} B "
        f"({p.kv_bytes_per_token / 1024:,.1f} KiB)"
    )
    groups = kv_groups(s, p.context)
    layer_tok = p.kv_bytes_per_token / s.num_layers
    if groups.hybrid:
        windowed = sum(1 for w in s.layer_windows if w)
        f["kv_per_conversation"] = (
            f"{s.num_layers - windowed} full-attention layers x {p.context:,} tokens + "
            f"{windowed} windowed layers x their last {max(s.layer_windows):,} keys and one "
            f"{p.max_num_batched_tokens:,}-token step, in {len(groups.windows)} KV cache groups "
            f"of {groups.group_size} layers: {p.kv_blocks_per_conversation:,} blocks x "
            f"{p.block_size} tokens x {groups.group_size} layers x {layer_tok:,.0f} B = "
            f"{gb(p.kv_bytes_per_conversation)} (every layer's: "
            f"{gb(p.kv_bytes_per_token * p.context)})"
        )
    else:
        f["kv_per_conversation"] = (
            f"{p.kv_bytes_per_token:,.0f} B x {p.context:,} tokens = "
            f"{gb(p.kv_bytes_per_conversation)}"
        )
    reserve = f" - {gb(p.reserve_bytes)} reserve" if p.reserve_bytes else ""
    f["cache_bytes"] = (
        f"{gb(d.memory_bytes)} x {p.gpu_memory_utilization:g}{reserve} - {gb(p.weight_bytes)} "
        f"weights - {gb(p.activation_bytes)} activations = "
        f"{gb(p.memory_budget_bytes - p.weight_bytes - p.activation_bytes)}"
    )
    if groups.hybrid:
        f["cache_tokens"] = (
            f"{gb(p.cache_bytes)} / ({layer_tok:,.0f} B x {groups.group_size} layers x "
            f"{p.block_size} tokens) -> {p.cache_blocks:,} blocks = {p.cache_tokens:,} tokens "
            "of every layer"
        )
    else:
        f["cache_tokens"] = (
            f"{gb(p.cache_bytes)} / {p.kv_bytes_per_token:,.0f} B per token -> "
            f"{p.cache_blocks:,} blocks x {p.block_size} = {p.cache_tokens:,} tokens"
        )
    f["conversations_fit"] = (
        f"{p.cache_blocks:,} blocks / {p.kv_blocks_per_conversation:,} blocks per "
        f"{p.context:,}-token conversation = {p.conversations_fit}"
    )


def _decode_ceilings(p: Plan) -> None:
    f = p.formulas
    bw = p.device.bandwidth_bytes_s / GB
    f["decode_ceiling"] = (
        f"{bw:,.0f} GB/s / {gb(p.weight_bytes_read_per_token)} = "
        f"{p.decode_ceiling_tok_s:,.1f} tok/s"
    )
    f["decode_ceiling_with_kv"] = (
        f"{bw:,.0f} GB/s / ({gb(p.weight_bytes_read_per_token)} + "
        f"{gb(p.kv_bytes_read_per_token)} KV read at {p.context:,} tokens) = "
        f"{p.decode_ceiling_with_kv_tok_s:,.1f} tok/s"
    )


def _concurrency(p: Plan) -> None:
    """The load in flight and the slots it is given."""
    f = p.formulas
    if p.streams is not None:
        f["in_flight"] = f"{p.streams} streams with no idle time = {p.in_flight:g} in flight"
    elif p.users is not None:
        f["in_flight"] = (
            f"{p.users:g} users x {p.gen_seconds:g} s generating / {p.turn_seconds:g} s between "
            f"turns = {p.in_flight:.2f} in flight"
        )
    else:
        f["in_flight"] = "no workload given: one stream"
    if p.users is not None:
        f["max_num_seqs"] = (
            f"ceil({p.in_flight:.2f} + 2 x sqrt({p.in_flight:.2f})) = {p.wanted_max_num_seqs} "
            f"(random arrivals: mean + 2 sd), capped at {p.conversations_fit} that fit "
            f"-> {p.max_num_seqs}"
        )
    else:
        f["max_num_seqs"] = (
            f"{plural(p.wanted_max_num_seqs, 'stream')}, capped at {p.conversations_fit} "
            f"that fit -> {p.max_num_seqs}"
        )


def _speed(p: Plan) -> None:
    """The batch's decode step and the full-context prefill."""
    s, d, f = p.model, p.device, p.formulas
    bw = d.bandwidth_bytes_s / GB
    b = max(1, p.max_num_seqs)
    f["aggregate_decode"] = (
        f"step = max(({gb(p.weight_bytes_read_per_token)} + {b} x "
        f"{gb(p.kv_bytes_read_per_token)} KV) / {bw:,.0f} GB/s, {b} x "
        f"{decode_flops_per_token(s, p.context) / 1e9:,.1f} GFLOP / "
        + (
            f"({COMPUTE_EFFICIENCY:g} x {d.peak_flops / 1e12:,.1f} TFLOP/s))"
            if d.peak_flops else "unknown compute peak)"
        )
        + f" = {p.batch_step_s * 1e3:,.1f} ms ({p.batch_bound} bound) -> {b} / step = "
        f"{p.aggregate_decode_tok_s:,.1f} tok/s total, {p.per_stream_decode_tok_s:,.1f} per stream"
    )
    if p.ttft_full_context_s is not None and d.peak_flops:
        f["prefill"] = (
            f"{prefill_flops(s, p.context) / 1e12:,.1f} TFLOP for a {p.context:,}-token prompt / "
            f"({COMPUTE_EFFICIENCY:g} x {d.peak_flops / 1e12:,.1f} TFLOP/s) = "
            f"{p.ttft_full_context_s:,.2f} s to first token ({p.prefill_tok_s:,.0f} tok/s)"
        )
