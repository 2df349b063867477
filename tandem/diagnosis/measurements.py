"""What the doctor's probes measured: the only input of its rules.

``tandem.tools.doctor.probe`` fills these from a live server; the rules
(``probe_rules.diagnose``) read nothing else, so each is tested on synthetic
measurements.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.diagnosis.thresholds import TTFT_TARGET_S


def _percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    k = (len(ys) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)



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
