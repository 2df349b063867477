"""What watching costs: the 16-stream load with 3 /dashboard viewers open vs none.

Each viewer is a client of GET /dashboard/events, as a browser tab or `tandem top`
is: it reads and parses every frame (one a second, with the request table, which
the engine thread snapshots between steps while anyone watches). The load is the
one of cpu_serving.py at 16 streams: 128-token prompts, 128 output tokens,
ignore_eos, closed loop, driven by `tandem bench serve`. Rounds run on one
server in the order none, viewers, viewers, none, none, viewers, ... so that a
steady drift of a shared machine's speed falls on both sides alike; the spread
of the baseline rounds is printed as the noise the ratio has to be read
against. The claim: viewers cost nothing beyond that.

    .venv/bin/python benchmarks/dashboard_overhead.py [--pairs 2] [--prompts-per-stream 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path

import httpx
from cpu_serving import TANDEM, run_point, wait_ready

STREAMS = 16
VIEWERS = 3


class Viewer:
    """One /dashboard/events client in a thread, parsing every frame."""

    def __init__(self, url: str) -> None:
        self.frames = 0
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()
        if not self._first.wait(60):
            raise RuntimeError("no dashboard frame within 60 s")

    def _read(self, url: str) -> None:
        with httpx.stream("GET", f"{url}/dashboard/events", timeout=60) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data: "):
                    json.loads(line[6:])
                    self.frames += 1
                    self._first.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def run_round(url: str, viewers: int, per_stream: int, outdir: Path) -> tuple[dict, int]:
    """The load's result and the frames the viewers read meanwhile."""
    open_ = [Viewer(url) for _ in range(viewers)]
    try:
        result = run_point(url, STREAMS, per_stream, outdir)
    finally:
        for v in open_:
            v.close()
    return result, sum(v.frames for v in open_)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2,
                    help="round pairs, one with viewers and one without (2)")
    ap.add_argument("--prompts-per-stream", type=int, default=2)
    ap.add_argument("--port", type=int, default=8824)
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    proc = subprocess.Popen(
        [TANDEM, "serve", "--port", str(a.port), "--max-num-seqs", "64", "--max-queue", "64",
         "--no-access-log", "--dashboard-max-viewers", str(VIEWERS)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows: dict[int, list[dict]] = {0: [], VIEWERS: []}
    print(f"{'viewers':>7} {'tok/s':>7} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p50':>9} "
          f"{'frames read':>11}  (ms)")
    try:
        wait_ready(url, proc)
        with tempfile.TemporaryDirectory() as d:
            for i in range(a.pairs):
                for viewers in (0, VIEWERS) if i % 2 == 0 else (VIEWERS, 0):
                    r, frames = run_round(url, viewers, a.prompts_per_stream, Path(d))
                    rows[viewers].append(r)
                    print(f"{viewers:7d} {r['output_throughput']:7.1f} {r['median_itl_ms']:8.1f} "
                          f"{r['p99_itl_ms']:8.1f} {r['median_ttft_ms']:9.0f} {frames:11d}",
                          flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    def mean(n: int, key: str) -> float:
        return statistics.fmean(r[key] for r in rows[n])

    print(f"\n{VIEWERS} viewers / none, mean of {a.pairs} rounds each: "
          f"output tok/s {mean(VIEWERS, 'output_throughput') / mean(0, 'output_throughput'):.3f}x, "
          f"ITL p50 {mean(VIEWERS, 'median_itl_ms') / mean(0, 'median_itl_ms'):.3f}x, "
          f"ITL p99 {mean(VIEWERS, 'p99_itl_ms') / mean(0, 'p99_itl_ms'):.3f}x")
    if a.pairs > 1:
        spans = []
        for n in (0, VIEWERS):
            tps = [r["output_throughput"] for r in rows[n]]
            spans.append(f"{min(tps) / max(tps):.3f}x with {n} viewers")
        print(f"noise: lowest / highest tok/s of the rounds alike: {', '.join(spans)}; "
              "a ratio within that spread is no measurable cost")


if __name__ == "__main__":
    main()
