"""A short request arriving while a long prompt prefills: its time to first token
against the same request's with no long prompt ahead of it.

A coding agent's large prompt and a chat user's short question share the
engine. One stream decodes throughout (as a chat reply would); a ``--long``
-token prompt is added, and ``--after`` steps later a ``--short``-token one.
Printed, each measured in this run, in process (``LLMEngine``, no server):

- the short request's TTFT behind the long prompt / its TTFT with none ahead;
- the long prompt's TTFT with the short one arriving / without it;
- the decoding stream's step time p50 and max while the prompts prefill.

    .venv/bin/python benchmarks/short_behind_long.py [--model M] [--shape 1b]
        [--type q4_0] [--long 3000] [--short 40] [--after 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import set_threads
from synthetic_gguf import synthetic_gguf

from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams


def run(engine: LLMEngine, long: int, short: int, after: int, seed: int) -> dict[str, float]:
    """One round: TTFTs (s) of whichever prompts it is given (0 tokens: none) and
    the decoding stream's step times while they prefill. Each round's prompts
    are new token ids, so the prefix cache holds none of them."""
    vocab = engine.model_config.vocab_size

    def ids(n: int, salt: int) -> list[int]:
        return [100 + (seed * 7919 + salt * 104729 + i * 31) % (vocab - 200) for i in range(n)]

    first = SamplingParams(max_tokens=1)
    stream = engine.add_request(ids(8, 0), SamplingParams(max_tokens=2000, ignore_eos=True))
    for _ in range(5):
        engine.step()
    start = time.perf_counter()
    long_req = engine.add_request(ids(long, 1), first) if long else None
    short_req, short_at, steps, out = None, 0.0, [], {}
    while True:
        if short and short_req is None and len(steps) >= (after if long else 0):
            short_req, short_at = engine.add_request(ids(short, 2), first), time.perf_counter()
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        now = time.perf_counter()
        if long_req is not None and "long" not in out and long_req.output_token_ids:
            out["long"] = now - start
        if short_req is not None and "short" not in out and short_req.output_token_ids:
            out["short"] = now - short_at
        if len(out) == bool(long) + bool(short):
            break
    engine.abort_request(stream.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    out["step_p50"], out["step_max"] = statistics.median(steps), max(steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the synthetic GGUF below")
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("--long", type=int, default=3000, help="the long prompt's tokens")
    ap.add_argument("--short", type=int, default=40, help="the short prompt's tokens")
    ap.add_argument("--after", type=int, default=10,
                    help="steps into the long prompt's prefill the short one arrives")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    model = a.model or str(synthetic_gguf(a.shape, a.type, log=lambda m: print(
        m, file=sys.stderr, flush=True)))
    engine = LLMEngine(model=model, kv_cache_memory=a.kv_cache_memory)
    run(engine, 0, a.short, 0, seed=0)  # warm-up
    alone = run(engine, 0, a.short, 0, seed=1)
    long_alone = run(engine, a.long, 0, a.after, seed=2)
    both = run(engine, a.long, a.short, a.after, seed=3)
    print(f"{model}: one stream decoding; a {a.long}-token prompt, and {a.after} steps into "
          f"its prefill a {a.short}-token one")
    print(f"short request TTFT: {both['short']:.2f} s behind the long prompt, "
          f"{alone['short']:.2f} s with none ahead = {both['short'] / alone['short']:.1f}x")
    print(f"long prompt TTFT: {both['long']:.1f} s with the short one arriving, "
          f"{long_alone['long']:.1f} s without = {both['long'] / long_alone['long']:.2f}x")
    print(f"decoding stream's step while the prompts prefill: p50 {both['step_p50'] * 1e3:.0f} "
          f"ms, max {both['step_max'] * 1e3:.0f} ms (long prompt alone: p50 "
          f"{long_alone['step_p50'] * 1e3:.0f}, max {long_alone['step_max'] * 1e3:.0f})")


if __name__ == "__main__":
    main()
