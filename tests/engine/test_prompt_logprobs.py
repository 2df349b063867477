"""Prompt logprobs (SamplingParams.prompt_logprobs), cumulative_logprob and
RequestOutput.prompt, as vLLM's offline API returns them."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

TEXT = "The capital of France is Paris. The capital of Germany is Berlin."


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="128MiB")


def _reference(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits from one prefill outside the scheduler."""
    return torch.log_softmax(engine.score_tokens(ids).float(), -1)


def test_prompt_logprobs_are_each_prompt_tokens_logprob_and_the_top_k(llm):
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))[0]
    ids, plp = out.prompt_token_ids, out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    ref = _reference(llm.engine, ids)
    for i in range(1, len(ids)):
        entry = plp[i]
        assert ids[i] in entry and 2 <= len(entry) <= 3
        assert entry[ids[i]] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top2 = torch.topk(ref[i - 1], 2).indices.tolist()
        assert set(top2) <= set(entry)
    assert out.prompt == TEXT
    # Asked for nothing: none computed; token-id prompts carry no text.
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None and plain.prompt is None
    both = llm.generate({"prompt": TEXT, "prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    assert both[0].prompt == TEXT and both[0].prompt_token_ids == ids
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(llm):
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    queries = llm.engine.kv_manager.prefix_cache_queries
    first = llm.generate(TEXT + " And Spain?", p)[0]
    assert llm.engine.kv_manager.prefix_cache_queries == queries  # it did not look
    again = llm.generate(TEXT + " And Spain?", p)[0]
    assert again.metrics.num_cached_tokens == 0
    assert _close(again.prompt_logprobs, first.prompt_logprobs)
    assert all(len(e) == 1 for e in again.prompt_logprobs[1:])  # k = 0: the token's own
    # A request without prompt logprobs uses the blocks they left behind.
    plain = llm.generate(TEXT + " And Spain?", SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.metrics.num_cached_tokens > 0


def test_cumulative_logprob_sums_the_sampled_tokens(llm):
    out = llm.generate(TEXT, SamplingParams(temperature=0.8, seed=3, max_tokens=6,
                                            logprobs=1, ignore_eos=True))[0].outputs[0]
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids)))
    assert out.cumulative_logprob < 0
    plain = llm.generate(TEXT, SamplingParams(max_tokens=2))[0].outputs[0]
    assert plain.cumulative_logprob is None


@pytest.mark.parametrize("k", [-1, 21, 1.5, True])
def test_prompt_logprobs_bounds(k):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=k)


def _tiny(path: str, **kwargs) -> LLM:
    base = dict(load_format="dummy", skip_tokenizer_init=True, block_size=4,
                max_model_len=32)
    base.update(kwargs)
    return LLM(model=path, **base)


def test_chunks_preemption_and_neighbours_leave_prompt_logprobs_unchanged(tiny_config_path):
    prompts = [list(range(1, 13)), list(range(20, 32))]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=3)
    roomy = _tiny(tiny_config_path, kv_cache_memory="1MiB")
    alone = [roomy.generate([ids], p)[0] for ids in prompts]
    greedy = roomy.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))[0]
    # 8 blocks of 4 tokens: the two requests growing to 28 tokens cannot both fit
    # (one is preempted and recomputed), and a 4-token budget prefills each 12-token
    # prompt in three chunks beside the other's decodes.
    tight = _tiny(tiny_config_path, kv_cache_memory="4KiB", max_num_seqs=3,
                  max_num_batched_tokens=4)
    outs = tight.generate([*prompts, [5, 6, 7]], [p, p, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True)])
    assert tight.engine.scheduler.num_preemptions > 0
    for got, want in zip(outs, alone):
        assert len(got.prompt_logprobs) == 12
        assert _close(got.prompt_logprobs, want.prompt_logprobs)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[2].prompt_logprobs is None
    assert outs[2].outputs[0].token_ids == greedy.outputs[0].token_ids


def _close(a: list, b: list) -> bool:
    if a[0] is not None or b[0] is not None or len(a) != len(b):
        return False
    return all(x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-3 for t in x)
               for x, y in zip(a[1:], b[1:]))


def test_max_tokens_0_scores_the_prompt_alone(llm):
    engine = llm.engine
    before = engine.num_generation_tokens_total
    p = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
    out = llm.generate(TEXT, p)[0]
    assert out.finished and out.finish_reason == "length"
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    scored = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    assert _close(out.prompt_logprobs, scored[0].prompt_logprobs)
    assert engine.num_generation_tokens_total == before + 2  # none counted for the first
    assert out.metrics.num_output_tokens == 0 and out.metrics.prefill_s > 0
    assert not engine.has_unfinished_requests()
    # A prompt that fills the window is scored; one token more is not.
    window = engine.max_model_len
    ids = (out.prompt_token_ids * (window // len(out.prompt_token_ids) + 1))[:window]
    assert len(llm.generate([ids], p)[0].prompt_logprobs) == window
    with pytest.raises(ValueError, match=rf"{window + 1} were requested \({window + 1} in the "
                       r"prompt, 0 for the completion\)"):
        llm.generate([ids + ids[:1]], p)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([ids], SamplingParams(max_tokens=None))
