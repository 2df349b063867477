"""Quantization: quality, single-stream speed vs each one's ceiling, and the KV caches.

For fp32, int8 and int4 weights with an fp32 KV cache, fp32 weights with the fp16
(CPU's default) and int8 caches, and the defaults (the GGUF's own formats, fp16
cache) with either cache:
* quality: mean token negative log-likelihood and perplexity of the default
  model on a fixed text shipped here (benchmarks/data/eval_text.txt);
* single-stream decode tok/s vs that variant's weight-bandwidth ceiling
  (bandwidth measured in this run; ceiling = bandwidth / weight bytes read per
  step). Targets: fp32 >= 90%, int8 >= 60% of its ceiling;
* the fp16 and int8 KV caches: tokens the same memory holds, and greedy
  agreement with the fp32 cache on a fixed prompt set (identical first N
  tokens, and the mean length of the identical prefix).

    .venv/bin/python benchmarks/quantization.py [--tokens 96]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from common import read_bandwidth_gbs, set_threads

from tandem import LLM, SamplingParams

TEXT = Path(__file__).parent / "data" / "eval_text.txt"
PROMPTS = [
    "The history of the printing press",
    "Explain how a refrigerator works.",
    "def merge_sort(items):",
    "The three most important rules of writing are",
    "In the year 2050, cities will",
    "Photosynthesis is the process by which",
    "A good way to learn a new language is",
    "The main causes of the French Revolution were",
]


def nll(llm: LLM, ids: list[int], window: int = 512) -> float:
    """Mean negative log-likelihood per token over non-overlapping windows."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        logits = llm.engine.score_tokens(chunk[:-1])
        lp = torch.log_softmax(logits, -1)
        target = torch.tensor(chunk[1:])
        total -= lp.gather(1, target[:, None]).sum().item()
        count += len(chunk) - 1
    return total / count


def decode_rate(llm: LLM, tokens: int, repeats: int = 3) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate("Warm-up", SamplingParams(max_tokens=4, ignore_eos=True))
    return max(llm.generate(PROMPTS[0], params)[0].metrics.decode_tokens_per_s
               for _ in range(repeats))


def last_level_cache_bytes() -> int:
    """This CPU's largest cache (Linux sysfs); 0 when unknown."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * mult)
    return max(sizes)


def greedy(llm: LLM, n: int) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    rows = []
    ref_greedy = None
    for quant, kv in (("none", "fp32"), ("int8", "fp32"), ("int4", "fp32"), ("none", "fp16"),
                      ("none", "int8"), ("auto", "fp32"), ("auto", "fp16")):
        llm = LLM(kv_cache_memory="512MiB", quantization=quant, kv_cache_dtype=kv,
                  num_threads=a.threads)
        ids = llm.get_tokenizer().encode(TEXT.read_text())
        loss = nll(llm, ids)
        bw = read_bandwidth_gbs()
        rate = decode_rate(llm, a.tokens)
        wbytes = llm.engine.model.weight_bytes
        ceiling = bw * 1e9 / wbytes
        g = greedy(llm, a.agree_tokens)
        if ref_greedy is None:
            ref_greedy = g
        same = sum(x == y for x, y in zip(g, ref_greedy))
        prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
                  for x, y in zip(g, ref_greedy)]
        rows.append((f"{quant}/{kv}", len(ids), loss, wbytes, bw, rate, ceiling,
                     llm.engine.kv_pool_tokens,
                     same, sum(prefix) / len(prefix)))
    print(f"quality: {TEXT.name}, {rows[0][1]} tokens; speed: {a.tokens} greedy tokens, "
          f"{a.threads} threads; pool: 512 MiB; agreement: {len(PROMPTS)} prompts x "
          f"{a.agree_tokens} greedy tokens vs fp32")
    print(f"{'weights/kv':12} {'NLL':>7} {'PPL':>7} {'MB read':>8} {'GB/s':>6} {'tok/s':>7} "
          f"{'ceiling':>8} {'ratio':>6} {'KV tokens':>10} {'same':>5} {'prefix':>7}")
    for name, _, loss, wbytes, bw, rate, ceil, kv_tokens, same, prefix in rows:
        print(f"{name:12} {loss:7.4f} {math.exp(loss):7.2f} {wbytes / 1e6:8.1f} {bw:6.1f} "
              f"{rate:7.1f} {ceil:8.1f} {rate / ceil:6.2f} {kv_tokens:10d} "
              f"{same:>2}/{len(PROMPTS)} {prefix:7.1f}")
    base_kv = rows[0][7]
    for name, *_, kv_tokens, _, _ in rows:
        if name.startswith("none/") and name != "none/fp32":
            print(f"{name.split('/')[1]} KV cache holds {kv_tokens / base_kv:.2f}x the tokens of "
                  "the fp32 cache in the same memory")
    print("targets: fp32 ratio >= 0.90, int8 ratio >= 0.60")
    llc = last_level_cache_bytes()
    for name, _, _, wbytes, *_ in rows:
        if wbytes < llc:
            print(f"note: {name} reads {wbytes / 1e6:.0f} MB per token, less than this CPU's "
                  f"{llc / 1e6:.0f} MB last-level cache (on a VM, shared with other tenants): "
                  "part of each step can come from the cache, not memory, so its ratio to the "
                  "memory-bandwidth ceiling varies from run to run and can exceed 1")


if __name__ == "__main__":
    main()
