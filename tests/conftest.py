"""Shared fixtures: the real default model (converted once) and a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch

torch.set_num_threads(2)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}


@pytest.fixture(autouse=True)
def _cpu_unless_cuda_test(request, monkeypatch):
    """The suite tests the CPU paths (what CI has) even on a machine with a GPU,
    where device "auto" would pick CUDA; tests/cuda/ tests the GPU paths."""
    if "cuda" not in request.node.path.parts:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="session")
def tiny_config_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


@pytest.fixture(scope="session")
def default_model_dir():
    from tandem.model.gguf import gguf_to_hf_dir
    from tandem.paths import default_model_path

    return gguf_to_hf_dir(default_model_path(), weights=True)  # fp32 safetensors for HF


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """The correctness reference: HF transformers, fp32, the same weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(ids, n) -> HF generate's greedy continuation (stops at EOS like we do)."""
    cache: dict = {}

    def run(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                out = hf_model.generate(
                    torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                    pad_token_id=hf_model.config.eos_token_id,
                )
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    return run
