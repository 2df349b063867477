"""Long contexts: decode speed and pool capacity per KV cache dtype, against fp32's.

At long contexts a decode step reads more KV than weights (SmolLM2-135M: 46 KB of
fp32 K/V a token, so 16 streams x 2048 tokens read 1.5 GB of cache a step beside
its 135 MB of int8 weights), so the cache's bytes set the speed. For each
``--kv-cache-dtype`` (fp32, fp16, bf16, int8; CPU's auto is bf16 or fp16) the engine serves
``--streams`` requests of ``--context``-token random prompts; once every prompt is
prefilled, the decode steps that follow are timed (all streams decoding, one
token each). Printed: decode tok/s, its ratio to fp32's (measured in this run,
variants alternated ``--rounds`` times, best of each) and the tokens one GiB of
pool holds.

    .venv/bin/python benchmarks/kv_cache_dtypes.py [--model M] [--streams 16]
        [--context 2048] [--tokens 24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import time

from common import set_threads

from tandem.config import KV_CACHE_DTYPES
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams


def decode_rate(engine: LLMEngine, streams: int, context: int, tokens: int, seed: int) -> float:
    """Output tok/s of the steps after every prompt is prefilled."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [engine.add_request([rng.randrange(100, vocab) for _ in range(context)], params)
            for _ in range(streams)]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    done = sum(len(r.output_token_ids) for r in reqs)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (streams * tokens - done) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per stream")
    ap.add_argument("--tokens", type=int, default=24, help="output tokens per stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    # Room for every variant (pages are touched only as blocks fill): 512 KiB a token
    # covers an 8B model's fp32 K/V (256 KiB).
    pool = 2**30 + a.streams * (a.context + a.tokens) * 2**19
    engines = {}
    dtypes = [kv for kv in KV_CACHE_DTYPES if kv != "auto"]  # auto: one of them
    for kv in dtypes:
        kw = {"model": a.model} if a.model else {}
        engines[kv] = LLMEngine(kv_cache_dtype=kv, kv_cache_memory=pool,
                                max_model_len=a.context + a.tokens, num_threads=a.threads, **kw)
    best = dict.fromkeys(dtypes, 0.0)
    for r in range(a.rounds):
        for kv, engine in engines.items():
            best[kv] = max(best[kv], decode_rate(engine, a.streams, a.context, a.tokens, r))
    print(f"{a.streams} streams x {a.context}-token contexts, {a.tokens} output tokens each; "
          f"best of {a.rounds} alternated rounds")
    print(f"{'kv cache':9} {'KV B/token':>10} {'tokens/GiB':>10} {'decode tok/s':>13} "
          f"{'vs fp32':>8}")
    for kv, engine in engines.items():
        per_token = engine.kv_bytes_per_token
        print(f"{kv:9} {per_token:10d} {2**30 // per_token:10d} {best[kv]:13.1f} "
              f"{best[kv] / best['fp32']:8.2f}")


if __name__ == "__main__":
    main()
