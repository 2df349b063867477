"""Aggregate output tok/s for N concurrent requests vs HF transformers one by one.

Workload: 32 requests, 128-token prompts, 128 output tokens each,
ignore_eos, all submitted at once to one engine. Baseline, measured in the same
run: HF transformers `generate` (fp32, greedy, same weights) on the same
requests one after another. HF's time is linear in the number of requests, so
it is measured on --hf-requests of them and scaled to N (printed as such).
Target: >= 10x.

    .venv/bin/python benchmarks/batch_throughput.py [--num-requests 32] [--hf-requests 2]
        [--quantization int8] [--max-num-batched-tokens 2048]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import set_threads

from tandem import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="offline batch job: big prefill chunks (the server's CPU default, "
                         "128, trades throughput for inter-token latency)")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.input_len)]
               for _ in range(a.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm = LLM(kv_cache_memory="2GiB", num_threads=a.threads, quantization=a.quantization,
              max_num_batched_tokens=a.max_num_batched_tokens)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ours = n_out / ours_s

    from transformers import AutoModelForCausalLM

    from tandem.model.gguf import gguf_to_hf_dir
    from tandem.paths import default_model_path

    # The engine keeps no fp32 copy of a GGUF; HF needs one (made once, cached).
    hf_dir = gguf_to_hf_dir(default_model_path(), weights=True)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    t = time.perf_counter()
    hf_tokens = 0
    with torch.no_grad():
        for ids in prompts[: a.hf_requests]:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=a.output_len,
                              min_new_tokens=a.output_len, do_sample=False,
                              pad_token_id=hf.config.eos_token_id)
            hf_tokens += out.shape[1] - len(ids)
    hf_s = time.perf_counter() - t
    hf_rate = hf_tokens / hf_s
    print(f"workload: {a.num_requests} requests x {a.input_len} prompt + {a.output_len} output "
          f"tokens, ignore_eos, {a.threads} threads, weights {a.quantization}, token budget "
          f"{llm.engine.max_num_batched_tokens}")
    print(f"tandem (all at once)    {n_out} tokens in {ours_s:7.1f} s = {ours:7.1f} tok/s")
    print(f"HF generate one by one  {hf_tokens} tokens in {hf_s:7.1f} s = {hf_rate:7.1f} tok/s "
          f"(measured on {a.hf_requests} requests; {a.num_requests} would take "
          f"{hf_s * a.num_requests / a.hf_requests:.0f} s)")
    print(f"ratio tandem / HF       {ours / hf_rate:7.1f}x  (target >= 10x)")


if __name__ == "__main__":
    main()
