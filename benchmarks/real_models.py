"""Real-size models from GGUF files: load time, memory, and serving tok/s against this
machine's bandwidth and compute ceilings, measured in the same run.

Workload: synthetic Llama GGUFs at real shapes (benchmarks/synthetic_gguf.py:
random weights, SmolLM2's tokenizer; cached), by default the 1.2B shape (24 layers,
2048 wide, FFN 5632: the model the targets below were set on) as F16, Q8_0, Q4_0 and
Q4_K_M files (``--shape 1b`` for the 1.66B one with an FFN of 8192, ``8b`` for the 8B,
``gemma3-1b`` for Gemma 3 1B's layers). Each file is served by
``tandem serve --model FILE --kv-cache-memory K`` (``--quantization X`` only when given)
and measured:

* load: process start until /health is 200 (includes any one-time GGUF conversion the
  engine does on a file's first load: run twice to see a warm load); peak RSS of the
  server during load (VmHWM at that moment) and its RSS just after;
* serving: ``tandem bench serve``, 128-token prompts, 128 output tokens (``--input-len``,
  ``--output-len``), ignore_eos, closed loop, at 1, 16 and 32 streams: tok/s, TTFT and
  ITL; the server's peak RSS during the run (VmHWM, reset after load through
  /proc/PID/clear_refs).

Baselines, measured in this run:

* bandwidth ceiling = tandem.tools.plan.devices.measure_read_bandwidth() / bytes read per
  token. Bytes read per token = the weights the server reports resident (/api/ps
  ``size``, the engine's model.nbytes; the server exposes no per-step figure) minus
  what a decode step does not stream: the token embedding (a row lookup) and the norm
  vectors, as the engine holds them (engine dtype for dense weights, fp16 embedding for
  quantized ones: see read_per_token; an unknown ``quantization_level`` falls back to
  the GGUF's tensor bytes excluding token_embd and norms). The GGUF figure is printed
  too, with its ceiling: what a step reads serving the file's own format. Plus the KV
  cache a decode step reads at the run's mean context (input + output / 2 tokens, at
  the bytes a token the server logs): ~2% of the 1.66B shape's bytes at 128 + 128 tokens,
  the larger part with a long ``--input-len``.
* compute ceiling = matmul throughput of this CPU (torch.mm at M=128 of a 2048x2048
  matrix: fp32, bf16, and int8 through torch._int_mm) / the matmul FLOP one output
  token of this workload costs: its decode step (2 x the matmul params, LM head
  included) plus its share of the prompt (input tokens per output tokens, at
  2 x the params but the LM head's, which a prompt token skips); 16/32-stream tok/s is
  printed as a ratio of the int8 and fp32 ceilings. Attention's FLOP (~1% at these
  lengths) are left out, so the ceiling is an upper bound.
* the bandwidth is probed again just before and just after each file's first
  serving point (the server idle), and their mean is that file's ceiling: this VM's
  read bandwidth moved between ~35 and ~65 GB/s from one minute to the next, and a
  ratio against a probe taken long before the run measures the drift, not the
  engine; two probes far apart say the run straddled a move, so that point is run
  again (``--probe-tries`` in all) until its two probes agree within 15%; the
  printed ceiling says how many runs that took, or that they never agreed.

The 1-stream ratio is printed twice: output tok/s over the whole run (which
includes each request's prefill) and decode alone (1000 / mean ITL), the
figure a bandwidth ceiling bounds; the target mark follows the decode one.

Targets: 1 stream >= 0.85 of the bandwidth ceiling; >= 200 tok/s at 16
streams with p99 ITL <= 400 ms (1.2B int8); peak RSS during load <= 1.3 x
(weights + KV pool), KV pool = the size the server logs at start-up (else --kv-cache-memory).

    .venv/bin/python benchmarks/real_models.py [--shape 1.2b] [--types f16 q8_0 q4_0 q4_k_m]
        [--quantization X] [--streams 1 16 32] [--prompts-per-stream 1] [--kv-cache-memory 2GiB]
        [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import httpx
import torch
from common import read_bandwidth_gbs
from cpu_serving import wait_ready
from synthetic_gguf import SHAPES, synthetic_gguf

from tandem.tools.plan.devices import matmul_rate

TANDEM = str(Path(sys.executable).parent / "tandem")
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
QUANT_LEVELS = frozenset({"INT8", "Q8_0", "Q4_0", "Q4_1"})  # tandem.model.linear.quantization_level
PROBE_AGREEMENT = 0.15  # probes further apart than this straddled a change of bandwidth
KV_LOG = re.compile(r"KV cache \([^)]*\): .*? (\d+) bytes/token \(([\d.]+) GiB\)")


# ------------------------------------------------------------------ this machine


# ------------------------------------------------------------------ the file


@dataclass
class FileInfo:
    path: Path
    size: int
    params: int  # all tensors
    matmul_params: int  # 2-D tensors but token_embd
    embed_elems: int  # token_embd: a row lookup, not streamed by a decode step
    lm_head_elems: int  # output.weight, or token_embd when the embeddings are tied
    norm_elems: int  # the 1-D norm vectors (negligible, but counted in /api/ps)
    file_read_per_token: int  # GGUF bytes of the matmul tensors


def file_info(path: Path) -> FileInfo:
    r = gguf.GGUFReader(str(path))
    params = matmul = embed = norms = read = output = 0
    for t in r.tensors:
        n = int(t.n_elements)
        params += n
        if t.name == "output.weight":
            output = n
        if t.name == "token_embd.weight":
            embed += n
        elif len(t.shape) == 1:
            norms += n
        else:
            matmul += n
            read += int(t.n_bytes)
    return FileInfo(path, path.stat().st_size, params, matmul, embed, output or embed, norms,
                    read)


def flop_per_output_token(i: FileInfo, input_len: int, output_len: int) -> float:
    """Matmul FLOP per output token of input_len-token prompts and output_len-token replies."""
    body = i.matmul_params - (0 if i.lm_head_elems == i.embed_elems else i.lm_head_elems)
    return 2 * ((body + i.lm_head_elems) * output_len + body * input_len) / output_len


# ------------------------------------------------------------------ the server


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of pid in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def run_point(url: str, streams: int, num_prompts: int, outdir: Path,
              a: argparse.Namespace) -> dict:
    name = f"c{streams}.json"
    subprocess.run(
        [TANDEM, "bench", "serve", "--base-url", url, "--dataset-name", "random",
         "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--ignore-eos",
         "--num-prompts", str(num_prompts), "--max-concurrency", str(streams),
         "--num-warmups", "1", "--disable-tqdm", "--no-plots", "--save-result",
         "--result-dir", str(outdir), "--result-filename", name],
        check=True, stdout=subprocess.DEVNULL,
    )
    return json.loads((outdir / name).read_text())


@dataclass
class Result:
    label: str
    info: FileInfo
    error: str | None = None
    load_s: float = 0.0
    load_peak: int = 0
    after_load: int = 0
    run_peak: int = 0
    run_peak_reset: bool = True
    served: int = 0
    level: str = ""
    read_per_token: int = 0  # weights a decode step streams
    kv_per_token: int = 0  # bytes of KV cache per token of context (the server's log)
    kv_read: int = 0  # KV bytes a decode step reads at the run's mean context
    read_source: str = ""
    kv_pool: int = 0
    kv_source: str = ""
    # Read bandwidth (bytes/s) probed just before and just after the first serving
    # point (the single stream's, by default), the server idle; their mean is the
    # ceiling (0: not probed).
    bw_probes: tuple[float, float] = (0.0, 0.0)
    probe_runs: int = 0  # runs of the first point it took for its probes to agree
    points: dict[int, dict] = field(default_factory=dict)

    @property
    def probes_agree(self) -> bool:
        lo, hi = sorted(self.bw_probes)
        return hi > 0 and lo >= (1 - PROBE_AGREEMENT) * hi

    @property
    def bw(self) -> float:
        return sum(self.bw_probes) / 2


def measure(label: str, path: Path, a: argparse.Namespace, port: int) -> Result:
    info = file_info(path)
    res = Result(label, info)
    url = f"http://127.0.0.1:{port}"
    cmd = [TANDEM, "serve", "--model", str(path), "--port", str(port),
           "--kv-cache-memory", a.kv_cache_memory, "--max-num-seqs", "64", "--max-queue", "64",
           "--no-access-log"]
    if a.quantization is not None:
        cmd += ["--quantization", a.quantization]
    if a.threads is not None:
        cmd += ["--num-threads", str(a.threads)]
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "server.log"
        with open(log, "wb") as logf:
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc, a.load_timeout)
            res.load_s = time.monotonic() - t0
            st = proc_status(proc.pid)
            res.load_peak, res.after_load = st["VmHWM"], st["VmRSS"]
            res.run_peak_reset = reset_peak(proc.pid)
            ps = httpx.get(url + "/api/ps", timeout=10).json()["models"][0]
            res.served, res.level = int(ps["size"]), ps["details"]["quantization_level"]
            res.read_per_token, res.read_source = read_per_token(res.served, res.level, info)
            m = KV_LOG.search(log.read_text(errors="replace"))
            if m:
                res.kv_per_token = int(m.group(1))
                res.kv_read = res.kv_per_token * (a.input_len + a.output_len // 2)
                res.kv_pool, res.kv_source = int(float(m.group(2)) * 2**30), "server log"
            else:
                res.kv_pool, res.kv_source = parse_size(a.kv_cache_memory), "--kv-cache-memory"
            for i, c in enumerate(a.streams):
                def run(c: int = c) -> dict:
                    return run_point(url, c, max(2, c * a.prompts_per_stream), Path(d), a)
                res.points[c] = run_probed(run, res, a.probe_tries) if i == 0 else run()
                res.run_peak = proc_status(proc.pid)["VmHWM"]
        except (RuntimeError, subprocess.CalledProcessError, httpx.HTTPError, KeyError) as e:
            res.error = str(e).splitlines()[0] if isinstance(e, RuntimeError) else repr(e)
            code = proc.poll()
            if code is not None:  # the server died: say how, and show its last words
                how = " (SIGKILL: out of memory?)" if code == -9 else ""
                tail = "\n      ".join(log.read_text(errors="replace").splitlines()[-8:])
                res.error += f"\n   server exited with {code}{how}; its log ends:\n      {tail}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return res


def run_probed(run: Callable[[], dict], res: Result, tries: int) -> dict:
    """run() between two bandwidth probes (res.bw_probes), again until they agree or
    it has run `tries` times: a run whose probes disagree straddled a change of state."""
    for _ in range(tries):
        before = read_bandwidth_gbs() * 1e9
        point = run()
        res.bw_probes = (before, read_bandwidth_gbs() * 1e9)
        res.probe_runs += 1
        if res.probes_agree:
            break
    return point


def read_per_token(served: int, level: str, info: FileInfo) -> tuple[int, str]:
    """Bytes a decode step streams: the server's resident weights (/api/ps size, the
    engine's model.nbytes) minus the token embedding and the norms as the engine holds
    them: at the engine dtype (level) for dense weights, in fp16 for quantized ones (the
    loader keeps a quantized model's embedding in fp16 for the row lookup, its norms in
    fp32; a model is quantized when its level is a quantized one or it holds fewer bytes
    than its matmul params at the engine dtype). Without a level we know, the GGUF's
    matmul tensor bytes."""
    if level in QUANT_LEVELS:
        return (served - info.embed_elems * 2 - info.norm_elems * 4,
                f"/api/ps size less fp16 embedding and norms: {level}")
    dense_bytes = DTYPE_BYTES.get(level)
    if dense_bytes is None:
        return info.file_read_per_token, "GGUF tensors"
    quantized = served < info.matmul_params * dense_bytes
    embed_bytes = min(2, dense_bytes) if quantized else dense_bytes
    kind = "quantized, fp16 embedding" if quantized else f"dense {level}"
    return (served - info.embed_elems * embed_bytes - info.norm_elems * dense_bytes,
            f"/api/ps size less embedding and norms: {kind}")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", text, re.I)
    if not m:
        raise ValueError(f"bad size {text!r}")
    unit = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** unit)


# ------------------------------------------------------------------ report


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def print_result(r: Result, bw: float, flops: dict[str, float | None],
                 a: argparse.Namespace) -> None:
    i = r.info
    print(f"\n== {r.label}: {i.path.name}, {gb(i.size)}, {i.params / 1e9:.2f} B params "
          f"({i.matmul_params / 1e9:.2f} B in matmuls)", flush=True)
    if r.error:
        print(f"   FAILED: {r.error}", flush=True)
        if not r.served:
            return
    wkv = r.served + r.kv_pool
    print(f"   load            {r.load_s:7.1f} s to /health 200")
    print(f"   weights         {gb(r.served)} resident (/api/ps, {r.level}); read per token "
          f"{gb(r.read_per_token)} ({r.read_source}); GGUF tensors {gb(i.file_read_per_token)}")
    kv = (f"; a decode step reads {gb(r.kv_read)} of it at the mean context "
          f"({a.input_len} + {a.output_len} / 2 tokens, {r.kv_per_token} bytes a token)"
          if r.kv_per_token else "")
    print(f"   KV pool         {gb(r.kv_pool)} ({r.kv_source}){kv}")
    run_what = "since load" if r.run_peak_reset else "whole life: clear_refs failed"
    run = (f"{gb(r.run_peak)} ({run_what}) = {r.run_peak / wkv:.2f} x" if r.run_peak
           else "n/a")
    print(f"   RSS             peak during load {gb(r.load_peak)} = {r.load_peak / wkv:.2f} x "
          f"(weights + KV pool); after load {gb(r.after_load)}; peak during run {run}")
    agreed = (f"agreeing in run {r.probe_runs}" if r.probes_agree
              else f"apart in all {r.probe_runs} runs: a mix of two states")
    probes = (f" (mean of {r.bw_probes[0] / 1e9:.1f} before and {r.bw_probes[1] / 1e9:.1f} "
              f"after the {next(iter(r.points))}-stream run, {agreed})" if r.bw
              else " (at start)")
    bw = r.bw or bw
    ceiling = bw / (r.read_per_token + r.kv_read)
    file_ceiling = bw / (i.file_read_per_token + r.kv_read)
    per_token = flop_per_output_token(i, a.input_len, a.output_len)
    compute = {k: v / per_token for k, v in flops.items() if v}
    print(f"   ceilings        bandwidth {ceiling:.1f} tok/s at {bw / 1e9:.1f} GB/s{probes} "
          f"(GGUF bytes: {file_ceiling:.1f}); compute for {a.input_len} + {a.output_len} tokens "
          "a request: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in compute.items()))
    print(f"   {'streams':>7} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} (ms) "
          f"{'vs bw':>6} {'vs GGUF bw':>10} {'vs int8':>8} {'vs fp32':>8} {'time':>6}")
    for c, p in r.points.items():
        tps = p["output_throughput"]
        comp = "".join(
            f" {tps / compute[k]:8.2f}" if k in compute else f" {'-':>8}" for k in ("int8", "fp32")
        ) if c > 1 else f" {'':8} {'':8}"
        fail = f"  ({p['failed']} failed)" if p.get("failed") else ""
        print(f"   {c:7d} {tps:7.1f} {p['median_ttft_ms']:9.0f} {p['median_itl_ms']:8.0f} "
              f"{p['p99_itl_ms']:8.0f}      {tps / ceiling:6.2f} {tps / file_ceiling:10.2f}"
              f"{comp} {p['duration']:5.0f}s{fail}", flush=True)
    one = r.points.get(1)
    if one and one.get("mean_itl_ms"):
        dec = 1000 / one["mean_itl_ms"]
        print(f"   1-stream decode {dec:.1f} tok/s (1000 / mean ITL: tok/s above also counts the "
              f"prefill) = {dec / ceiling:.2f} of the bandwidth ceiling", flush=True)


def print_targets(results: list[Result], bw: float, int8_flops: float | None,
                  a: argparse.Namespace) -> None:
    print("\ntargets: 1 stream >= 0.85 of the bandwidth ceiling; >= 200 tok/s at 16 "
          "streams with p99 ITL <= 400 ms (1.2B int8); peak RSS during load <= 1.3 x "
          "(weights + KV pool)")
    print(f"{'model':14} {'1 stream: all / decode':>22} {'16 streams tok/s, p99 ITL':>26} "
          f"{'load RSS ratio':>15}  int8 compute bound")

    def mark(ok: bool) -> str:
        return "ok" if ok else "MISS"

    for r in results:
        if not r.served:
            print(f"{r.label:14} {'failed':>22}")
            continue
        rbw = r.bw or bw
        one = r.points.get(1)
        s1 = "-"
        if one:
            read = r.read_per_token + r.kv_read
            overall = one["output_throughput"] * read / rbw
            s1 = f"{overall:.2f} {mark(overall >= 0.85):4}"
            if one.get("mean_itl_ms"):
                decode = 1000 / one["mean_itl_ms"] * read / rbw
                s1 = f"{overall:.2f} / {decode:.2f} {mark(decode >= 0.85):4}"
        p16 = r.points.get(16)
        s16 = (f"{p16['output_throughput']:.0f}, {p16['p99_itl_ms']:.0f} ms "
               f"{mark(p16['output_throughput'] >= 200 and p16['p99_itl_ms'] <= 400):4}"
               if p16 else "-")
        ratio = r.load_peak / (r.served + r.kv_pool)
        per_token = flop_per_output_token(r.info, a.input_len, a.output_len)
        bound = (f"  {int8_flops / per_token:.0f} tok/s" if int8_flops
                 else "")
        print(f"{r.label:14} {s1:>22} {s16:>26} {f'{ratio:.2f} {mark(ratio <= 1.3):4}':>15}"
              + bound + ("  (run failed)" if r.error else ""))
    if int8_flops:
        print(f"int8 compute bound: this CPU's int8 matmul rate ({int8_flops / 1e9:.0f} GFLOP/s, "
              "torch._int_mm) over a request's matmul FLOP per output token; no batch size "
              "serves more output tok/s than it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=["1.2b"], choices=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_0", "q4_k_m"])
    ap.add_argument("--quantization", default=None,
                    help="passed to tandem serve as --quantization (default: not passed)")
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16, 32])
    ap.add_argument("--prompts-per-stream", type=int, default=1,
                    help="requests per stream at each point (at least 2 in all)")
    ap.add_argument("--input-len", type=int, default=128,
                    help="prompt tokens a request (long ones: the KV read joins the ceiling)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens a request")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for the probes and tandem serve --num-threads "
                         "(default: torch's default in both)")
    ap.add_argument("--probe-tries", type=int, default=3,
                    help="runs of the first point at most, until the bandwidth probes before "
                         f"and after it agree within {PROBE_AGREEMENT:.0%}%")
    ap.add_argument("--load-timeout", type=float, default=1800.0)
    ap.add_argument("--port", type=int, default=8824)
    a = ap.parse_args()
    if a.probe_tries < 1:
        ap.error("--probe-tries must be at least 1")
    if a.threads is not None:
        torch.set_num_threads(a.threads)

    files = []
    for shape in a.shape:
        for t in a.types:
            t0 = time.perf_counter()
            path = synthetic_gguf(shape, t, log=lambda m: print(m, file=sys.stderr, flush=True))
            files.append((f"{shape} {t}", path, time.perf_counter() - t0))
    bw = read_bandwidth_gbs() * 1e9
    flops = {k: matmul_rate(k) for k in ("fp32", "bf16", "int8")}
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.get_num_threads()} threads; read "
          f"bandwidth {bw / 1e9:.1f} GB/s; matmul M=128 2048x2048: "
          + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" if v else f"{k} n/a"
                      for k, v in flops.items()))
    for label, path, secs in files:
        print(f"file {label}: {path} ({'reused' if secs < 1 else f'written in {secs:.0f} s'})")
    quant = a.quantization if a.quantization is not None else "(not passed)"
    print(f"tandem serve --quantization {quant}, --kv-cache-memory {a.kv_cache_memory}; "
          f"bench: {a.input_len} in / {a.output_len} out, ignore_eos, closed loop, "
          f"{a.prompts_per_stream} prompts per stream", flush=True)

    results = []
    for label, path, _ in files:
        r = measure(label, path, a, a.port)
        print_result(r, bw, flops, a)
        results.append(r)
    print_targets(results, bw, flops["int8"], a)


if __name__ == "__main__":
    main()
