"""Prefill attention over the paged KV cache: tandem's kernel against gather + SDPA.

A prompt chunk's queries attend causally to their whole context. Without the
fused kernels, tandem gathers each context from the paged cache into a padded
fp32 copy and calls torch's SDPA with an additive mask; with them,
torch.ops.tandem.paged_attention_prefill reads K/V through the block table.
Both run here through tandem.model.attention (``build_group`` with fused off
and on) on the same cache, alternated ``--rounds`` times, best of each; the
ratio is the gather + SDPA time over the kernel's. The kernel also runs on a
bf16 cache holding the same values (``--kv-cache-dtype bf16``), whose products
are bf16 (VDPBF16PS) on CPUs with AVX512_BF16; the last column is the fp16
kernel's time over that. Shapes: a 1B-class Llama's attention (32 query / 8 KV
heads of 64), one sequence, chunks of ``--chunk`` tokens at the end of
contexts of ``--contexts`` tokens.

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
from tandem.model.kv_cache import Bf16KVCache, Fp16KVCache

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
    print(f"{HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}, one sequence; "
          f"best of {a.rounds} alternated rounds")
    print(f"{'context':>8} {'chunk':>6} {'fp16: gather+SDPA ms':>21} {'kernel ms':>10} "
          f"{'GFLOP/s':>8} {'ratio':>6} {'bf16 kernel ms':>15} {'GFLOP/s':>8} {'vs fp16':>8}")
    for ctx in a.contexts:
        q_len = min(a.chunk, ctx)
        nb = -(-ctx // BLOCK)
        kv = torch.randn(nb * BLOCK, 2, KV_HEADS, HEAD_DIM)
        caches = [cls(nb * BLOCK, KV_HEADS, HEAD_DIM, torch.float32, cpu)
                  for cls in (Fp16KVCache, Bf16KVCache)]
        for c in caches:
            c.write(torch.arange(nb * BLOCK), kv)
        table = torch.randperm(nb).view(1, nb)  # blocks scattered, as a pool hands them out
        q = torch.randn(q_len, HEADS, HEAD_DIM)
        metas = {fused: AttentionMetadata(None, None, build_group([q_len], [ctx], table, BLOCK,
                                                                  cpu, fused=fused))
                 for fused in (False, True)}
        # (cache, fused): gather + SDPA and the kernel on fp16, the kernel on bf16.
        runs = [(caches[0], False), (caches[0], True), (caches[1], True)]
        best = [float("inf")] * len(runs)
        for _ in range(a.rounds):
            for i, (cache, fused) in enumerate(runs):
                best[i] = min(best[i], seconds(
                    lambda q=q, cache=cache, meta=metas[fused]: paged_attention(
                        q, cache, meta, HEAD_DIM**-0.5)))
        # Causal FLOPs: query j sees ctx - q_len + j + 1 keys; 4 FLOP per (query head, key, dim).
        keys = sum(ctx - q_len + j + 1 for j in range(q_len))
        flop = 4 * HEADS * HEAD_DIM * keys
        sdpa, fp16, bf16 = best
        print(f"{ctx:8d} {q_len:6d} {sdpa * 1e3:21.2f} {fp16 * 1e3:10.2f} {flop / fp16 / 1e9:8.0f} "
              f"{sdpa / fp16:6.2f} {bf16 * 1e3:15.2f} {flop / bf16 / 1e9:8.0f} {fp16 / bf16:8.2f}")


if __name__ == "__main__":
    main()
