"""Sampling and stop conditions end to end on the real default model."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="128MiB")


PROMPT = "Once upon a time, there was a robot who"


def test_same_seed_same_output_whatever_the_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30)]
    batch = llm.generate(["Hello", PROMPT, "List three fruits:"], [others[0], p, others[1]])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24,
                                ignore_eos=True)
    assert llm.generate(PROMPT, other_seed)[0].outputs[0].token_ids != alone


def test_max_tokens_and_length_finish(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_is_cut_and_not_emitted(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))[0]
    text = greedy.outputs[0].text
    words = text.split()
    stop = words[min(5, len(words) - 1)]  # a word from the middle of the greedy text
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                               include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_streamed_deltas_add_up_and_hold_back_stop_prefixes(llm):
    engine = llm.engine
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30))[0]
    text = greedy.outputs[0].text
    stop = text[10:16]
    req = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    deltas = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == req.request_id:
                deltas.append(o.delta_text)
                assert stop not in "".join(deltas)
    assert "".join(deltas) == text[: text.index(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    ids = greedy[0].outputs[0].token_ids
    stop_id = ids[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20,
                                              stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].token_ids == ids[: ids.index(stop_id) + 1]
    assert out.outputs[0].stop_reason == stop_id
    # min_tokens: the stop token cannot be sampled (nor stop) before 8 tokens.
    late = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, min_tokens=8,
                                               stop_token_ids=[stop_id]))[0]
    assert len(late.outputs[0].token_ids) >= 8
    assert stop_id not in late.outputs[0].token_ids[:7]


def test_eos_stops_unless_ignored(llm):
    out = llm.chat([{"role": "user", "content": "Say only: yes"}],
                   SamplingParams(temperature=0, max_tokens=64))[0]
    eos = llm.engine.eos_token_id
    assert out.finish_reason == "stop" and out.outputs[0].token_ids[-1] == eos
    n = len(out.outputs[0].token_ids)
    forced = llm.chat([{"role": "user", "content": "Say only: yes"}],
                      SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True))[0]
    assert len(forced.outputs[0].token_ids) == n + 5 and forced.finish_reason == "length"


def test_penalties_change_greedy_output(llm):
    prompt = "Repeat after me: the the the the the the"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              repetition_penalty=1.8, frequency_penalty=1.0))
    assert base[0].outputs[0].token_ids != pen[0].outputs[0].token_ids


def test_top_k_1_equals_greedy(llm):
    g = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    k1 = llm.generate(PROMPT, SamplingParams(temperature=1.3, top_k=1, max_tokens=16,
                                             ignore_eos=True, seed=3))
    assert g[0].outputs[0].token_ids == k1[0].outputs[0].token_ids


def test_logprobs_returned(llm):
    engine = llm.engine
    req = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == req.request_id:
                seen.append((o.new_token_ids[0], o.new_logprobs[0]))
    for tok, lp in seen:
        assert tok in lp and len(lp) <= 3
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())
    # The finished output holds them all, as vLLM's LLM.generate returns them.
    final = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
    assert final.outputs[0].logprobs == [lp for _, lp in seen]
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.outputs[0].logprobs is None


def test_engine_seed_makes_unseeded_sampling_repeat(tiny_config_path):
    # vLLM's LLM(seed=...): requests without a seed of their own draw from the
    # engine's stream, so a rerun of the same requests samples the same tokens.
    def run(seed: int) -> list[list[int]]:
        llm = LLM(model=tiny_config_path, load_format="dummy", skip_tokenizer_init=True,
                  kv_cache_memory="1MiB", max_model_len=64, seed=seed)
        p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], p)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    for bad in ("x", True, 1.5, 2**64):  # refused before the load, naming the flag
        with pytest.raises(ValueError, match="--seed must be a 64-bit integer"):
            LLM(model=tiny_config_path, load_format="dummy", seed=bad)


def test_max_tokens_cutting_a_character_ends_the_text_before_it(llm):
    # The regex makes the first output token a part of the emoji's bytes.
    from tandem.sampling_params import StructuredOutputsParams

    p = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(regex="🌍🌍 ok"))
    out = llm.generate(PROMPT, p)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert out.text == ""
    whole = llm.generate(PROMPT, SamplingParams(max_tokens=8, structured_outputs=(
        StructuredOutputsParams(regex="🌍🌍 ok"))))[0].outputs[0]
    assert whole.text == "🌍🌍 ok"
