"""What a plan warns about and notes, and when the load does not fit, what to
cut: the cheaper settings re-planned, each with the slots it would give."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.diagnosis.thresholds import READABLE_TOK_S
from tandem.engine.kv_sizing import longest_context
from tandem.tools.plan.arithmetic import KV8_DTYPES, kv_groups
from tandem.tools.plan.text import gb, plural

if TYPE_CHECKING:
    from tandem.tools.plan.capacity import Plan


def add_advice(p: Plan, *, replan: Callable[..., Plan] | None) -> None:
    """Fill ``p.warnings`` and ``p.notes``.

    ``replan`` is the planner, passed in because it is what calls this: with
    it, a plan that does not fit is re-planned with cheaper settings to put
    numbers on what to cut; None skips those re-plans.
    """
    _input_warnings(p)
    _fit_warnings(p, replan)
    _speed_warning(p)
    _notes(p)


def _input_warnings(p: Plan) -> None:
    """A context past the model's, and memory other processes hold."""
    s, d = p.model, p.device
    if s.max_context and p.context > s.max_context:
        p.warnings.append(
            f"--context {p.context:,} exceeds the model's trained context "
            f"({s.max_context:,} tokens): quality degrades past it, and servers refuse it "
            "without rope scaling"
        )
    if d.available_bytes is not None and p.memory_budget_bytes > d.available_bytes:
        p.warnings.append(
            f"only {gb(d.available_bytes)} of {gb(d.memory_bytes)} is free right now: other "
            "processes hold the rest, so the plan only holds once they are gone"
        )


def _fit_warnings(p: Plan, replan: Callable[..., Plan] | None) -> None:
    """Weights, one conversation or the load that does not fit, and what to cut."""
    w = p.warnings
    weights_fit = p.weight_bytes + p.activation_bytes <= p.memory_budget_bytes
    need = max(1, math.ceil(p.in_flight))
    cuts: list[str] = []
    if not weights_fit:
        where = (
            "offload layers to CPU RAM over PCIe" if p.device.kind == "gpu" else "swap to disk"
        )
        w.append(
            f"the weights ({gb(p.weight_bytes)}) do not fit the memory budget "
            f"({gb(p.memory_budget_bytes)}): the runtime would {where}, and decode would "
            "crawl at the speed of the slower memory"
        )
    elif p.conversations_fit < 1:
        most = _longest_context(p, 1)
        w.append(
            f"one {p.context:,}-token conversation needs {gb(p.kv_bytes_per_conversation)} of "
            f"KV cache but only {gb(p.cache_bytes)} is left after the weights: a long "
            "conversation would be preempted, or offloaded and crawl"
        )
        if most >= p.block_size:
            cuts.append(f"--context {most:,} (the most one conversation can hold)")
    elif p.max_num_seqs < need or p.max_num_seqs < p.wanted_max_num_seqs:
        short = p.max_num_seqs < need
        msg = (
            f"the cache holds {p.conversations_fit} full {p.context:,}-token conversations "
            f"but the workload wants {p.wanted_max_num_seqs} slots"
        )
        if short:
            msg += (
                f" ({p.in_flight:.1f} in flight on average): the rest wait in the queue, or "
                "the engine preempts and recomputes"
            )
        else:
            msg += " for bursts: those queue briefly; the average load fits"
        w.append(msg)
        fit_ctx = _longest_context(p, p.wanted_max_num_seqs)
        if fit_ctx >= p.block_size:
            cuts.append(f"--context {fit_ctx:,} fits {p.wanted_max_num_seqs} slots")
    if replan is not None and (not weights_fit or p.max_num_seqs < p.wanted_max_num_seqs):
        cuts += _explore(p, replan)
        if not weights_fit or p.conversations_fit < need:
            cuts.append("a smaller model, or a device with more memory")
        w.append("to fit, cut one of: " + "; ".join(cuts))


