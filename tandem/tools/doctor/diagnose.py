"""``tandem doctor``: what is slow on a running server, and which knob to turn first.

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

This module is the analysis only: ``diagnose(Measurements)`` is a pure
function of numbers (collected by ``tandem.tools.doctor.probe``), so every
rule is tested on synthetic measurements, and every finding carries the
number that triggered it. The thresholds, each finding's wording and knobs, and
the verdict are in ``tandem.diagnosis``, which the server's live dashboard
applies to its own figures.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.diagnosis import (
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
    TTFT_TARGET_S,
    Finding,
    budget_wait_finding,
    cache_finding,
    fewer_bytes,
    knob,
    ms,
    prefill_finding,
    queue_finding,
    rejected_finding,
    slow_decode_finding,
    sort_findings,
    stall_finding,
    verdict,
)

KINDS = ("tandem", "vllm", "llama-server", "ollama", "openai")
KIND_NAMES = {
    "tandem": "tandem", "vllm": "vLLM", "llama-server": "llama-server", "ollama": "Ollama",
    "openai": "an OpenAI-compatible server",
}


# --------------------------------------------------------------------- inputs
@dataclass
class Probe:
    """One request, timed by the client and (where the server reports it) by the server.

    Times are seconds from when the request was sent; ``sent_s`` places the
    request on the probe's own clock (the overlapping pair shares one).
    """

    name: str
    ok: bool = True
    error: str = ""
    prompt_tokens: int = 0  # as the server counted them when it says, else as sent
    output_tokens: int = 0
    sent_s: float = 0.0
    ttft_s: float = math.nan
    e2e_s: float = math.nan  # sent -> last token
    itl_s: list[float] = field(default_factory=list)
    # The server's own phase split (tandem's ``tandem`` object, Ollama's counters).
    server_queue_s: float | None = None
    server_prefill_s: float | None = None
    server_decode_s: float | None = None
    computed_prompt_tokens: int | None = None  # prompt tokens prefilled (not cached)
    cached_tokens: int | None = None
    preemptions: int | None = None
    load_s: float | None = None  # Ollama's load_duration: loading the model for this request

    @property
    def token_times_s(self) -> list[float]:
        """When each token arrived, on the probe's clock."""
        if not self.ok or math.isnan(self.ttft_s):
            return []
        out = [self.sent_s + self.ttft_s]
        for gap in self.itl_s:
            out.append(out[-1] + gap)
        return out

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first; the server's own decode time when it gave one."""
        gaps = self.output_tokens - 1
        if gaps < 1:
            return math.nan
        if self.server_decode_s:
            return gaps / self.server_decode_s
        span = self.e2e_s - self.ttft_s
        return gaps / span if span > 0 else math.nan

    @property
    def prefill_tok_s(self) -> float:
        """The server's prefill rate (prompt tokens computed / prefill time), if it says."""
        n = self.computed_prompt_tokens
        if n is None or not self.server_prefill_s:
            return math.nan
        return n / self.server_prefill_s

    @property
    def itl_p50_s(self) -> float:
        return statistics.median(self.itl_s) if self.itl_s else math.nan

    @property
    def itl_p99_s(self) -> float:
        return _percentile(self.itl_s, 99) if self.itl_s else math.nan


@dataclass
class MetricsSample:
    """The server's gauges and counters (vLLM's names) at one moment, or peaks over a span."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    preemptions: float | None = None  # cumulative counter


@dataclass
class Measurements:
    """Everything the probes collected; the only input of ``diagnose``."""

    url: str
    kind: str
    model: str
    detected_from: list[str] = field(default_factory=list)
    max_model_len: int | None = None
    warmup: Probe | None = None
    short: Probe | None = None
    long: Probe | None = None
    stream: Probe | None = None
    pair_first: Probe | None = None  # a streaming request ...
    pair_second: Probe | None = None  # ... and a long prompt sent while it streams
    metrics_before: MetricsSample | None = None  # before any probe: other users' load
    metrics_after: MetricsSample | None = None
    metrics_peak: MetricsSample | None = None  # peaks over every probe
    pair_metrics_peak: MetricsSample | None = None  # peaks while the pair ran
    model_bytes: float | None = None  # bytes a decode step reads (about: the weights)
    model_bytes_source: str = ""
    quantization_level: str | None = None  # as the server names it (F32, Q4_K_M, ...)
    bandwidth_bytes_s: float | None = None
    bandwidth_source: str = ""
    gpu_share: float | None = None  # Ollama /api/ps: size_vram / size (None: not reported)
    slots: int | None = None  # llama-server's /props total_slots, tandem's max_num_seqs
    ttft_target_s: float = TTFT_TARGET_S
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- rules
def _ok(p: Probe | None) -> bool:
    return p is not None and p.ok and not math.isnan(p.ttft_s)


def _size(n: float) -> str:
    """Bytes as GB (1e9, as bandwidths are quoted), or MB below one GB."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    k = (len(ys) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


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
        f"{_size(m.model_bytes)} ({m.model_bytes_source}) = {ceiling:.1f} tok/s: "
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


# --------------------------------------------------------------------- report
def _fmt(x: float | None, unit: str = "", digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.{digits}f}{unit}"


