"""Python/framework overhead per decode step at batch 1.

A model with the default model's layer count (30) but tiny dims, so the math is
negligible and the step time is the engine's own overhead: scheduling, batch
metadata, ~30 ops per layer, sampling, the host sync. Baseline in the same run:
HF transformers' forward of the same tiny config with its KV cache (a naive
eager PyTorch step). Target: <= 4 ms.

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


def main() -> None:
    set_threads(2)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(CONFIG))
        ours = tandem_step_ms(str(path))
    base = hf_step_ms()
    print(f"tandem decode step (30 tiny layers, batch 1)  {ours:6.2f} ms  (target <= 4 ms)")
    print(f"HF transformers eager step, same config       {base:6.2f} ms")
    print(f"ratio HF / tandem                             {base / ours:6.2f}x")


if __name__ == "__main__":
    main()
