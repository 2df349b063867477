"""Sliding-window KV cache groups: the pool a long request takes, and decode speed,
against every layer holding the whole context (--disable-hybrid-kv-cache-manager).

Gemma 3 1B has 4 full-attention layers and 22 that see their last 512 keys.
With KV cache groups a request holds the windowed layers' blocks of its window
only. On the synthetic Gemma 3 1B GGUF (benchmarks/synthetic_gguf.py) and one
``--kv-cache-memory``, each variant (groups on, then off) prints the
``max_model_len`` its pool allows, then serves ``--streams`` requests of
``--context`` random prompt tokens and ``--tokens`` output tokens: the pool's
peak usage while they run, and the decode tok/s of the steps after every
prompt is prefilled (the best of ``--rounds``, the variants alternated).
Ratios are groups / off, measured in this run.

    .venv/bin/python benchmarks/sliding_window_kv.py [--model M] [--type q8_0]
        [--streams 4] [--context 2048] [--tokens 64] [--kv-cache-memory 256MiB]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from common import set_threads
from synthetic_gguf import synthetic_gguf

from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams


def serve(engine: LLMEngine, streams: int, context: int, tokens: int) -> tuple[float, float]:
    """(peak pool usage, decode tok/s once every prompt is prefilled)."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [engine.add_request([rng.randrange(100, vocab) for _ in range(context)], params)
            for _ in range(streams)]
    peak = 0.0
    while any(not r.output_token_ids for r in reqs):
        engine.step()
        peak = max(peak, engine.kv_manager.usage)
    done = sum(len(r.output_token_ids) for r in reqs)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv_manager.usage)
    return peak, (streams * tokens - done) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the synthetic Gemma 3 1B GGUF")
    ap.add_argument("--type", default="q8_0", help="the synthetic GGUF's type")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per stream")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    model = a.model or str(synthetic_gguf("gemma3-1b", a.type, log=lambda m: print(
        m, file=sys.stderr, flush=True)))
    engines = {label: LLMEngine(model=model, kv_cache_memory=a.kv_cache_memory,
                                disable_hybrid_kv_cache_manager=off)
               for label, off in (("groups", False), ("off", True))}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(a.rounds):  # alternated: this machine's memory speed drifts
        for label, engine in engines.items():
            peak, rate = serve(engine, a.streams, a.context, a.tokens)
            best[label] = (peak, max(rate, best.get(label, (0, 0))[1]))
    for label, engine in engines.items():
        g, (peak, rate) = engine.kv_groups, best[label]
        held = g.blocks_for(a.context + a.tokens, engine.config.block_size,
                            engine.max_num_batched_tokens)
        print(f"{label:>6}: {len(g.windows)} KV cache group(s) of {g.group_size} layers, "
              f"windows {g.windows}; max_model_len {engine.max_model_len:,}; a "
              f"{a.context + a.tokens}-token request holds at most {held} of "
              f"{engine.kv_manager.num_blocks} blocks; {a.streams} streams: peak pool usage "
              f"{peak:.1%}, decode {rate:.1f} tok/s (best of {a.rounds})")
    (peak_g, rate_g), (peak_o, rate_o) = best["groups"], best["off"]
    len_g, len_o = (engines[k].max_model_len for k in ("groups", "off"))
    print(f"groups / off: max_model_len {len_g / len_o:.2f}x, peak pool usage "
          f"{peak_g / peak_o:.2f}x, decode tok/s {rate_g / rate_o:.2f}x")


if __name__ == "__main__":
    main()
