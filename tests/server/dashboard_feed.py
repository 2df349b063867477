"""Helpers for the dashboard tests: a /dashboard/events reader and /metrics quantiles."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.entrypoints.server.dashboard import LATENCIES, histogram_quantile


class Feed:
    """/dashboard/events read in a thread: every event, parsed, as it arrives."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.events: list[tuple[str, dict]] = []
        self.raw = bytearray()
        self._stop = threading.Event()
        self._opened = threading.Event()
        self.status: int | None = None
        self._thread = threading.Thread(target=self._read, args=(url, headers or {}),
                                        daemon=True)
        self._thread.start()
        assert self._opened.wait(30), "the feed did not answer"

    def _read(self, url: str, headers: dict[str, str]) -> None:
        with httpx.stream("GET", f"{url}/dashboard/events", headers=headers, timeout=30) as r:
            self.status = r.status_code
            self._opened.set()
            if r.status_code != 200:
                return
            name = "message"
            for line in r.iter_lines():
                self.raw += line.encode() + b"\n"
                if self._stop.is_set():
                    return
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    self.events.append((name, json.loads(line[6:])))
                    name = "message"

    @property
    def frames(self) -> list[dict]:
        return [data for name, data in self.events if name == "message"]

    def wait(self, check: Callable[[dict], bool], timeout: float = 60.0) -> dict:
        """The first frame (from now on) for which check holds."""
        start = len(self.frames)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for f in self.frames[start:]:
                if check(f):
                    return f
            time.sleep(0.05)
        raise AssertionError(f"no frame within {timeout} s; last: {self.frames[-1:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def scrape(url: str) -> dict[str, dict]:
    """/metrics as {family name: {"samples": [(name, labels, value)]}}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f.name: {"samples": [(s.name, s.labels, s.value) for s in f.samples]}
            for f in text_string_to_metric_families(text)}


def total(metrics: dict, family: str) -> float:
    """A counter family's value, summed over its label sets."""
    return sum(v for name, _, v in metrics[family]["samples"] if name.endswith("_total"))


def quantiles(metrics: dict, key: str) -> dict[str, float | None]:
    """p50/p95/p99 of one latency histogram over everything it observed, as
    Prometheus' histogram_quantile would compute them from /metrics."""
    rows = [(float(labels["le"]), v) for name, labels, v in metrics[LATENCIES[key]]["samples"]
            if name.endswith("_bucket")]
    bounds, counts = [b for b, _ in rows], [c for _, c in rows]
    return {"p50": histogram_quantile(0.5, bounds, counts),
            "p95": histogram_quantile(0.95, bounds, counts),
            "p99": histogram_quantile(0.99, bounds, counts), "count": int(counts[-1])}
