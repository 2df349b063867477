"""The doctor's rules over probe measurements: what is slow, and which knob first.

A serving checklist, as rules over numbers measured on the live server:

* "the first token takes four seconds" is either **prefill** (TTFT grows with
  the prompt: shorten it, cache its prefix, give prefill a bigger token
  budget) or **a queue** (the request had not even started: more slots, or
  fewer users per server) — or a cold start or fixed overhead when TTFT does
  not depend on the prompt at all;
* "the text types out slowly" is **decode**, which is bandwidth bound:
  compare with bandwidth / model bytes, quantize, keep the context short;
  "it stutters when someone else presses send" is a prefill chunk holding
  the batch up: lower the token budget;
* "fine for me, crawls at 5 users" is one request at a time (Ollama's
  ``OLLAMA_NUM_PARALLEL=1``) or a KV cache that is full and preempts.

``diagnose(Measurements)`` is a pure function of numbers (collected by
``tandem.tools.doctor.probe``), so every rule is tested on synthetic
measurements, and every finding carries the number that triggered it.
"""

from __future__ import annotations

import math

from tandem.diagnosis.findings import (
    Finding,
    budget_wait_finding,
    cache_finding,
    gb,
    ms,
    prefill_finding,
    queue_finding,
    rejected_finding,
    slow_decode_finding,
    sort_findings,
    stall_finding,
)
from tandem.diagnosis.knobs import fewer_bytes, knob
from tandem.diagnosis.measurements import Measurements, Probe
from tandem.diagnosis.thresholds import (
    CEILING_HIGH,
    CEILING_LOW,
    COLD_START_S,
    CONTEXT_DROP,
    GROWTH,
    KV_FULL,
    QUEUE_S,
    READABLE_TOK_S,
    STALL_FACTOR,
    STALL_S,
)


def _ok(p: Probe | None) -> bool:
    return p is not None and p.ok and not math.isnan(p.ttft_s)


def prefill_rate(m: Measurements) -> tuple[float, str]:
    """Prefill tokens/s and how it was obtained.

    The server's own split is best. Without it, the difference between the
    long and the short prompt cancels the fixed part of TTFT (network, HTTP,
    one decode step) and leaves the cost of the extra prompt tokens.
    """
    if _ok(m.long) and not math.isnan(m.long.prefill_tok_s):
        return m.long.prefill_tok_s, "the server's prefill time for the long prompt"
    if _ok(m.short) and _ok(m.long):
        dn = m.long.prompt_tokens - m.short.prompt_tokens
        dt = m.long.ttft_s - m.short.ttft_s
        if dn > 0 and dt > 0:
            return dn / dt, (
                f"({m.long.prompt_tokens:,} - {m.short.prompt_tokens:,}) tokens / "
                f"({m.long.ttft_s:.3f} - {m.short.ttft_s:.3f}) s of TTFT"
            )
    return math.nan, "not measured"


def _cache_pressure(m: Measurements) -> tuple[bool, list[str], dict[str, float]]:
    """Preemptions during the probes, or a KV cache close to full."""
    parts: list[str] = []
    values: dict[str, float] = {}
    b, a, peak = m.metrics_before, m.metrics_after, m.metrics_peak
    if b and a and b.preemptions is not None and a.preemptions is not None:
        d = a.preemptions - b.preemptions
        if d > 0:
            parts.append(f"vllm:num_preemptions_total rose by {d:g} during the probes")
            values["preemptions"] = d
    per_request = sum(
        p.preemptions or 0 for p in (m.short, m.long, m.stream, m.pair_first, m.pair_second)
        if p is not None
    )
    if per_request and "preemptions" not in values:
        parts.append(f"{per_request} of the probe requests were preempted (tandem object)")
        values["preemptions"] = per_request
    usage = max(
        (s.kv_usage for s in (b, peak) if s is not None and s.kv_usage is not None),
        default=None,
    )
    if usage is not None and usage >= KV_FULL:
        parts.append(f"vllm:kv_cache_usage_perc reached {usage:.0%}")
        values["kv_usage_peak"] = usage
    return bool(parts), parts, values


