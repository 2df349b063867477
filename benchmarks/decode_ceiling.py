"""Single-stream decode tok/s vs the weight-bandwidth ceiling, measured in one run.

ceiling = read bandwidth (measured here) / bytes of weights read per decode step.
Target at fp32 (the default here; the default model's own format is int4): >= 90%.

    .venv/bin/python benchmarks/decode_ceiling.py [--tokens 128] [--quantization none]
"""

from __future__ import annotations

import argparse

from common import read_bandwidth_gbs, set_threads

from tandem import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="none",
                    help="none (fp32), int8, int4, or auto (the model's own format)")
    a = ap.parse_args()
    set_threads(a.threads)
    llm = LLM(kv_cache_memory="512MiB", num_threads=a.threads, quantization=a.quantization)
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    llm.generate("Warm-up.", SamplingParams(max_tokens=8, ignore_eos=True))
    best = 0.0
    for _ in range(a.repeats):
        m = llm.generate("The history of the printing press", params)[0].metrics
        best = max(best, m.decode_tokens_per_s)
    bw = read_bandwidth_gbs()
    wbytes = llm.engine.model.weight_bytes
    ceiling = bw * 1e9 / wbytes
    print(f"read bandwidth          {bw:8.1f} GB/s")
    print(f"weights read per step   {wbytes / 1e6:8.1f} MB (--quantization {a.quantization})")
    print(f"ceiling                 {ceiling:8.1f} tok/s")
    print(f"tandem single stream    {best:8.1f} tok/s (best of {a.repeats}, {a.tokens} tokens)")
    print(f"ratio vs ceiling        {best / ceiling:8.2f}  (targets: >= 0.75 and >= 0.90)")


if __name__ == "__main__":
    main()
