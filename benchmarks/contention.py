"""Server throughput on a shared CPU: 16 streams alone, then beside a CPU-bound neighbour.

The same closed-loop load as cpu_serving.py (128-token prompts, 128 output
tokens, ignore_eos) through `tandem serve`, first on a quiet machine, then
while another process spins on one core (pinned there, as a noisy neighbour
on a VPS is). Printed: aggregate tok/s and p99 inter-token latency of both
runs and their ratios. With half the cores taken, proportional would be 0.5x;
the target is >= 0.4x tok/s with p99 ITL within 3x of quiet. The server's
thread-count moves (tandem.worker.thread_tuner) are printed from its log.

    .venv/bin/python benchmarks/contention.py [--prompts-per-stream 3] [--serve-args "--threads 2"]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_serving import TANDEM, run_point, wait_ready

STREAMS = 16
SPIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def measure(url: str, per_stream: int, outdir: Path) -> dict:
    outdir.mkdir()
    return run_point(url, STREAMS, per_stream, outdir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts-per-stream", type=int, default=3)
    ap.add_argument("--port", type=int, default=8824)
    ap.add_argument("--serve-args", default="", help="extra `tandem serve` flags")
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    core = cpus[-1]
    url = f"http://127.0.0.1:{a.port}"
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "serve.log"
        with log.open("w") as out:
            server = subprocess.Popen(
                [TANDEM, "serve", "--port", str(a.port), "--max-num-seqs", "64",
                 "--max-queue", "64", "--no-access-log", *shlex.split(a.serve_args)],
                stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, server)
            quiet = measure(url, a.prompts_per_stream, Path(d) / "quiet")
            neighbour = subprocess.Popen([sys.executable, "-c", SPIN, str(core)])
            try:
                time.sleep(1.0)
                busy = measure(url, a.prompts_per_stream, Path(d) / "busy")
            finally:
                neighbour.kill()
                neighbour.wait()
        finally:
            server.terminate()
            server.wait(timeout=30)
        moves = [line.split(": ", 1)[-1] for line in log.read_text().splitlines()
                 if "CPU threads" in line and " -> " in line]
    print(f"{len(cpus)} CPUs {cpus}; neighbour: one process spinning on CPU {core}; "
          f"{STREAMS} streams x {a.prompts_per_stream} requests of 128+128 tokens")
    print(f"{'':10} {'tok/s':>7} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p99':>9}  (ms)")
    for name, r in (("quiet", quiet), ("neighbour", busy)):
        print(f"{name:10} {r['output_throughput']:7.1f} {r['median_itl_ms']:8.0f} "
              f"{r['p99_itl_ms']:8.0f} {r['p99_ttft_ms']:9.0f}")
    tps = busy["output_throughput"] / quiet["output_throughput"]
    itl = busy["p99_itl_ms"] / quiet["p99_itl_ms"]
    print(f"ratio: tok/s {tps:.2f}x of quiet (target >= 0.4x), p99 ITL {itl:.2f}x of quiet "
          f"(target <= 3x)")
    for move in moves:
        print(f"server: {move}")


if __name__ == "__main__":
    main()
