"""A capacity plan: the numbers (tandem.tools.plan.arithmetic) for one model,
device and load, each step from the ones before it; then the text they lead to:
the formulas with the numbers filled in, the flags for four engines, and the
warnings with what to cut (formulas.py, flags.py, advice.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

from tandem.tools.plan.advice import add_advice
from tandem.tools.plan.arithmetic import (
    BLOCK_SIZE,
    COMPUTE_EFFICIENCY,
    DEFAULT_CPU_RESERVE,
    DEFAULT_GPU_UTILIZATION,
    activation_bytes,
    cache_blocks,
    choose_batched_tokens,
    decode_ceiling,
    decode_flops_per_token,
    decode_step,
    engine_compute_dtype,
    in_flight,
    kv_bytes_per_token,
    kv_element_bytes,
    kv_groups,
    prefill_flops,
    recommend_max_num_seqs,
    resolve_dtype,
    resolve_kv_dtype,
    weight_bytes,
)
from tandem.tools.plan.devices import Device
from tandem.tools.plan.flags import add_flags
from tandem.tools.plan.formulas import add_formulas
from tandem.tools.plan.model_spec import ModelSpec
from tandem.tools.plan.text import gb


@dataclass
class Plan:
    """A capacity plan: inputs, every derived number, the flags and the warnings."""

    model: ModelSpec
    device: Device
    dtype: str
    kv_cache_dtype: str
    context: int
    gpu_memory_utilization: float
    reserve_bytes: float
    users: float | None
    gen_seconds: float | None
    turn_seconds: float | None
    streams: int | None
    params: int
    weight_bytes: int
    weight_bytes_read_per_token: int
    embedding_bytes: int
    kv_element_bytes: float
    kv_bytes_per_token: float
    kv_bytes_per_conversation: float
    kv_blocks_per_conversation: int
    kv_bytes_read_per_token: float  # the KV a decode step reads per sequence at full context
    activation_bytes: int
    memory_budget_bytes: float
    cache_bytes: float
    cache_blocks: int
    cache_tokens: int
    block_size: int
    conversations_fit: int
    fits: bool
    decode_ceiling_tok_s: float
    decode_ceiling_with_kv_tok_s: float
    in_flight: float
    wanted_max_num_seqs: int
    max_num_seqs: int
    max_queue: int
    max_num_batched_tokens: int
    chunk_stall_s: float | None
    prefill_tok_s: float | None
    ttft_full_context_s: float | None
    batch_step_s: float
    batch_bound: str
    aggregate_decode_tok_s: float
    per_stream_decode_tok_s: float
    formulas: dict[str, str] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        d["device"] = self.device.to_dict()
        return d


def _check_positive(name: str, v: float | None, *, allow_zero: bool = False) -> None:
    if v is None:
        return
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a positive number, got {v}")


def _runs_on_int8(spec: ModelSpec, wdtype: str) -> bool:
    """Whether tandem's CPU matmuls for these weights are int8 ones: --quantization int8
    or int4, or a GGUF held in its own quantized blocks (an F16/BF16/F32 file is fp32)."""
    if wdtype in ("int8", "int4"):
        return True
    return wdtype == "file" and (spec.file_type or "F32").upper() not in ("F32", "F16", "BF16")


class _Pool(NamedTuple):
    """The memory left to the KV cache, and the full-context conversations it holds."""

    activation_bytes: int
    cache_bytes: float  # negative when the weights and activations alone overrun the budget
    blocks: int
    tokens: int
    blocks_per_conversation: int
    bytes_per_conversation: float
    conversations_fit: int


class _Decode(NamedTuple):
    """Decode speed: one stream's ceilings, and the step of a full batch."""

    ceiling_tok_s: float
    ceiling_with_kv_tok_s: float
    batch: int
    step_s: float
    bound: str