def _rule_cache(m: Measurements) -> Finding | None:
    hit, parts, values = _cache_pressure(m)
    if not hit:
        return None
    return cache_finding(m.kind, "; ".join(parts), values)


def pair_overlap(m: Measurements) -> tuple[float, float, float] | None:
    """(overlap of the two streams, extra wait of the second, first's remaining time), s.

    The second request (a long prompt) is sent while the first streams. On a
    server that batches, its first token comes after about its solo TTFT
    while the first is still streaming; on a one-at-a-time server it comes
    only after the first's last token, late by about the first's remaining time.
    """
    a, b = m.pair_first, m.pair_second
    if not (_ok(a) and _ok(b)):
        return None
    a_times, b_times = a.token_times_s, b.token_times_s
    overlap = min(a_times[-1], b_times[-1]) - max(a_times[0], b_times[0])
    solo = m.long.ttft_s if _ok(m.long) else 0.0
    extra = b.ttft_s - solo
    remaining = a_times[-1] - b.sent_s
    return overlap, extra, remaining


def _rule_one_at_a_time(m: Measurements, cache_hit: bool) -> Finding | None:
    ov = pair_overlap(m)
    if ov is None:
        return None
    overlap, extra, remaining = ov
    b = m.pair_second
    assert b is not None
    # Serialized: no overlap, and the second lost about the whole rest of the first.
    if not (overlap <= 0 and remaining > 0 and extra >= 0.5 * remaining):
        return None
    if cache_hit:
        return None  # it waited for KV blocks, not a slot: the cache finding says so
    if b.server_queue_s is not None and b.server_queue_s < 0.5 * extra:
        # Admitted at once: its prefill went slower beside the first stream (a
        # server that caps prompt tokens beside decodes), not a wait for a slot.
        return None
    k = m.kind
    ev = (
        f"a second request sent while the first was streaming got its first token only "
        f"{b.ttft_s:.2f} s later, {extra:.2f} s more than alone, after the first had finished "
        f"(the first still had {remaining:.2f} s to go)"
    )
    if b.server_queue_s is not None:
        ev += f"; the server says it queued {b.server_queue_s:.2f} s"
    if m.pair_metrics_peak and m.pair_metrics_peak.waiting:
        ev += f"; vllm:num_requests_waiting reached {m.pair_metrics_peak.waiting:g}"
    if m.slots == 1:
        ev += "; the server reports 1 slot"
    title = "The server runs one request at a time: every other user waits for a whole reply"
    if k == "ollama":
        title += " (Ollama's OLLAMA_NUM_PARALLEL=1 case)"
    return Finding(
        "one_at_a_time", "problem", "queue", title, ev,
        [
            f"let requests share the batch: {knob(k, 'slots')}, slightly above the requests "
            f"in flight ({knob(k, 'size_plan')} gives the number)",
            f"keep the queue short so overload is a fast, retryable error: {knob(k, 'queue')}",
        ],
        {"overlap_s": overlap, "extra_wait_s": extra, "first_remaining_s": remaining},
    )


