"""Sampler cost per step vs a naive baseline (full-sort top-p/top-k + torch.multinomial).

    .venv/bin/python benchmarks/sampler_bench.py [--threads 2] [--vocab 49152]

Logits are synthetic: "lm" rows are Zipf-like with a per-row sharpness fitted
to SmolLM2-135M's own sampling distributions (top-p 0.9 at T=1 keeps a median
of ~20 tokens, >256 in ~10% of rows), and "flat" rows are Gaussian (the top-p
0.9 nucleus has ~10k tokens, so every row takes the exact full-sort fallback:
the worst case). Times are medians of repeated runs; SamplingMetadata.build
is included (it is per-step work too).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.sampling_params import SamplingParams
from tandem.worker.sampler import Sampler
from tandem.worker.sampling_metadata import SamplingMetadata

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    # Low temperatures push most of a row below exp's normal range (its slow path).
    "temp 0.2": dict(temperature=0.2),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
    "top-k 50": dict(temperature=1.0, top_k=50),
}


def lm_like_logits(batch: int, vocab: int, flat: bool, gen: torch.Generator) -> torch.Tensor:
    """Rows of Zipf-like logits, p(rank r) ~ r^-s, over a random permutation.

    s = 1.3 + 0.5 * Exp(1) per row roughly reproduces SmolLM2-135M sampling at
    T=1 (top-p 0.9 nucleus: median ~20 tokens, ~10% of rows above 256).
    """
    if flat:
        return torch.randn(batch, vocab, generator=gen) * 2.0
    log_rank = torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    s = 1.3 + 0.5 * torch.empty(batch).exponential_(generator=gen)
    out = torch.empty(batch, vocab)
    for i in range(batch):
        perm = torch.randperm(vocab, generator=gen)
        out[i, perm] = -s[i] * log_rank + 0.05 * torch.randn(vocab, generator=gen)
    return out


def naive(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM V0 / HF style: sort the whole vocabulary, mask, softmax, multinomial."""
    if p.greedy:
        return logits.argmax(-1)
    x = logits / p.temperature
    if p.top_k <= 0 and p.top_p >= 1.0:
        return torch.multinomial(torch.softmax(x, -1), 1).squeeze(1)
    vals, idx = torch.sort(x, dim=-1, descending=True)
    if p.top_k > 0:
        vals[:, p.top_k :] = -float("inf")
    if p.top_p < 1.0:
        probs = torch.softmax(vals, -1)
        excl = probs.cumsum(-1) - probs
        vals = vals.masked_fill(excl >= p.top_p, -float("inf"))
    pick = torch.multinomial(torch.softmax(vals, -1), 1)
    return idx.gather(1, pick).squeeze(1)


def run_ours(sampler: Sampler, logits: torch.Tensor, p: SamplingParams, b: int) -> None:
    meta = SamplingMetadata.build(
        [p] * b, [None] * b, [[]] * b, [[]] * b, (2,), logits.shape[1], "cpu"
    )
    sampler(logits, meta)


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    print(f"vocab {args.vocab}, {args.threads} threads, median ms per step (incl. metadata)")
    print(f"{'logits':7} {'case':12} {'batch':>5} {'tandem':>9} {'naive':>9} {'speedup':>8}")
    for flat in (False, True):
        for b in args.batches:
            logits = lm_like_logits(b, args.vocab, flat, gen)
            for name, kw in CASES.items():
                if flat and name in ("greedy", "temperature", "temp 0.2", "top-k 50"):
                    continue  # cost does not depend on the logits' shape
                p = SamplingParams(**kw)
                reps = args.reps if b < 64 or not name.startswith("top") else max(5, args.reps // 3)
                t_ours = timed(lambda p=p, b=b, x=logits: run_ours(sampler, x, p, b), args.reps)
                t_naive = timed(lambda p=p, x=logits: naive(x, p), reps)
                kind = "flat" if flat else "lm"
                print(
                    f"{kind:7} {name:12} {b:>5} {t_ours:>9.2f} {t_naive:>9.2f} "
                    f"{t_naive / t_ours:>7.1f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