class _Prefill(NamedTuple):
    """Prefill speed at the compute roof; all None without a compute peak."""

    tok_s: float | None
    ttft_full_context_s: float | None
    chunk_stall_s: float | None


def plan(
    spec: ModelSpec,
    device: Device,
    *,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    context: int | None = None,
    gpu_memory_utilization: float | None = None,
    reserve_bytes: float | None = None,
    users: float | None = None,
    gen_seconds: float | None = None,
    turn_seconds: float | None = None,
    streams: int | None = None,
    block_size: int = BLOCK_SIZE,
    explore: bool = True,
) -> Plan:
    """Work out the whole plan; ValueError on input that makes no sense.

    ``explore`` re-plans with cheaper settings (shorter context, 8-bit cache,
    quantized weights) to put numbers on the "what to cut" advice.
    """
    _check_inputs(device, users=users, gen_seconds=gen_seconds, turn_seconds=turn_seconds,
                  streams=streams, context=context,
                  gpu_memory_utilization=gpu_memory_utilization, reserve_bytes=reserve_bytes)
    if users is not None:
        gen_seconds, turn_seconds = _chat_turn(gen_seconds, turn_seconds)
    wdtype, kvdtype = _held_dtypes(spec, device.kind, dtype, kv_cache_dtype)
    device = _compute_roof(spec, device, wdtype)
    if context is None:
        context = min(8192, spec.max_context or 8192)
    util, reserve, budget = _memory_budget(device, gpu_memory_utilization, reserve_bytes)

    w = weight_bytes(spec, wdtype)
    elem = kv_element_bytes(kvdtype, spec.head_dim)
    kv_tok = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, elem)
    attended = spec.attended_keys(context)  # keys a decode step reads per layer at the end
    load, bursty = _workload(users, gen_seconds, turn_seconds, streams)
    # The per-step token budget first: it sets the activation peak.
    batched = _token_budget(spec, device, context, w.read_per_token, kv_tok, attended)
    pool = _kv_pool(spec, device, wdtype, context, budget, w.total, kv_tok, batched, block_size)
    wanted, rec = recommend_max_num_seqs(load, pool.conversations_fit, bursty=bursty, users=users)
    batched = max(batched, rec)
    decode = _decode_speed(spec, device, context, w.read_per_token, kv_tok, attended, rec)
    prefill = _prefill_speed(spec, device, context, batched)

    p = Plan(
        model=spec,
        device=device,
        dtype=wdtype,
        kv_cache_dtype=kvdtype,
        context=context,
        gpu_memory_utilization=util,
        reserve_bytes=reserve,
        users=users,
        gen_seconds=gen_seconds if users is not None else None,
        turn_seconds=turn_seconds if users is not None else None,
        streams=streams,
        params=spec.param_counts().total,
        weight_bytes=w.total,
        weight_bytes_read_per_token=w.read_per_token,
        embedding_bytes=w.embedding,
        kv_element_bytes=elem,
        kv_bytes_per_token=kv_tok,
        kv_bytes_per_conversation=pool.bytes_per_conversation,
        kv_blocks_per_conversation=pool.blocks_per_conversation,
        kv_bytes_read_per_token=kv_tok * attended,
        activation_bytes=pool.activation_bytes,
        memory_budget_bytes=budget,
        cache_bytes=max(0.0, pool.cache_bytes),
        cache_blocks=pool.blocks,
        cache_tokens=pool.tokens,
        block_size=block_size,
        conversations_fit=pool.conversations_fit,
        fits=pool.conversations_fit >= max(1, math.ceil(load)),
        decode_ceiling_tok_s=decode.ceiling_tok_s,
        decode_ceiling_with_kv_tok_s=decode.ceiling_with_kv_tok_s,
        in_flight=load,
        wanted_max_num_seqs=wanted,
        max_num_seqs=rec,
        max_queue=max(1, rec),
        max_num_batched_tokens=batched,
        chunk_stall_s=prefill.chunk_stall_s,
        prefill_tok_s=prefill.tok_s,
        ttft_full_context_s=prefill.ttft_full_context_s,
        batch_step_s=decode.step_s,
        batch_bound=decode.bound,
        aggregate_decode_tok_s=decode.batch / decode.step_s,
        per_stream_decode_tok_s=1 / decode.step_s,
    )
    add_formulas(p)
    add_flags(p)
    add_advice(p, replan=plan if explore else None)
    return p


