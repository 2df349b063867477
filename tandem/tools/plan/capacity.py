"""A capacity plan: the numbers (tandem.tools.plan.arithmetic) for one model,
device and load, and the advice they lead to — the formulas with the numbers
filled in, the flags for four engines, and the warnings with what to cut.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tandem.tools.plan.arithmetic import (
    BLOCK_SIZE,
    COMPUTE_EFFICIENCY,
    DEFAULT_CPU_RESERVE,
    DEFAULT_GPU_UTILIZATION,
    KV8_DTYPES,
    READABLE_TOK_S,
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
from tandem.tools.plan.presets import ModelSpec
from tandem.tools.plan.text import gb, plural


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
    if users is not None:
        gen_seconds = 12.0 if gen_seconds is None else gen_seconds
        turn_seconds = 90.0 if turn_seconds is None else turn_seconds
        if gen_seconds > turn_seconds:
            raise ValueError(
                f"--gen-seconds ({gen_seconds:g}) exceeds --turn-seconds ({turn_seconds:g}): "
                "a turn includes its own generation"
            )

    wdtype = resolve_dtype(spec, dtype)
    if dtype == "auto" and device.kind == "cpu" and wdtype in ("bf16", "fp16"):
        # What tandem holds: it computes in fp32 on CPU, so a 16-bit checkpoint is
        # widened at load unless --quantization int8 / int4.
        wdtype = engine_compute_dtype(device.kind)
    kvdtype = resolve_kv_dtype(kv_cache_dtype, wdtype, device.kind)
    if device.kind == "cpu" and device.peak_int8_ops and _runs_on_int8(spec, wdtype):
        # The compute roof of quantized weights is the int8 matmul's (VNNI), not fp32's:
        # 5-10x on a CPU with VNNI, and plans from fp32 were that much too slow.
        device = replace(device, peak_flops=device.peak_int8_ops)
    if context is None:
        context = min(8192, spec.max_context or 8192)
    is_gpu = device.kind == "gpu"
    util = gpu_memory_utilization
    if util is None:
        util = DEFAULT_GPU_UTILIZATION if is_gpu else 1.0
    reserve = reserve_bytes if reserve_bytes is not None else (0 if is_gpu else DEFAULT_CPU_RESERVE)
    if reserve >= device.memory_bytes * util:
        raise ValueError(f"--reserve {gb(reserve)} leaves nothing of the device's "
                         f"{gb(device.memory_bytes * util)} for the model")

    # Weights and the KV cache.
    w = weight_bytes(spec, wdtype)
    elem = kv_element_bytes(kvdtype, spec.head_dim)
    kv_tok = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, elem)
    attended = spec.attended_keys(context)  # keys a decode step reads per layer at the end

    # Workload.
    if streams is not None:
        load, bursty = float(streams), False
    elif users is not None:
        assert gen_seconds is not None and turn_seconds is not None
        load, bursty = in_flight(users, gen_seconds, turn_seconds), True
    else:
        load, bursty = 1.0, False

    # The per-step token budget first: it sets the activation peak.
    fpt_half = decode_flops_per_token(spec, context // 2)
    eff_flops = COMPUTE_EFFICIENCY * device.peak_flops if device.peak_flops else None
    step1, _ = decode_step(
        1, w.read_per_token, kv_tok, attended, device.bandwidth_bytes_s, fpt_half,
        device.peak_flops,
    )
    batched = choose_batched_tokens(eff_flops, fpt_half, step1, device.kind)

    # Memory: budget, activations of one full step, what is left for the cache.
    act_b = 4 if (wdtype == "fp32" or not is_gpu) else 2
    act = activation_bytes(spec, batched, act_b, min(batched, 256))
    budget = device.memory_bytes * util - reserve
    cache = budget - w.total - act
    groups = kv_groups(spec, context)
    blocks, tokens = cache_blocks(cache, kv_tok, block_size, groups, spec.num_layers)
    # A windowed group holds its window and the chunk one step computes.
    held = groups.blocks_for(context, block_size, batched)
    fits_n = blocks // held
    kv_conv = (held * block_size * kv_tok * groups.group_size / spec.num_layers
               if groups.hybrid else kv_tok * context)

    wanted, rec = recommend_max_num_seqs(load, fits_n, bursty=bursty, users=users)
    max_queue = max(1, rec)
    batched = max(batched, rec)

    # Speed.
    ceiling = decode_ceiling(device.bandwidth_bytes_s, w.read_per_token)
    ceiling_kv = decode_ceiling(device.bandwidth_bytes_s, w.read_per_token + kv_tok * attended)
    fpt = decode_flops_per_token(spec, context)
    batch = max(1, rec)
    step, bound = decode_step(
        batch, w.read_per_token, kv_tok, attended, device.bandwidth_bytes_s, fpt, device.peak_flops
    )
    prefill_rate = ttft = stall = None
    if eff_flops:
        ttft = prefill_flops(spec, context) / eff_flops
        prefill_rate = context / ttft
        stall = batched * fpt_half / eff_flops

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
        kv_bytes_per_conversation=kv_conv,
        kv_blocks_per_conversation=held,
        kv_bytes_read_per_token=kv_tok * attended,
        activation_bytes=act,
        memory_budget_bytes=budget,
        cache_bytes=max(0.0, cache),
        cache_blocks=blocks,
        cache_tokens=tokens,
        block_size=block_size,
        conversations_fit=fits_n,
        fits=fits_n >= max(1, math.ceil(load)),
        decode_ceiling_tok_s=ceiling,
        decode_ceiling_with_kv_tok_s=ceiling_kv,
        in_flight=load,
        wanted_max_num_seqs=wanted,
        max_num_seqs=rec,
        max_queue=max_queue,
        max_num_batched_tokens=batched,
        chunk_stall_s=stall,
        prefill_tok_s=prefill_rate,
        ttft_full_context_s=ttft,
        batch_step_s=step,
        batch_bound=bound,
        aggregate_decode_tok_s=batch / step,
        per_stream_decode_tok_s=1 / step,
    )
    add_formulas(p)
    add_flags(p)
    _warnings(p, explore=explore)
    return p


def _warnings(p: Plan, *, explore: bool) -> None:
    s, d = p.model, p.device
    w = p.warnings
    if s.max_context and p.context > s.max_context:
        w.append(
            f"--context {p.context:,} exceeds the model's trained context "
            f"({s.max_context:,} tokens): quality degrades past it, and servers refuse it "
            "without rope scaling"
        )
    if d.available_bytes is not None and p.memory_budget_bytes > d.available_bytes:
        w.append(
            f"only {gb(d.available_bytes)} of {gb(d.memory_bytes)} is free right now: other "
            "processes hold the rest, so the plan only holds once they are gone"
        )
    weights_fit = p.weight_bytes + p.activation_bytes <= p.memory_budget_bytes
    need = max(1, math.ceil(p.in_flight))
    cuts: list[str] = []
    if not weights_fit:
        where = (
            "offload layers to CPU RAM over PCIe" if d.kind == "gpu" else "swap to disk"
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
    if explore and (not weights_fit or p.max_num_seqs < p.wanted_max_num_seqs):
        cuts += _explore(p)
        if not weights_fit or p.conversations_fit < need:
            cuts.append("a smaller model, or a device with more memory")
        w.append("to fit, cut one of: " + "; ".join(cuts))
    if p.max_num_seqs >= 1 and p.per_stream_decode_tok_s < READABLE_TOK_S:
        w.append(
            f"each stream decodes at ~{p.per_stream_decode_tok_s:.1f} tok/s at "
            f"{p.max_num_seqs} in the batch (ceiling {p.decode_ceiling_tok_s:.1f} tok/s for one): "
            f"below ~{READABLE_TOK_S:g} tok/s text types out slower than people read; "
            "quantizing the weights (int8 halves the bytes read, int4 ~quarters them) "
            "raises it, a bigger batch does not"
        )
    if p.users is not None and p.max_num_seqs >= 1:
        p.notes.append(
            f"{p.users:g} users are not {p.users:g} streams: at {p.gen_seconds:g} s of "
            f"generation per {p.turn_seconds:g} s turn only ~{p.in_flight:.1f} generate at once"
        )
    if p.device.kind == "cpu" and p.dtype == "fp32" and s.default_dtype in ("bf16", "fp16"):
        p.notes.append(
            f"weights in fp32: tandem computes in fp32 on CPU, so it holds this "
            f"{s.default_dtype} checkpoint in fp32 (twice its bytes); --dtype int8 or int4 "
            "plans tandem's --quantization"
        )
    if p.dtype == "file":
        p.notes.append(
            f"weights are counted as stored in the GGUF ({s.file_type}), as llama-server and "
            "Ollama hold them; tandem holds Q8_0, Q4_0 and Q4_1 blocks as stored, re-blocks "
            "the K-quants into its int4 / int8 groups (a 1.66B Q4_K_M: 1.14 GB read a token "
            "against the file's 0.96) and widens F16 / BF16 to fp32"
        )
    if p.kv_cache_dtype in KV8_DTYPES:
        p.notes.append(
            "llama-server and Ollama quantize the V cache only with flash attention on "
            "(llama-server -fa on, OLLAMA_FLASH_ATTENTION=1)"
        )
    p.notes.append(
        "Ollama reserves OLLAMA_NUM_PARALLEL x OLLAMA_CONTEXT_LENGTH tokens of KV at load; "
        "raising either past what fits makes it offload layers to the CPU"
    )


def _longest_context(p: Plan, slots: int) -> int:
    """The longest context of which ``slots`` conversations fit the pool, in
    whole blocks (0 when none does)."""
    blocks_for = functools.partial(kv_groups(p.model, p.context).blocks_for,
                                   block_size=p.block_size, chunk=p.max_num_batched_tokens)
    tokens = bisect.bisect_right(range(p.cache_blocks * p.block_size + 1), p.cache_blocks // slots,
                                 key=blocks_for) - 1
    return tokens // p.block_size * p.block_size


def _explore(p: Plan) -> list[str]:
    """Re-plan with cheaper settings and report how many slots each would give."""
    out: list[str] = []
    base = dict(
        context=p.context, gpu_memory_utilization=p.gpu_memory_utilization,
        reserve_bytes=p.reserve_bytes, users=p.users, gen_seconds=p.gen_seconds,
        turn_seconds=p.turn_seconds, streams=p.streams, block_size=p.block_size, explore=False,
    )
    if p.kv_cache_dtype not in KV8_DTYPES:
        q = plan(p.model, p.device, dtype=p.dtype, kv_cache_dtype="int8", **base)
        if q.conversations_fit > p.conversations_fit:
            out.append(
                f"--kv-cache-dtype int8 fits {plural(q.conversations_fit, 'conversation')}"
            )
    rank = {"fp32": 0, "bf16": 1, "fp16": 1, "int8": 2, "int4": 3}
    for dt in ("int8", "int4"):
        if rank[dt] <= rank.get(p.dtype, 4):
            continue
        q = plan(p.model, p.device, dtype=dt, kv_cache_dtype=p.kv_cache_dtype, **base)
        if q.conversations_fit > p.conversations_fit:
            out.append(
                f"--dtype {dt} (weights {gb(q.weight_bytes)}) fits "
                f"{plural(q.conversations_fit, 'conversation')}"
            )
        elif q.weight_bytes + q.activation_bytes > q.memory_budget_bytes:
            out.append(f"(--dtype {dt} would still not fit: weights {gb(q.weight_bytes)})")
    return out
