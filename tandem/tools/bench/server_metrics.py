"""The server's own view of the run, from ``/metrics`` with vLLM's names.

The client measures what users feel; the server's counters say why: its own
TTFT and ITL (without the network and HTTP stack), preemptions (the KV pool
ran out), prefix-cache hits, how full the KV cache got and how many requests
waited. Counters and histograms are scraped before and after the run and
differenced; gauges (KV usage, running, waiting) are polled during it for
their peaks. Works unchanged against vLLM (and anything else exposing its
names); a target without them (Ollama, llama-server) just has no server
section.

Histogram percentiles are estimated from bucket counts the way Prometheus's
``histogram_quantile`` does (linear within a bucket), so they are only as
fine as the buckets. The server counts every client: traffic from others
during the run lands in these numbers too.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field

import httpx

from tandem.tools.bench.metrics import percentile_key

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# (ours/vLLM V1 name, older vLLM name) for each quantity.
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
E2E = ("vllm:e2e_request_latency_seconds",)
QUEUE = ("vllm:request_queue_time_seconds",)
PREFILL = ("vllm:request_prefill_time_seconds",)
DECODE = ("vllm:request_decode_time_seconds",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
REJECTIONS = ("tandem:queue_rejections_total",)


@dataclass
class Snapshot:
    """One scrape: series name -> [(labels, value)]."""

    series: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    t: float = 0.0

    @classmethod
    def parse(cls, text: str, t: float = 0.0) -> Snapshot:
        snap = cls(t=t)
        for line in text.splitlines():
            m = _LINE.match(line)
            if not m or line.startswith("#"):
                continue
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            labels = dict(_LABEL.findall(m.group(2) or ""))
            snap.series.setdefault(m.group(1), []).append((labels, value))
        return snap

    @property
    def has_vllm_names(self) -> bool:
        return any(name.startswith("vllm:") for name in self.series)

    def value(self, names: tuple[str, ...]) -> float | None:
        """Sum over every label set of the first of ``names`` present."""
        for name in names:
            if name in self.series:
                return sum(v for _, v in self.series[name])
        return None

    def histogram(self, names: tuple[str, ...]) -> Histogram | None:
        for name in names:
            if f"{name}_count" not in self.series:
                continue
            buckets: dict[float, float] = {}
            for labels, v in self.series.get(f"{name}_bucket", []):
                le = float(labels.get("le", "inf").replace("+Inf", "inf"))
                buckets[le] = buckets.get(le, 0.0) + v
            return Histogram(sorted(buckets.items()), self.value((f"{name}_sum",)) or 0.0,
                             self.value((f"{name}_count",)) or 0.0)
        return None


@dataclass
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), sorted
    sum: float
    count: float

    def minus(self, before: Histogram | None) -> Histogram:
        if before is None:
            return self
        prev = dict(before.buckets)
        return Histogram([(le, c - prev.get(le, 0.0)) for le, c in self.buckets],
                         self.sum - before.sum, self.count - before.count)

    def quantile(self, q: float) -> float:
        """Prometheus's ``histogram_quantile``: linear interpolation inside the bucket."""
        if self.count <= 0 or not self.buckets:
            return math.nan
        rank = q * self.buckets[-1][1]
        lower, below = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):  # past the last finite bound: report that bound
                    return lower
                inside = cum - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 0.0)
            lower, below = le, cum
        return lower


async def scrape(client: httpx.AsyncClient, base_url: str) -> Snapshot | None:
    """/metrics now, or None when the target has no vLLM-named metrics."""
    try:
        r = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    snap = Snapshot.parse(r.text, time.perf_counter())
    return snap if snap.has_vllm_names else None


class MetricsWatcher:
    """Scrape before, poll gauges every ``interval`` s during, scrape after; then summarize."""

    def __init__(self, base_url: str, headers: dict[str, str], interval: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.interval = interval
        self.client = httpx.AsyncClient(headers=headers, timeout=10.0)
        self.before: Snapshot | None = None
        self.polls: list[Snapshot] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> bool:
        self.before = await scrape(self.client, self.base_url)
        if self.before is not None and self.interval > 0:
            self._task = asyncio.create_task(self._poll())
        return self.before is not None

    async def _poll(self) -> None:
        while True:
            snap = await scrape(self.client, self.base_url)
            if snap is not None:
                self.polls.append(snap)
            await asyncio.sleep(self.interval)

    async def stop(self, origin: float, percentiles: list[float]) -> dict | None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        after = await scrape(self.client, self.base_url) if self.before is not None else None
        await self.client.aclose()
        if self.before is None or after is None:
            return None
        return summarize(self.before, after, self.polls + [after], origin, percentiles)


def _delta(after: Snapshot, before: Snapshot, names: tuple[str, ...]) -> float | None:
    a = after.value(names)
    return None if a is None else a - (before.value(names) or 0.0)


def summarize(before: Snapshot, after: Snapshot, polls: list[Snapshot], origin: float,
              percentiles: list[float]) -> dict:
    """The server section of the report (ms for times, 0..1 for ratios; None if absent)."""
    out: dict = {"source": "/metrics"}
    for key, names in (("ttft", TTFT), ("itl", ITL), ("e2el", E2E), ("queue_time", QUEUE),
                       ("prefill_time", PREFILL), ("decode_time", DECODE)):
        h_after = after.histogram(names)
        if h_after is None:
            continue
        h = h_after.minus(before.histogram(names))
        out[f"mean_{key}_ms"] = h.sum / h.count * 1000 if h.count > 0 else None
        if key in ("ttft", "itl"):
            out[f"num_{key}_observations"] = int(h.count)
            for p in percentiles:
                v = h.quantile(p / 100)
                out[f"{percentile_key(p)}_{key}_ms"] = None if math.isnan(v) else v * 1000
    for key, names in (("num_preemptions", PREEMPTIONS), ("prefix_cache_queries", PREFIX_QUERIES),
                       ("prefix_cache_hits", PREFIX_HITS), ("prompt_tokens", PROMPT_TOKENS),
                       ("generation_tokens", GENERATION_TOKENS),
                       ("queue_rejections", REJECTIONS)):
        d = _delta(after, before, names)
        out[key] = None if d is None else int(round(d))
    queries, hits = out.get("prefix_cache_queries"), out.get("prefix_cache_hits")
    out["prefix_cache_hit_rate"] = hits / queries if queries and hits is not None else None
    timeline: dict[str, list[float]] = {"t": [p.t - origin for p in polls]}
    for key, names in (("kv_cache_usage", KV_USAGE), ("running", RUNNING),
                       ("waiting", WAITING)):
        values = [p.value(names) for p in polls]
        if any(v is not None for v in values):
            timeline[key] = values  # None where a scrape lacked it (JSON has no NaN)
            peak = max(v for v in values if v is not None)
            out[f"peak_{key}" if key == "kv_cache_usage" else f"peak_num_requests_{key}"] = peak
    out["timeline"] = timeline
    return out