def _rule_queue(m: Measurements) -> Finding | None:
    parts: list[str] = []
    values: dict[str, float] = {}
    if m.metrics_before and m.metrics_before.waiting:
        parts.append(
            f"before any probe, vllm:num_requests_waiting was {m.metrics_before.waiting:g} "
            f"(with {m.metrics_before.running or 0:g} running): other users' requests had not "
            "started"
        )
        values["waiting_before"] = m.metrics_before.waiting
    for p in (m.short, m.long, m.stream):
        if _ok(p) and p.server_queue_s is not None and p.server_queue_s >= QUEUE_S:
            parts.append(
                f"the lone {p.name} probe waited {p.server_queue_s:.2f} s for a slot "
                f"(of {p.ttft_s:.2f} s TTFT)"
            )
            values[f"{p.name}_queue_s"] = p.server_queue_s
    if not parts:
        return None
    samples = [s for s in (m.metrics_before, m.metrics_peak) if s]
    running = max((s.running or 0) for s in samples) if samples else None
    if m.slots is not None and running is not None and running < m.slots:
        # Waiting with slots free: what requests wait for is the per-step prompt budget.
        values["peak_running"] = running
        return budget_wait_finding(
            m.kind, f"{'; '.join(parts)}; with at most {running:g} of {m.slots} sequence "
            "slots in use", values)
    return queue_finding(m.kind, "; ".join(parts), values)


def _rule_rejected(m: Measurements) -> Finding | None:
    for p in (m.warmup, m.short, m.long, m.stream, m.pair_first, m.pair_second):
        if p is not None and not p.ok and ("503" in p.error or "overload" in p.error.lower()):
            return rejected_finding(m.kind, f"the {p.name} probe failed: {p.error}")
    return None


def _rule_prefill(m: Measurements) -> Finding | None:
    if not (_ok(m.short) and _ok(m.long)):
        return None
    s, lg = m.short, m.long

    def unqueued(p: Probe) -> float:
        """TTFT less the queue the server reports: a queue's growth is the queue's
        finding (93% of a short probe's TTFT was queue once, and read as prefill)."""
        return max(p.ttft_s - (p.server_queue_s or 0.0), 0.0)

    growth = unqueued(lg) / unqueued(s) if unqueued(s) > 0 else math.inf
    prefill_share = (
        lg.server_prefill_s / lg.ttft_s if lg.server_prefill_s and lg.ttft_s > 0 else None
    )
    from_prefill = growth >= GROWTH or (prefill_share is not None and prefill_share >= 0.5)
    if unqueued(lg) <= m.ttft_target_s or not from_prefill:
        return None
    rate, how = prefill_rate(m)
    ev = (
        f"TTFT {ms(s.ttft_s)} at {s.prompt_tokens:,} prompt tokens -> {ms(lg.ttft_s)} at "
        f"{lg.prompt_tokens:,} ({growth:.1f}x), above the {m.ttft_target_s:g} s target"
    )
    if not math.isnan(rate):
        ev += f"; prefill runs at {rate:,.0f} tok/s ({how})"
        ev += f", so every 1,000 prompt tokens cost {1000 / rate:.2f} s before the first token"
    return prefill_finding(
        m.kind, "TTFT grows with the prompt length", ev,
        {"ttft_short_s": s.ttft_s, "ttft_long_s": lg.ttft_s, "growth": growth,
         "prefill_tok_s": rate},
    )


def _rule_ttft_overhead(m: Measurements, queued: bool) -> Finding | None:
    if not (_ok(m.short) and _ok(m.long)) or queued:
        return None
    s, lg = m.short, m.long
    growth = lg.ttft_s / s.ttft_s if s.ttft_s > 0 else math.inf
    if s.ttft_s <= m.ttft_target_s or growth >= GROWTH:
        return None
    return Finding(
        "ttft_overhead", "problem", "startup",
        "The first token is slow even for a short prompt, and barely depends on its "
        "length: the time is not prefill",
        f"TTFT {ms(s.ttft_s)} at {s.prompt_tokens:,} tokens and {ms(lg.ttft_s)} at "
        f"{lg.prompt_tokens:,} ({growth:.1f}x for {lg.prompt_tokens / max(1, s.prompt_tokens):.0f}"
        "x the prompt)",
        [
            "look for a queue in front (a proxy, a gateway) and for other users' load",
            "check the network path (TLS, a VPN, a remote region)",
            f"rule out a model loaded on demand: {knob(m.kind, 'keep_alive')}",
        ],
        {"ttft_short_s": s.ttft_s, "ttft_long_s": lg.ttft_s, "growth": growth},
    )


