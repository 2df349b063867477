"""Synthetic doctor measurements, shared by the rules' tests (tests/unit/test_diagnosis.py)
and the report's (tests/plan/test_doctor.py): a healthy batching server, and the pieces
that change it."""

from __future__ import annotations

import dataclasses

from tandem.diagnosis.measurements import Measurements, MetricsSample, Probe


def probe(name: str, prompt: int, out: int, ttft: float, itl: float = 0.05,
          sent: float = 0.0, **kw) -> Probe:
    """A successful request with evenly spaced tokens."""
    return Probe(name, prompt_tokens=prompt, output_tokens=out, sent_s=sent, ttft_s=ttft,
                 e2e_s=ttft + itl * (out - 1), itl_s=[itl] * (out - 1), **kw)


def healthy(**changes) -> Measurements:
    """A batching server with room to spare: 20 tok/s, TTFT 0.1 -> 0.4 s, no queue.

    The pair: a 48-token stream from t=0 (tokens 0.10 .. 2.45 s) and a 1,024-token
    prompt sent at 0.25 s that gets its first token at 0.70 s, while the stream runs.
    """
    m = Measurements(
        "http://127.0.0.1:1", "tandem", "m",
        warmup=probe("first request", 8, 2, 0.08),
        short=probe("short", 64, 16, 0.10),
        long=probe("long", 1024, 16, 0.40),
        stream=probe("stream", 64, 48, 0.10),
        pair_first=probe("pair first", 64, 48, 0.10),
        pair_second=probe("pair second", 1024, 4, 0.45, sent=0.25),
        metrics_before=MetricsSample(0, 0, 0.0, 0),
        metrics_after=MetricsSample(0, 0, 0.01, 0),
        metrics_peak=MetricsSample(1, 2, 0.05, 0),
        pair_metrics_peak=MetricsSample(0, 2, 0.05, 0),
    )
    return dataclasses.replace(m, **changes)


def serialized_pair(**kw) -> dict:
    """The second request's first token comes after the first's last (2.45 s) + its 0.4 s."""
    return {"pair_second": probe("pair second", 1024, 4, 2.45 - 0.25 + 0.40, sent=0.25, **kw)}
