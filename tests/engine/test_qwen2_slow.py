"""Opt-in (make test-slow): the Qwen2 path (q/k/v biases, untied LM head) on a real
0.5B model shipped in six PyPI chunks, token-exact against HF transformers."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_qwen2_greedy_matches_hf():
    from transformers import AutoModelForCausalLM

    from tandem.model.gguf import gguf_to_hf_dir
    from tandem.paths import qwen2_model_path

    model_dir = gguf_to_hf_dir(qwen2_model_path())
    llm = LLM(model=str(qwen2_model_path()), kv_cache_memory="256MiB", max_model_len=512)
    tok = llm.get_tokenizer()
    prompts = ["def quicksort(arr):", "# Print hello world in Python\n", "SELECT name FROM"]
    ids = [tok.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p_ids, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p_ids]), max_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(p_ids):].tolist()