def _probe_line(p: Probe) -> str:
    if not p.ok:
        return f"failed: {p.error}"
    s = f"{p.prompt_tokens:,} prompt tokens: TTFT {ms(p.ttft_s)}"
    split = []
    if p.server_queue_s is not None:
        split.append(f"queue {ms(p.server_queue_s)}")
    if p.server_prefill_s is not None:
        rate = p.prefill_tok_s
        split.append(f"prefill {ms(p.server_prefill_s)}"
                     + (f" = {rate:,.0f} tok/s" if not math.isnan(rate) else ""))
    if p.cached_tokens:
        split.append(f"{p.cached_tokens} cached")
    if split:
        s += " (server: " + ", ".join(split) + ")"
    if p.output_tokens > 1:
        s += f"; {p.output_tokens} tokens at {_fmt(p.decode_tok_s, ' tok/s', 1)}"
    return s


def _fill(text: str, width: int, first: str, rest: str) -> str:
    """Wrap without splitting flags like --max-num-batched-tokens at their hyphens."""
    return textwrap.fill(text, width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False)


def format_report(m: Measurements, findings: list[Finding]) -> str:
    width = 100
    out = [f"tandem doctor: {m.url} is {KIND_NAMES.get(m.kind, m.kind)}, model {m.model}"
           + (f", context {m.max_model_len:,}" if m.max_model_len else "")]
    if m.detected_from:
        out.append(_fill(f"(detected from {', '.join(m.detected_from)})", width, "  ", "   "))
    out += ["", "Measurements"]

    def line(label: str, text: str) -> None:
        body = textwrap.wrap(text, width - 22, break_on_hyphens=False) or [""]
        out.append(f"  {label:<20}{body[0]}")
        out.extend(" " * 22 + b for b in body[1:])

    if m.warmup is not None:
        line("first request", _probe_line(m.warmup))
    if m.short is not None:
        line("short prompt", _probe_line(m.short))
    if m.long is not None:
        line("long prompt", _probe_line(m.long))
    rate, how = prefill_rate(m)
    if not math.isnan(rate):
        line("prefill rate", f"{rate:,.0f} tok/s ({how})")
    if m.stream is not None:
        s = m.stream
        line("decode, 1 stream", f"failed: {s.error}" if not s.ok else
             f"{s.output_tokens} tokens at {_fmt(s.decode_tok_s, ' tok/s', 1)}; ITL p50 "
             f"{ms(s.itl_p50_s)}, p99 {ms(s.itl_p99_s)}")
    a, b = m.pair_first, m.pair_second
    if a is not None and b is not None:
        if not (a.ok and b.ok):
            line("two at once", f"failed: {a.error or b.error}")
        else:
            ov = pair_overlap(m)
            assert ov is not None
            overlap, extra, _ = ov
            line("two at once",
                 f"a {b.prompt_tokens:,}-token prompt sent {b.sent_s:.2f} s into a stream got "
                 f"its first token after {b.ttft_s:.2f} s ({extra:+.2f} s vs alone); the two "
                 + (f"streamed together for {overlap:.2f} s" if overlap > 0 else
                    "never streamed at the same time"))
    if m.metrics_before is not None:
        bf, af, pk = m.metrics_before, m.metrics_after or MetricsSample(), m.metrics_peak
        pk = pk or MetricsSample()
        pre = (
            f", preemptions {_fmt((af.preemptions or 0) - (bf.preemptions or 0), '', 0)} "
            "during the probes" if bf.preemptions is not None else ""
        )
        line("/metrics",
             f"before: {_fmt(bf.running)} running, {_fmt(bf.waiting)} waiting, KV "
             f"{_fmt(None if bf.kv_usage is None else bf.kv_usage * 100, '%', 1)}; during: peak "
             f"{_fmt(pk.running)} running, {_fmt(pk.waiting)} waiting, KV "
             f"{_fmt(None if pk.kv_usage is None else pk.kv_usage * 100, '%', 1)}{pre}")
    ceiling = decode_ceiling(m)
    if ceiling is not None:
        line("decode ceiling",
             f"{m.bandwidth_bytes_s / 1e9:,.0f} GB/s ({m.bandwidth_source}) / "
             f"{_size(m.model_bytes)} ({m.model_bytes_source}) = {ceiling:,.1f} tok/s")
    elif m.model_bytes:
        line("decode ceiling",
             f"model {_size(m.model_bytes)} ({m.model_bytes_source}); give --bandwidth "
             "or --device to compare decode with bandwidth / bytes")
    for n in m.notes:
        line("note", n)

    out += ["", "Findings"]
    marks = {"problem": "!", "warning": "~", "ok": "+"}
    if not findings:
        out.append("  + nothing out of line: the probes found no queue, no cache pressure, "
                   "and TTFT and decode within their targets")
    for f in findings:
        out.append(_fill(f"{marks[f.severity]} [{f.phase}] {f.title}", width, "  ", "      "))
        out.append(_fill(f"because: {f.evidence}", width, "      ", "        "))
        for i, k in enumerate(f.knobs):
            label = "turn first:" if i == 0 else "then:"
            out.append(_fill(f"{label} {k}", width, "      ", "        "))
    out += ["", _fill("Verdict: " + verdict(findings), width, "", "")]
    return "\n".join(out)
