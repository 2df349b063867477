"""Python/framework overhead per decode step: at batch 1, and at 64 sequences x 4k context.

Batch 1: a model with the default model's layer count (30) but tiny dims, so the
math is negligible and the step time is the engine's own overhead: scheduling,
batch metadata, ~30 ops per layer, sampling, the host sync. Baseline in the same
run: HF transformers' forward of the same tiny config with its KV cache (a naive
eager PyTorch step). Target: <= 4 ms.

64 x 4k: one tiny layer (one KV head of 16), so what grows with batch x context
is the host work (block tables, slots, per-request bookkeeping) plus a small
attention read (64 x 4k x 128 bytes). Baseline in the same run: the attention
kernel alone on the same cache, the part no host work can remove.

    .venv/bin/python benchmarks/step_overhead.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import set_threads

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 30,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "eos_token_id": 0,
}


def tandem_step_ms(path: str, steps: int = 300) -> float:
    engine = LLMEngine(EngineConfig(model=path, load_format="dummy", skip_tokenizer_init=True,
                                    kv_cache_memory="64MiB"))
    engine.add_request(list(range(1, 65)), SamplingParams(max_tokens=steps + 50, ignore_eos=True))
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def hf_step_ms(steps: int = 300) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items()
                                            if k != "architectures"})).eval()
    ids = torch.arange(1, 65).unsqueeze(0)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            nxt.item()
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


WIDE = {**CONFIG, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
        "max_position_embeddings": 4224}


def wide_step_ms(path: str, seqs: int = 64, context: int = 4096, steps: int = 40
                 ) -> tuple[float, float]:
    """(median decode step, median attention kernel alone) in ms at seqs x context."""
    engine = LLMEngine(EngineConfig(model=path, load_format="dummy", skip_tokenizer_init=True,
                                    kv_cache_memory="80MiB", max_num_seqs=seqs,
                                    max_num_batched_tokens=8192))
    for i in range(seqs):
        prompt = [(i * 7 + j) % 500 + 1 for j in range(context)]
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 10, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # prefills
    times, attn = [], []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    reqs = list(engine.requests.values())
    ctx = torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.int32)
    bs, blocks = engine.config.block_size, engine.runner.block_table
    table = blocks.table(blocks.rows(reqs), -(-int(ctx.max()) // bs))[0]  # one KV group
    q = torch.randn(len(reqs), 1, 16)
    cache = engine.kv_caches[0]
    for _ in range(steps):
        t = time.perf_counter()
        torch.ops.tandem.paged_attention_decode(q, *cache.kernel_args, table, ctx, bs, 0.25)
        attn.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, statistics.median(attn) * 1e3


def main() -> None:
    set_threads(2)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(CONFIG))
        ours = tandem_step_ms(str(path))
        wide = Path(d) / "wide.json"
        wide.write_text(json.dumps(WIDE))
        step64, attn64 = wide_step_ms(str(wide))
    base = hf_step_ms()
    print(f"tandem decode step (30 tiny layers, batch 1)  {ours:6.2f} ms  (target <= 4 ms)")
    print(f"HF transformers eager step, same config       {base:6.2f} ms")
    print(f"ratio HF / tandem                             {base / ours:6.2f}x")
    print(f"tandem decode step, 64 sequences x 4k context {step64:6.2f} ms")
    print(f"  its attention kernel alone                  {attn64:6.2f} ms")
    print(f"  everything else (host work, one tiny layer) {step64 - attn64:6.2f} ms")


if __name__ == "__main__":
    main()
