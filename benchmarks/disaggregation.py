"""Prefill/decode disaggregation vs colocated replicas on the same cores.

Workload: ``--streams`` decode streams (short prompt, ``--stream-tokens``
tokens each, restarted as they finish) run for ``--duration`` seconds while a
long prompt (``--prompt-tokens``, ~2,000, each one distinct so no prefix cache
helps) arrives every ``--interval`` seconds and asks for 8 tokens. Two
set-ups on one local Ray instance, one after the other, with the same CPUs:

* colocated: ``--replicas 2`` (each replica prefills and decodes; the router
  spreads the streams and the long prompts over both);
* P/D: ``--prefill-replicas 1 --decode-replicas 1`` (the streams decode on one
  replica while the long prompts are prefilled on the other; their KV then
  moves through Ray's object store).

Reported: the streams' inter-token latency (p50, p99: what a long prompt's
prefill does to everyone else's typing speed), the long prompts' TTFT (the
first token: in P/D it comes from the prefill replica, before the transfer)
and their time to the second token (in P/D: TTFT + the KV transfer + the
decode replica's first step, the cost a client sees of moving the KV), and the
transfer's own time and bytes. The ratio line is P/D over colocated.

    .venv/bin/python benchmarks/disaggregation.py [--duration 40] [--streams 4]
        [--interval 6] [--prompt-tokens 2000] [--num-cpus-per-replica 1]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

from tandem.config import EngineConfig
from tandem.distributed.client import RayEngineClient
from tandem.distributed.config import ReplicaSpec
from tandem.sampling_params import SamplingParams

FILLER = ("The committee reviewed the quarterly figures, noted the changes in "
          "shipping costs, and asked each department for a short written summary. ")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def workload(client: RayEngineClient, a: argparse.Namespace) -> dict:
    tok = client.tokenizer
    filler = tok.encode(FILLER)
    itl: list[float] = []
    long_runs: list[dict] = []
    deadline = time.monotonic() + a.duration
    stream_params = SamplingParams(temperature=0, max_tokens=a.stream_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def stream(k: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            ids = tok.encode(f"Stream {k}, story {n}: once upon a time")
            last = None
            async for out in client.generate(ids, stream_params):
                if last is not None:
                    itl.append(out.time - last)
                last = out.time
            n += 1

    async def long_prompt(k: int) -> None:
        ids = tok.encode(f"Report {k}.") + (filler * (a.prompt_tokens // len(filler) + 1))
        ids = ids[:a.prompt_tokens]
        t0 = time.monotonic()
        times, final = [], None
        async for out in client.generate(ids, long_params):
            times.append(out.time - t0)
            final = out
        m = final.metrics
        long_runs.append({"ttft": times[0], "second": times[1], "transfer": m.kv_transfer_s,
                          "bytes": m.kv_transfer_bytes})

    async def arrivals() -> None:
        tasks, k = [], 0
        await asyncio.sleep(a.interval / 2)
        while time.monotonic() < deadline:
            tasks.append(asyncio.create_task(long_prompt(k)))
            k += 1
            await asyncio.sleep(a.interval)
        await asyncio.gather(*tasks)

    await asyncio.gather(arrivals(), *(stream(k) for k in range(a.streams)))
    transfers = [r["transfer"] for r in long_runs if r["transfer"] is not None]
    return {
        "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99), "tokens": len(itl),
        "ttft": statistics.median(r["ttft"] for r in long_runs),
        "second": statistics.median(r["second"] for r in long_runs),
        "transfer": statistics.median(transfers) if transfers else None,
        "bytes": statistics.median(r["bytes"] for r in long_runs), "long": len(long_runs),
    }


def run(spec: ReplicaSpec, a: argparse.Namespace) -> dict:
    config = EngineConfig(kv_cache_memory=a.kv_cache_memory)
    client = RayEngineClient(config, spec)
    try:
        warm = SamplingParams(temperature=0, max_tokens=4)

        async def warm_up() -> None:  # every replica's first steps, before the clock runs
            for _ in range(2 * len(client.names)):
                async for _ in client.generate("Hello there", warm):
                    pass

        asyncio.run(warm_up())
        return asyncio.run(workload(client, a))
    finally:
        client.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=6.0)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--ray-address", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    common = dict(num_cpus=a.num_cpus_per_replica, ray_address=a.ray_address)
    results = {
        "colocated 2": run(ReplicaSpec(replicas=2, **common), a),
        "P/D 1+1": run(ReplicaSpec(prefill_replicas=1, decode_replicas=1, **common), a),
    }
    print(f"{a.streams} decode streams of {a.stream_tokens} tokens for {a.duration:.0f} s; a "
          f"{a.prompt_tokens}-token prompt every {a.interval:g} s; "
          f"{a.num_cpus_per_replica:g} CPU per replica")
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
