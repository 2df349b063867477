"""Prefill/decode disaggregation vs colocated replicas on the same cores.

Workload: ``--streams`` decode streams (short prompt, ``--stream-tokens``
tokens each, restarted as they finish) run for ``--duration`` seconds while a
long prompt (``--prompt-tokens``, ~2,000, each one distinct so no prefix cache
helps) arrives every ``--interval`` seconds and asks for 8 tokens. Two
set-ups, each ``tandem serve`` started as a user starts it (a subprocess with
its own local Ray) and driven over HTTP (streamed /v1/completions, token ids
as prompts), one after the other, with the same CPUs:

* colocated: ``--replicas 2`` (each replica prefills and decodes; the router
  spreads the streams and the long prompts over both);
* P/D: ``--prefill-replicas 1 --decode-replicas 1`` (the streams decode on one
  replica while the long prompts are prefilled on the other; their KV then
  moves through Ray's object store).

Reported: the streams' inter-token latency (p50, p99: what a long prompt's
prefill does to everyone else's typing speed), the long prompts' TTFT (the
first token: in P/D it comes from the prefill replica, before the transfer)
and their time to the second token (in P/D: TTFT + the KV transfer + the
decode replica's first step, the cost a client sees of moving the KV), all as
the client's chunks arrive, and the transfer's own time and bytes. The ratio line
is P/D over colocated.

    .venv/bin/python benchmarks/disaggregation.py [--duration 40] [--streams 4]
        [--interval 6] [--prompt-tokens 2000] [--num-cpus-per-replica 1]
        [--serve-args "--quantization none"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import tempfile
import time

import httpx
from common import TANDEM, wait_ready

from tandem.model.loader import resolve_model
from tandem.tokenizer import Tokenizer

FILLER = ("The committee reviewed the quarterly figures, noted the changes in "
          "shipping costs, and asked each department for a short written summary. ")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def completion(http: httpx.AsyncClient, ids: list[int], max_tokens: int
                     ) -> tuple[list[float], dict]:
    """One streamed completion: each text chunk's arrival (monotonic) and the
    request's timings (the last chunk's ``tandem`` field)."""
    times: list[float] = []
    timing: dict = {}
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.monotonic())
            timing = chunk.get("tandem", timing)
    return times, timing


async def workload(url: str, tok: Tokenizer, a: argparse.Namespace) -> dict:
    filler = tok.encode(FILLER)
    itl: list[float] = []
    long_runs: list[dict] = []
    deadline = time.monotonic() + a.duration
    http = httpx.AsyncClient(base_url=url, timeout=600)

    async def stream(k: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            times, _ = await completion(
                http, tok.encode(f"Stream {k}, story {n}: once upon a time"), a.stream_tokens)
            itl.extend(b - a for a, b in zip(times, times[1:]))
            n += 1

    async def long_prompt(k: int) -> None:
        ids = tok.encode(f"Report {k}.") + (filler * (a.prompt_tokens // len(filler) + 1))
        t0 = time.monotonic()
        times, timing = await completion(http, ids[:a.prompt_tokens], 8)
        long_runs.append({"ttft": times[0] - t0, "second": times[1] - t0,
                          "transfer": timing.get("kv_transfer_s"),
                          "bytes": timing.get("kv_transfer_bytes", 0)})

    async def arrivals() -> None:
        tasks, k = [], 0
        await asyncio.sleep(a.interval / 2)
        while time.monotonic() < deadline:
            tasks.append(asyncio.create_task(long_prompt(k)))
            k += 1
            await asyncio.sleep(a.interval)
        await asyncio.gather(*tasks)

    async with http:
        for _ in range(4):  # every replica's first steps, before the clock runs
            await completion(http, tok.encode("Hello there"), 4)
        deadline = time.monotonic() + a.duration
        await asyncio.gather(arrivals(), *(stream(k) for k in range(a.streams)))
    transfers = [r["transfer"] for r in long_runs if r["transfer"] is not None]
    return {
        "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99), "tokens": len(itl),
        "ttft": statistics.median(r["ttft"] for r in long_runs),
        "second": statistics.median(r["second"] for r in long_runs),
        "transfer": statistics.median(transfers) if transfers else None,
        "bytes": statistics.median(r["bytes"] for r in long_runs), "long": len(long_runs),
    }


def run(replica_flags: list[str], tok: Tokenizer, a: argparse.Namespace) -> dict:
    """``tandem serve`` with these replicas, driven over HTTP, then stopped."""
    url = f"http://127.0.0.1:{a.port}"
    cmd = [TANDEM, "serve", "--port", str(a.port), "--no-access-log",
           "--kv-cache-memory", a.kv_cache_memory,
           "--num-cpus-per-replica", str(a.num_cpus_per_replica), *replica_flags,
           *shlex.split(a.serve_args)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_ready(url, proc, timeout=600)
            return asyncio.run(workload(url, tok, a))
        except BaseException:
            log.seek(0)
            print(log.read()[-3000:])
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=6.0)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--port", type=int, default=8824)
    ap.add_argument("--serve-args", default="", help="more `tandem serve` flags")
    a = ap.parse_args()
    tok = Tokenizer.from_dir(resolve_model(None, "auto").dir)
    results = {
        "colocated 2": run(["--replicas", "2"], tok, a),
        "P/D 1+1": run(["--prefill-replicas", "1", "--decode-replicas", "1"], tok, a),
    }
    print(f"{a.streams} decode streams of {a.stream_tokens} tokens for {a.duration:.0f} s; a "
          f"{a.prompt_tokens}-token prompt every {a.interval:g} s; "
          f"{a.num_cpus_per_replica:g} CPU per replica; tandem serve {a.serve_args}")
    print(f"{'':12} {'ITL p50':>8} {'ITL p99':>8} {'TTFT':>7} {'2nd tok':>8} {'transfer':>9} "
          f"{'MB':>6} {'tokens':>7} {'long':>5}  (ms; TTFT, 2nd token: medians)")
    for name, r in results.items():
        transfer = "-" if r["transfer"] is None else f"{r['transfer'] * 1e3:.0f}"
        print(f"{name:12} {r['itl_p50'] * 1e3:8.0f} {r['itl_p99'] * 1e3:8.0f} "
              f"{r['ttft'] * 1e3:7.0f} {r['second'] * 1e3:8.0f} {transfer:>9} "
              f"{r['bytes'] / 1e6:6.1f} {r['tokens']:7d} {r['long']:5d}")
    c, p = results["colocated 2"], results["P/D 1+1"]
    print(f"ratio P/D / colocated: ITL p99 {p['itl_p99'] / c['itl_p99']:.2f}x, "
          f"ITL p50 {p['itl_p50'] / c['itl_p50']:.2f}x, TTFT {p['ttft'] / c['ttft']:.2f}x, "
          f"time to 2nd token {p['second'] / c['second']:.2f}x, "
          f"stream tokens {p['tokens'] / c['tokens']:.2f}x")


if __name__ == "__main__":
    main()
