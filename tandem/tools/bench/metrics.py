"""The benchmark's numbers, defined exactly as vLLM's ``calculate_metrics`` defines them.

Per successful request (failed ones only count as ``failed``):

* TTFT and E2EL as measured (see ``client``); ITLs pooled over all requests;
* TPOT = (E2EL - TTFT) / (output tokens - 1), for requests with > 1 token;
* goodput: requests per second meeting *every* SLO given with ``--goodput``
  (``ttft``/``tpot``/``e2el`` in ms, each ``value <= SLO``; a one-token
  request's TPOT counts as 0, as in vLLM);
* throughputs divide by the whole run's duration;
* peak output tok/s: the busiest one-second bucket of token arrivals (TTFT
  then each ITL from each request's start); peak concurrency: the most
  requests in flight at once (half-open [start, start + E2EL) intervals).

Aggregates are numpy's mean / median / std (population) / linear-interpolated
percentiles, reported in ms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem.tools.bench.client import RequestResult

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    # metric -> {"mean": ms, "median": ms, "std": ms, "p99": ms, ...}
    stats: dict[str, dict[str, float]] = field(default_factory=dict)


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: cannot read {text!r} (e.g. 50,95,99)") from None
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles must be numbers in [0, 100], got {text!r}")
    return ps


def parse_percentile_metrics(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics: unknown {bad or text!r}; choose from "
                         f"{','.join(PERCENTILE_METRICS)}")
    return names


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or name not in GOODPUT_METRICS or not ms >= 0:
            raise ValueError(f"--goodput {pair!r}: expected KEY:MS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)} and MS >= 0 (e.g. ttft:500)")
        slos[name] = ms
    return slos


def summarize(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean / median / std / percentiles of seconds, in ms (zeros when empty, like vLLM)."""
    arr = np.asarray(values or [0.0], dtype=float) * 1000.0
    out = {"mean": float(np.mean(arr)), "median": float(np.median(arr)),
           "std": float(np.std(arr))}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(arr, p))
    return out


def token_times(r: RequestResult) -> np.ndarray:
    """Arrival time of each token chunk of ``r`` (perf_counter seconds)."""
    return r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])


def output_tokens_per_second(results: list[RequestResult], origin: float) -> np.ndarray:
    """Token chunks arriving in each whole second after ``origin`` (successful requests)."""
    ok = [r for r in results if r.success]
    if not ok:
        return np.zeros(0)
    end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(int(np.ceil(end - origin)) + 1)
    for r in ok:
        idx = np.floor(token_times(r) - origin).astype(int)
        idx = idx[(idx >= 0) & (idx < len(buckets))]
        np.add.at(buckets, idx, 1)
    return buckets


def peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in results if r.success]
                    + [(r.start_time + r.latency, -1) for r in results if r.success])
    current = peak = 0
    for _, delta in events:  # at equal times -1 sorts first: [start, end) intervals
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                      goodput: dict[str, float]) -> tuple[BenchmarkMetrics, list[int]]:
    """vLLM's aggregate metrics, and each request's output length (0 for failures)."""
    if duration <= 0:
        raise ValueError("the run's duration must be positive")
    ok = [r for r in results if r.success]
    output_lens = [r.output_tokens if r.success else 0 for r in results]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [x for r in ok for x in r.itl]
    all_tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
                 for r in ok]
    tpots = [t for r, t in zip(ok, all_tpots) if r.output_tokens > 1]
    good = 0
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            if all(per_metric[m][i] <= slo / 1000.0 for m, slo in goodput.items()):
                good += 1
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    origin = min((r.start_time for r in ok), default=0.0)
    per_second = output_tokens_per_second(results, origin)
    m = BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), total_input=total_input,
        total_output=total_output, request_throughput=len(ok) / duration,
        request_goodput=good / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=float(per_second.max()) if len(per_second) else 0.0,
        max_concurrent_requests=peak_concurrency(results),
    )
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.stats[name] = summarize(values, percentiles)
    return m, output_lens


def in_flight_timeline(results: list[RequestResult], origin: float
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Step function of requests in flight (sent, not yet finished), every request counted."""
    events = sorted([(r.start_time - origin, 1) for r in results]
                    + [(max(r.end_time, r.start_time) - origin, -1) for r in results])
    if not events:
        return np.zeros(0), np.zeros(0)
    t = np.array([e[0] for e in events])
    n = np.cumsum([e[1] for e in events])
    return t, n