def _unqueued(p: Probe) -> float:
    """A probe's TTFT less the wait for a slot the server reports: a busy server's queue
    is not a cold start."""
    return p.ttft_s - (p.server_queue_s or 0.0)


def _rule_cold_start(m: Measurements) -> Finding | None:
    w = m.warmup
    if w is None or not w.ok:
        return None
    if w.load_s is not None and w.load_s >= COLD_START_S:
        ev = f"the first request's load_duration was {w.load_s:.2f} s"
        value = w.load_s
    elif _ok(m.short) and _unqueued(w) >= COLD_START_S and \
            _unqueued(w) >= 3 * _unqueued(m.short):
        ev = (
            f"the first request's TTFT was {w.ttft_s:.2f} s for {w.prompt_tokens} prompt "
            f"tokens; the next took {m.short.ttft_s:.2f} s for {m.short.prompt_tokens}"
        )
        if w.server_queue_s:
            ev += f" (less the time each queued, as the server says: {_unqueued(w):.2f} s " \
                  f"against {_unqueued(m.short):.2f} s)"
        value = _unqueued(w)
    else:
        return None
    return Finding(
        "cold_start", "warning", "startup",
        "The first request was far slower than the next: a cold start (a model loaded on "
        "demand, or lazy initialisation) that some user pays",
        ev,
        [f"keep the model loaded: {knob(m.kind, 'keep_alive')}"],
        {"cold_start_s": value},
    )


def _rule_slow_decode(m: Measurements) -> Finding | None:
    p = m.stream
    if not _ok(p):
        return None
    rate = p.decode_tok_s
    if math.isnan(rate) or rate >= READABLE_TOK_S:
        return None
    ev = (
        f"one stream decodes at {rate:.1f} tok/s ({p.output_tokens} tokens, ITL p50 "
        f"{ms(p.itl_p50_s)}), below the ~{READABLE_TOK_S:g} tok/s people read at"
    )
    ceiling = decode_ceiling(m)
    if ceiling is not None:
        ev += f"; the bandwidth ceiling is {ceiling:.1f} tok/s"
    return slow_decode_finding(
        m.kind, ev, {"decode_tok_s": rate},
        "--bandwidth or --device here; tandem plan --measure for this machine",
        m.quantization_level)


def decode_ceiling(m: Measurements) -> float | None:
    """Single-stream tokens/s if every step only read the weights at full bandwidth."""
    if not m.bandwidth_bytes_s or not m.model_bytes:
        return None
    return m.bandwidth_bytes_s / m.model_bytes


def _rule_ceiling(m: Measurements) -> Finding | None:
    ceiling = decode_ceiling(m)
    p = m.stream
    if ceiling is None or not _ok(p) or math.isnan(p.decode_tok_s):
        return None
    rate = p.decode_tok_s
    share = rate / ceiling
    ev = (
        f"{rate:.1f} tok/s measured vs {m.bandwidth_bytes_s / 1e9:,.0f} GB/s / "
        f"{gb(m.model_bytes)} ({m.model_bytes_source}) = {ceiling:.1f} tok/s: "
        f"{share:.0%} of the ceiling"
    )
    values = {"decode_tok_s": rate, "ceiling_tok_s": ceiling, "share": share}
    k = m.kind
    if share > CEILING_HIGH:
        return Finding(
            "ceiling_wrong", "warning", "decode",
            "Decode runs faster than the bandwidth ceiling allows: the ceiling's bytes or "
            "bandwidth are wrong",
            ev, ["check --model / --dtype are what the server holds (a quantized server reads "
                 "fewer bytes a token), and --bandwidth / --device this machine's",
                 "tandem plan --measure probes this machine's bandwidth"], values)
    if share < CEILING_LOW:
        knobs = [
            "check the whole model is in fast memory (no layers offloaded to CPU RAM, no swap)",
            "check the machine is not busy with something else (CPU threads, other GPU jobs)",
            f"keep the context short: {knob(k, 'context')}",
            "a small model on a fast device is overhead bound (framework, kernel launches): "
            "batching, not speed per stream, is what it has to give",
        ]
        return Finding(
            "below_ceiling", "warning", "decode",
            "Decode is far below what the memory bandwidth allows: the time goes elsewhere",
            ev, knobs, values,
        )
    return Finding(
        "at_ceiling", "ok", "decode",
        "Decode runs near the bandwidth ceiling: only fewer bytes per token make one stream "
        "faster",
        ev, [fewer_bytes(m.kind, m.quantization_level), "or a device with more memory bandwidth"],
        values,
    )