def _check_inputs(
    device: Device,
    *,
    users: float | None,
    gen_seconds: float | None,
    turn_seconds: float | None,
    streams: int | None,
    context: int | None,
    gpu_memory_utilization: float | None,
    reserve_bytes: float | None,
) -> None:
    """ValueError, naming the flag, for a load given two ways or a number out of range."""
    if streams is not None and users is not None:
        raise ValueError("give --users (chat, with idle time) or --streams (agents), not both")
    if streams is not None and (gen_seconds is not None or turn_seconds is not None):
        raise ValueError("--gen-seconds/--turn-seconds describe --users; --streams never idle")
    if users is None and streams is None and (gen_seconds is not None or turn_seconds is not None):
        raise ValueError("--gen-seconds/--turn-seconds need --users")
    _check_positive("--users", users)
    _check_positive("--gen-seconds", gen_seconds)
    _check_positive("--turn-seconds", turn_seconds)
    _check_positive("--reserve", reserve_bytes, allow_zero=True)
    _check_positive("memory", device.memory_bytes)
    _check_positive("bandwidth", device.bandwidth_bytes_s)
    if streams is not None and (not isinstance(streams, int) or streams <= 0):
        raise ValueError(f"--streams must be a positive integer, got {streams}")
    if context is not None and (not isinstance(context, int) or context <= 0):
        raise ValueError(f"--context must be a positive integer, got {context}")
    if gpu_memory_utilization is not None and not (0 < gpu_memory_utilization <= 1):
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}"
        )


def _chat_turn(gen_seconds: float | None, turn_seconds: float | None) -> tuple[float, float]:
    """A chat user's generation time and turn, 12 s in 90 s unless given."""
    gen_seconds = 12.0 if gen_seconds is None else gen_seconds
    turn_seconds = 90.0 if turn_seconds is None else turn_seconds
    if gen_seconds > turn_seconds:
        raise ValueError(
            f"--gen-seconds ({gen_seconds:g}) exceeds --turn-seconds ({turn_seconds:g}): "
            "a turn includes its own generation"
        )
    return gen_seconds, turn_seconds


def _held_dtypes(spec: ModelSpec, kind: str, dtype: str, kv_cache_dtype: str) -> tuple[str, str]:
    """The weights' and the KV cache's dtypes as tandem would hold them on ``kind``."""
    wdtype = resolve_dtype(spec, dtype)
    if dtype == "auto" and kind == "cpu" and wdtype in ("bf16", "fp16"):
        # What tandem holds: it computes in fp32 on CPU, so a 16-bit checkpoint is
        # widened at load unless --quantization int8 / int4.
        wdtype = engine_compute_dtype(kind)
    return wdtype, resolve_kv_dtype(kv_cache_dtype, wdtype, kind)


def _compute_roof(spec: ModelSpec, device: Device, wdtype: str) -> Device:
    """The device with the compute peak these weights' matmuls run at."""
    if device.kind == "cpu" and device.peak_int8_ops and _runs_on_int8(spec, wdtype):
        # The compute roof of quantized weights is the int8 matmul's (VNNI), not
        # fp32's: plans from fp32's came out several times too slow.
        return replace(device, peak_flops=device.peak_int8_ops)
    return device


