"""Aggregate output tok/s through the HTTP server at 1, 4, 16 and 32 streams.

The workload: 128-token prompts, 128 output tokens, ignore_eos, closed
loop (each stream sends its next request when the last one finished), driven by
`tandem bench serve` against `tandem serve` on this machine, for fp32 and int8
weights. Baseline: llama.cpp's llama-server on the same machine class with the
same model at Q4_1 and 16 slots, measured at 46 / 58 / 64 / 64 tok/s for 1 / 4 /
16 / 32 streams with p99 ITL ~210 ms (measured once on that machine class;
llama.cpp is not installable here to re-measure in the same run). Target at 16 and 32 streams:
>= 130 tok/s (2x llama-server) with p99 ITL <= 210 ms.

    .venv/bin/python benchmarks/cpu_serving.py [--quantization none int8] [--prompts-per-stream 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from common import TANDEM, wait_ready

LLAMA_SERVER = {1: 46.0, 4: 58.0, 16: 64.0, 32: 64.0}


def run_point(url: str, streams: int, per_stream: int, outdir: Path) -> dict:
    name = f"c{streams}.json"
    subprocess.run(
        [TANDEM, "bench", "serve", "--base-url", url, "--dataset-name", "random",
         "--input-len", "128", "--output-len", "128", "--ignore-eos",
         "--num-prompts", str(streams * per_stream), "--max-concurrency", str(streams),
         "--num-warmups", "1", "--disable-tqdm", "--no-plots", "--save-result",
         "--result-dir", str(outdir), "--result-filename", name],
        check=True, stdout=subprocess.DEVNULL,
    )
    return json.loads((outdir / name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", nargs="+", default=["none", "int8"])
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--prompts-per-stream", type=int, default=3)
    ap.add_argument("--port", type=int, default=8823)
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    print(f"{'weights':8} {'streams':>7} {'tok/s':>7} {'vs llama-server':>15} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
    for quant in a.quantization:
        proc = subprocess.Popen(
            [TANDEM, "serve", "--port", str(a.port), "--quantization", quant,
             "--max-num-seqs", "64", "--max-queue", "64", "--no-access-log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_ready(url, proc)
            with tempfile.TemporaryDirectory() as d:
                for c in a.streams:
                    r = run_point(url, c, a.prompts_per_stream, Path(d))
                    tps = r["output_throughput"]
                    print(f"{quant:8} {c:7d} {tps:7.1f} {tps / LLAMA_SERVER.get(c, 64.0):14.2f}x "
                          f"{r['median_ttft_ms']:9.0f} {r['p99_ttft_ms']:9.0f} "
                          f"{r['median_itl_ms']:8.0f} {r['p99_itl_ms']:8.0f}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print("target at 16 and 32 streams: >= 130 tok/s with p99 ITL <= 210 ms")


if __name__ == "__main__":
    main()
