"""The doctor's rules over a running server's own figures, for its dashboard.

What the server's counters can tell: a queue (and, knowing the slots in use,
whether it waits for slots or for the token budget), a full KV cache,
refusals, a slow first token, slow or stuttering decode. A rule that needs
a probe from outside (one request at a time, the bandwidth ceiling, a cold
start) stays with ``probe_rules``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.diagnosis.findings import (
    Finding,
    budget_wait_finding,
    cache_finding,
    ms,
    prefill_finding,
    queue_finding,
    rejected_finding,
    slow_decode_finding,
    sort_findings,
    stall_finding,
)
from tandem.diagnosis.thresholds import (
    KV_FULL,
    QUEUE_S,
    READABLE_TOK_S,
    STALL_FACTOR,
    STALL_S,
    TTFT_TARGET_S,
)


@dataclass
class LiveFigures:
    """A running server's figures over a recent window, from its own counters.

    Latencies are quantiles of the window's histogram observations, each the
    lower bound of the bucket it falls in: a value the quantile is known to
    reach (None when nothing was observed); counts are what the window added.
    """

    window_s: float
    waiting: int
    peak_running: int  # the most requests running at once in the window
    max_num_seqs: int | None  # the server's sequence slots (None: not known)
    oldest_wait_s: float  # the longest wait of a request not yet started (0: none waits)
    kv_usage: float  # 0..1, now
    preemptions: int
    rejections: int
    prefill_tokens: int  # prompt tokens computed in the window
    queue_p95_s: float | None = None
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    ttft_target_s: float | None = None  # the server's --slo-ttft-ms; None: TTFT_TARGET_S
    itl_target_s: float | None = None  # --slo-itl-ms; None: reading speed, 1 / READABLE_TOK_S
    quantization_level: str | None = None  # the weights' format, as /api/tags names it


def diagnose_live(f: LiveFigures, kind: str = "tandem") -> list[Finding]:
    """The doctor's rules over live figures: every finding they support, most urgent first."""
    w = f"over the last {f.window_s:g} s"
    ttft_target = f.ttft_target_s or TTFT_TARGET_S
    itl_target = f.itl_target_s or 1 / READABLE_TOK_S
    found: list[Finding | None] = []
    if f.rejections:
        found.append(rejected_finding(
            kind, f"{f.rejections} requests were refused with 503 {w}"))
    queue_s = f.queue_p95_s or 0.0
    wait = max(queue_s, f.oldest_wait_s)
    cache_full = bool(f.preemptions) or f.kv_usage >= KV_FULL
    # A wait the first token absorbs within its target is no problem, though the
    # verdict used to call the first token slow.
    within_target = (f.ttft_p95_s is not None and f.ttft_p95_s < ttft_target
                     and f.oldest_wait_s < ttft_target)
    # a full cache's wait is the cache's finding
    if wait >= QUEUE_S and not cache_full and not within_target:
        ev = f"requests wait {wait:.1f} s before they start ({f.waiting} waiting now"
        ev += f"; queue time p95 at least {ms(queue_s)} {w})" if queue_s else ")"
        values = {"wait_s": wait, "waiting": f.waiting, "peak_running": f.peak_running}
        if f.max_num_seqs is not None and f.peak_running < f.max_num_seqs:
            found.append(budget_wait_finding(
                kind, f"{ev}, with at most {f.peak_running} of {f.max_num_seqs} sequence slots "
                "in use", values))
        else:
            found.append(queue_finding(kind, ev, values))
    parts = [f"requests wait {wait:.1f} s to start"] if wait >= QUEUE_S and cache_full else []
    if f.preemptions:
        parts.append(f"{f.preemptions} preemptions {w}")
    if f.kv_usage >= KV_FULL:
        parts.append(f"KV cache usage is {f.kv_usage:.0%}")
    if parts:
        found.append(cache_finding(kind, "; ".join(parts),
                                   {"preemptions": f.preemptions, "kv_usage": f.kv_usage}))
    if f.ttft_p95_s is not None and f.ttft_p95_s >= ttft_target and wait < QUEUE_S:
        found.append(prefill_finding(
            kind, "TTFT is over its target while requests barely queue",
            f"TTFT p95 at least {ms(f.ttft_p95_s)} {w} (target {ms(ttft_target)}) while "
            "requests barely queue: the time is prefill",
            {"ttft_p95_s": f.ttft_p95_s, "queue_p95_s": queue_s}))
    if f.itl_p50_s is not None and f.itl_p50_s >= itl_target:
        found.append(slow_decode_finding(
            kind, f"inter-token latency p50 at least {ms(f.itl_p50_s)} {w}, over the "
            f"{ms(itl_target)} target: at most {1 / f.itl_p50_s:.1f} tok/s per stream",
            {"itl_p50_s": f.itl_p50_s}, "tandem doctor --device or --bandwidth",
            f.quantization_level))
    elif (f.itl_p50_s is not None and f.itl_p99_s is not None and f.prefill_tokens
          and f.itl_p99_s >= STALL_S and f.itl_p99_s >= STALL_FACTOR * f.itl_p50_s):
        found.append(stall_finding(
            kind, f"inter-token latency p99 at least {ms(f.itl_p99_s)} against a p50 of "
            f"{ms(f.itl_p50_s)} {w}, while {f.prefill_tokens:,} prompt tokens were prefilled",
            {"itl_p99_s": f.itl_p99_s, "itl_p50_s": f.itl_p50_s}))
    return sort_findings(found)
