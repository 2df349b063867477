"""Prefill attention over the paged KV cache: tandem's kernel against gather + SDPA.

A prompt chunk's queries attend causally to their whole context. Without the
fused kernels, tandem gathers each context from the paged cache into a padded
fp32 copy and calls torch's SDPA with an additive mask; with them,
torch.ops.tandem.paged_attention_prefill reads K/V through the block table.
Both run here through tandem.model.attention (``build_group`` with fused off
and on) on the same cache, alternated ``--rounds`` times, best of each; the
ratio is the gather + SDPA time over the kernel's. Shapes: a 1B-class Llama's
attention (32 query / 8 KV heads of 64, fp16 cache), one sequence, chunks of
``--chunk`` tokens at the end of contexts of ``--contexts`` tokens.

    .venv/bin/python benchmarks/prefill_attention.py [--chunk 80]
        [--contexts 128 500 2000 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import set_threads

from tandem.kernels import custom_ops
from tandem.model.attention import AttentionMetadata, build_group, paged_attention
from tandem.model.kv_cache import Fp16KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16


def seconds(fn, repeats: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=80, help="query tokens of the chunk")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 500, 2000, 4000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not custom_ops.available():
        raise SystemExit("tandem's CPU kernels are not built here: nothing to compare")
    set_threads(a.threads)
    cpu = torch.device("cpu")
    print(f"{HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}, fp16 cache, one sequence; "
          f"best of {a.rounds} alternated rounds")
    print(f"{'context':>8} {'chunk':>6} {'gather+SDPA ms':>15} {'kernel ms':>10} "
          f"{'kernel GFLOP/s':>15} {'ratio':>6}")
    for ctx in a.contexts:
        q_len = min(a.chunk, ctx)
        nb = -(-ctx // BLOCK)
        cache = Fp16KVCache(nb * BLOCK, KV_HEADS, HEAD_DIM, torch.float32, cpu)
        cache.write(torch.arange(nb * BLOCK), torch.randn(nb * BLOCK, 2, KV_HEADS, HEAD_DIM))
        table = torch.randperm(nb).view(1, nb)  # blocks scattered, as a pool hands them out
        q = torch.randn(q_len, HEADS, HEAD_DIM)
        metas = {fused: AttentionMetadata(None, None, build_group([q_len], [ctx], table, BLOCK,
                                                                  cpu, fused=fused))
                 for fused in (False, True)}
        best = {False: float("inf"), True: float("inf")}
        for _ in range(a.rounds):
            for fused, meta in metas.items():
                best[fused] = min(best[fused], seconds(
                    lambda q=q, cache=cache, meta=meta: paged_attention(q, cache, meta,
                                                                        HEAD_DIM**-0.5)))
        # Causal FLOPs: query j sees ctx - q_len + j + 1 keys; 4 FLOP per (query head, key, dim).
        keys = sum(ctx - q_len + j + 1 for j in range(q_len))
        flop = 4 * HEADS * HEAD_DIM * keys
        print(f"{ctx:8d} {q_len:6d} {best[False] * 1e3:15.2f} {best[True] * 1e3:10.2f} "
              f"{flop / best[True] / 1e9:15.0f} {best[False] / best[True]:6.2f}")


if __name__ == "__main__":
    main()
