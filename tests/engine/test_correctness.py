"""Greedy token ids identical to HF transformers on the real default model, on every path.

The engine dequantizes the GGUF to fp32 here (quantization="none"), as HF does;
by default it runs the file's own Q4_1 / Q8_0 blocks (tests/engine/test_gguf_formats.py)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

from .cpu_paths import CPU_PATHS, cpu_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three laws of thermodynamics are",
    "Translate to French: good morning",
    "A haiku about GPUs:",
]
MAX_TOKENS = [24, 16, 32, 12, 20, 28, 8, 18]


# A fixed token budget: the CPU's measured one follows the machine's load, and
# another chunking of a prompt moves the matmuls' last bits, which a query
# rounded to bf16 (the bf16 cache, auto on CPUs with AVX512_BF16) can turn into
# a flipped near-tie. Fixed, a run is the same whatever else the machine does.
BUDGET = 128


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="256MiB", quantization="none", max_num_batched_tokens=BUDGET)


def ids_of(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def check(outs, prompts_ids, max_tokens, hf_greedy):
    for out, ids, n in zip(outs, prompts_ids, max_tokens):
        assert out.outputs[0].token_ids == hf_greedy(ids, n), out.request_id


def test_single_request_matches_hf(llm, hf_greedy):
    ids = ids_of(llm, PROMPTS[0])
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.outputs[0].token_ids == hf_greedy(ids, 24)
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
    m = out.metrics
    assert m.num_prompt_tokens == len(ids)
    assert m.num_output_tokens == len(out.outputs[0].token_ids)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.prefill_s > 0 and m.queued_s >= 0


@pytest.mark.parametrize("path", CPU_PATHS)
def test_eight_concurrent_requests_match_hf(llm, hf_greedy, path):
    """The one-call decode step, the per-op kernels and the torch paths they
    replace (used where the kernels cannot be built) all match HF."""
    with cpu_path(llm.engine, path):
        prompts_ids = [ids_of(llm, p) for p in PROMPTS]
        params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
        outs = llm.generate(prompts_ids, params)
    check(outs, prompts_ids, MAX_TOKENS, hf_greedy)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_chunked_prefill_matches_hf(hf_greedy):
    llm = LLM(kv_cache_memory="64MiB", max_num_batched_tokens=7, quantization="none")
    prompts_ids = [ids_of(llm, p) for p in PROMPTS[:4]]
    assert max(len(p) for p in prompts_ids) > 7
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS[:4]]
    outs = llm.generate(prompts_ids, params)
    check(outs, prompts_ids, MAX_TOKENS[:4], hf_greedy)


def test_preemption_matches_hf(hf_greedy):
    # 5 blocks of 16 tokens = 80 slots; each request needs 3-4 blocks by its end,
    # so running requests run out of blocks and are preempted and recomputed.
    bytes_per_block = 2 * 30 * 3 * 64 * 2 * 16  # fp16 K/V
    llm = LLM(kv_cache_memory=5 * bytes_per_block, max_model_len=80, quantization="none")
    prompts_ids = [ids_of(llm, p) for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate(prompts_ids, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    check(outs, prompts_ids, [40] * 4, hf_greedy)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.blocks)


def test_prefix_cache_hits_keep_outputs_identical(llm, hf_greedy):
    system = "You are a helpful assistant who answers briefly and precisely. " * 4
    prompts = [system + q for q in ("What is 2+2?", "Name a color.", "Say hi.")]
    prompts_ids = [ids_of(llm, p) for p in prompts]
    hits_before = llm.engine.kv_manager.prefix_cache_hits
    outs = llm.generate(prompts_ids, SamplingParams(temperature=0, max_tokens=10))
    check(outs, prompts_ids, [10] * 3, hf_greedy)
    assert llm.engine.kv_manager.prefix_cache_hits > hits_before
    assert max(o.metrics.num_cached_tokens for o in outs) >= 16


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.outputs[0].text
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("assistant")


def test_bf16_cache_matches_hf(hf_greedy):
    """A bf16 KV cache (queries rounded to bf16; on CPUs with AVX512_BF16 the
    attention products are bf16, summed in fp32) keeps HF's greedy ids here."""
    llm = LLM(kv_cache_memory="256MiB", quantization="none", kv_cache_dtype="bf16",
              max_num_batched_tokens=BUDGET)
    assert llm.engine.kv_caches[0].data.dtype == torch.bfloat16
    prompts_ids = [ids_of(llm, p) for p in PROMPTS]
    outs = llm.generate(prompts_ids, [SamplingParams(temperature=0, max_tokens=n)
                                      for n in MAX_TOKENS])
    check(outs, prompts_ids, MAX_TOKENS, hf_greedy)