def _memory_budget(
    device: Device, gpu_memory_utilization: float | None, reserve_bytes: float | None
) -> tuple[float, float, float]:
    """The utilization, the reserve, and the bytes they leave for weights, activations
    and the KV cache; ValueError when the reserve leaves none."""
    is_gpu = device.kind == "gpu"
    util = gpu_memory_utilization
    if util is None:
        util = DEFAULT_GPU_UTILIZATION if is_gpu else 1.0
    reserve = reserve_bytes if reserve_bytes is not None else (0 if is_gpu else DEFAULT_CPU_RESERVE)
    if reserve >= device.memory_bytes * util:
        raise ValueError(f"--reserve {gb(reserve)} leaves nothing of the device's "
                         f"{gb(device.memory_bytes * util)} for the model")
    return util, reserve, device.memory_bytes * util - reserve


def _workload(
    users: float | None, gen_seconds: float | None, turn_seconds: float | None,
    streams: int | None,
) -> tuple[float, bool]:
    """Sequences in flight on average, and whether they come in random bursts (chat users)."""
    if streams is not None:
        return float(streams), False
    if users is not None:
        assert gen_seconds is not None and turn_seconds is not None
        return in_flight(users, gen_seconds, turn_seconds), True
    return 1.0, False


def _effective_flops(device: Device) -> float | None:
    return COMPUTE_EFFICIENCY * device.peak_flops if device.peak_flops else None


def _token_budget(
    spec: ModelSpec, device: Device, context: int, weights_read: int, kv_tok: float,
    attended: float,
) -> int:
    """The per-step token budget (--max-num-batched-tokens), from one stream's decode
    step and the compute of a token at half the context."""
    fpt_half = decode_flops_per_token(spec, context // 2)
    step1, _ = decode_step(
        1, weights_read, kv_tok, attended, device.bandwidth_bytes_s, fpt_half, device.peak_flops,
    )
    return choose_batched_tokens(_effective_flops(device), fpt_half, step1, device.kind)


def _kv_pool(
    spec: ModelSpec, device: Device, wdtype: str, context: int, budget: float,
    weights: int, kv_tok: float, batched: int, block_size: int,
) -> _Pool:
    """What the budget leaves the cache after the weights and one full step's
    activations, in blocks, and how many full-context conversations they hold."""
    act_b = 4 if (wdtype == "fp32" or device.kind != "gpu") else 2
    act = activation_bytes(spec, batched, act_b, min(batched, 256))
    cache = budget - weights - act
    groups = kv_groups(spec, context)
    blocks, tokens = cache_blocks(cache, kv_tok, block_size, groups, spec.num_layers)
    # A windowed group holds its window and the chunk one step computes.
    held = groups.blocks_for(context, block_size, batched)
    kv_conv = (held * block_size * kv_tok * groups.group_size / spec.num_layers
               if groups.hybrid else kv_tok * context)
    return _Pool(act, cache, blocks, tokens, held, kv_conv, blocks // held)


def _decode_speed(
    spec: ModelSpec, device: Device, context: int, weights_read: int, kv_tok: float,
    attended: float, max_num_seqs: int,
) -> _Decode:
    """The bandwidth ceilings of one stream, and a step of ``max_num_seqs`` at full context."""
    bw = device.bandwidth_bytes_s
    batch = max(1, max_num_seqs)
    step, bound = decode_step(
        batch, weights_read, kv_tok, attended, bw, decode_flops_per_token(spec, context),
        device.peak_flops,
    )
    return _Decode(
        decode_ceiling(bw, weights_read), decode_ceiling(bw, weights_read + kv_tok * attended),
        batch, step, bound,
    )


def _prefill_speed(spec: ModelSpec, device: Device, context: int, batched: int) -> _Prefill:
    """A full-context prompt's time to first token, and what a full chunk holds decodes back."""
    eff_flops = _effective_flops(device)
    if not eff_flops:
        return _Prefill(None, None, None)
    ttft = prefill_flops(spec, context) / eff_flops
    stall = batched * decode_flops_per_token(spec, context // 2) / eff_flops
    return _Prefill(context / ttft, ttft, stall)