def _rule_stall(m: Measurements) -> Finding | None:
    a, b = m.pair_first, m.pair_second
    if not (_ok(a) and _ok(b)) or not _ok(m.stream):
        return None
    start, end = b.sent_s, b.sent_s + b.ttft_s
    times = a.token_times_s
    gaps = [t1 - t0 for t0, t1 in zip(times, times[1:]) if t1 > start and t0 < end]
    if not gaps:
        return None
    worst = max(gaps)
    usual = m.stream.itl_p50_s
    if math.isnan(usual) or worst < STALL_S or worst < STALL_FACTOR * usual:
        return None
    return stall_finding(
        m.kind, f"while a {b.prompt_tokens:,}-token prompt was prefilled, a running stream "
        f"waited {ms(worst)} for its next token (usually {ms(usual)})",
        {"stall_s": worst, "itl_p50_s": usual},
    )


def _rule_context(m: Measurements) -> Finding | None:
    if not (_ok(m.short) and _ok(m.long)):
        return None
    rs, rl = m.short.decode_tok_s, m.long.decode_tok_s
    if math.isnan(rs) or math.isnan(rl) or rl >= (1 - CONTEXT_DROP) * rs:
        return None
    return Finding(
        "long_context_decode", "warning", "decode",
        "Long context slows decode too: each step reads, and attends over, the KV cache of the "
        "whole context",
        f"decode {rs:.1f} tok/s after a {m.short.prompt_tokens:,}-token prompt, {rl:.1f} "
        f"tok/s after {m.long.prompt_tokens:,} ({(rl / rs - 1) * 100:+.0f}%)",
        [
            f"keep conversations short (summarize old turns): {knob(m.kind, 'context')}",
            f"an 8-bit KV cache halves those reads: {knob(m.kind, 'kv_8bit')}",
        ],
        {"decode_short_tok_s": rs, "decode_long_tok_s": rl},
    )


def _rule_offload(m: Measurements) -> Finding | None:
    if m.gpu_share is None or not 0 < m.gpu_share < 0.999:
        return None
    return Finding(
        "offloaded", "problem", "decode",
        "Part of the model is in CPU RAM: decode runs at the slower memory's speed",
        f"/api/ps: {m.gpu_share:.0%} of the loaded model is in GPU memory",
        [
            f"make room: {knob(m.kind, 'kv_memory')}",
            f"a smaller quantization: {knob(m.kind, 'quantize')}",
        ],
        {"gpu_share": m.gpu_share},
    )


def diagnose(m: Measurements) -> list[Finding]:
    """Every finding the measurements support, the most urgent first."""
    cache_hit = _cache_pressure(m)[0]
    queue = _rule_queue(m)
    one = _rule_one_at_a_time(m, cache_hit)
    return sort_findings([  # with the cache full, a wait is the cache's finding, not slots'
        _rule_rejected(m), one, None if cache_hit else queue, _rule_cache(m),
        _rule_cold_start(m),
        _rule_prefill(m), _rule_ttft_overhead(m, queued=queue is not None or one is not None),
        _rule_slow_decode(m), _rule_stall(m), _rule_offload(m), _rule_ceiling(m),
        _rule_context(m),
    ])