def _speed_warning(p: Plan) -> None:
    if p.max_num_seqs >= 1 and p.per_stream_decode_tok_s < READABLE_TOK_S:
        p.warnings.append(
            f"each stream decodes at ~{p.per_stream_decode_tok_s:.1f} tok/s at "
            f"{p.max_num_seqs} in the batch (ceiling {p.decode_ceiling_tok_s:.1f} tok/s for one): "
            f"below ~{READABLE_TOK_S:g} tok/s text types out slower than people read; "
            "quantizing the weights (int8 halves the bytes read, int4 ~quarters them) "
            "raises it, a bigger batch does not"
        )


def _notes(p: Plan) -> None:
    """What the numbers assume, and how the other engines differ."""
    s, notes = p.model, p.notes
    if p.users is not None and p.max_num_seqs >= 1:
        notes.append(
            f"{p.users:g} users are not {p.users:g} streams: at {p.gen_seconds:g} s of "
            f"generation per {p.turn_seconds:g} s turn only ~{p.in_flight:.1f} generate at once"
        )
    if p.device.kind == "cpu" and p.dtype == "fp32" and s.default_dtype in ("bf16", "fp16"):
        notes.append(
            f"weights in fp32: tandem computes in fp32 on CPU, so it holds this "
            f"{s.default_dtype} checkpoint in fp32 (twice its bytes); --dtype int8 or int4 "
            "plans tandem's --quantization"
        )
    if p.dtype == "file":
        notes.append(
            f"weights are counted as stored in the GGUF ({s.file_type}), as llama-server and "
            "Ollama hold them; tandem holds Q8_0, Q4_0 and Q4_1 blocks as stored, re-blocks "
            "the K-quants into its int4 / int8 groups (a 1.66B Q4_K_M: 1.14 GB read a token "
            "against the file's 0.96) and widens F16 / BF16 to fp32"
        )
    if p.kv_cache_dtype in KV8_DTYPES:
        notes.append(
            "llama-server and Ollama quantize the V cache only with flash attention on "
            "(llama-server -fa on, OLLAMA_FLASH_ATTENTION=1)"
        )
    notes.append(
        "Ollama reserves OLLAMA_NUM_PARALLEL x OLLAMA_CONTEXT_LENGTH tokens of KV at load; "
        "raising either past what fits makes it offload layers to the CPU"
    )


def _longest_context(p: Plan, slots: int) -> int:
    """The longest context of which ``slots`` conversations fit the pool, in
    whole blocks (0 when none does)."""
    tokens = longest_context(kv_groups(p.model, p.context), p.block_size,
                             p.max_num_batched_tokens, p.cache_blocks // slots,
                             p.cache_blocks * p.block_size)
    return tokens // p.block_size * p.block_size


def _explore(p: Plan, replan: Callable[..., Plan]) -> list[str]:
    """Re-plan with cheaper settings and report how many slots each would give."""
    out: list[str] = []
    base = dict(
        context=p.context, gpu_memory_utilization=p.gpu_memory_utilization,
        reserve_bytes=p.reserve_bytes, users=p.users, gen_seconds=p.gen_seconds,
        turn_seconds=p.turn_seconds, streams=p.streams, block_size=p.block_size, explore=False,
    )
    if p.kv_cache_dtype not in KV8_DTYPES:
        q = replan(p.model, p.device, dtype=p.dtype, kv_cache_dtype="int8", **base)
        if q.conversations_fit > p.conversations_fit:
            out.append(
                f"--kv-cache-dtype int8 fits {plural(q.conversations_fit, 'conversation')}"
            )
    rank = {"fp32": 0, "bf16": 1, "fp16": 1, "int8": 2, "int4": 3}
    for dt in ("int8", "int4"):
        if rank[dt] <= rank.get(p.dtype, 4):
            continue
        q = replan(p.model, p.device, dtype=dt, kv_cache_dtype=p.kv_cache_dtype, **base)
        if q.conversations_fit > p.conversations_fit:
            out.append(
                f"--dtype {dt} (weights {gb(q.weight_bytes)}) fits "
                f"{plural(q.conversations_fit, 'conversation')}"
            )
        elif q.weight_bytes + q.activation_bytes > q.memory_budget_bytes:
            out.append(f"(--dtype {dt} would still not fit: weights {gb(q.weight_bytes)})")
    return out
