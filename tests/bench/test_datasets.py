"""The workloads: lengths as asked, no accidental shared prefixes, real history reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.tools.bench.datasets import DatasetArgs, load_chat_lengths, sample_requests
from tandem.tools.bench.tokens import PromptBuilder


class WordTokenizer:
    """One token per word: token counts are checkable by eye."""

    source = "words"

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def _builder(seed: int = 0) -> tuple[PromptBuilder, WordTokenizer]:
    tok = WordTokenizer()
    return PromptBuilder(tok, np.random.default_rng(seed)), tok


def test_random_lengths_follow_the_range_ratio_and_prompts_share_no_block():
    b, tok = _builder()
    args = DatasetArgs(random_input_len=100, random_output_len=20, random_range_ratio=0.5)
    samples = sample_requests(args, b, 60)
    ins = [s.prompt_len for s in samples]
    outs = [s.expected_output_len for s in samples]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 10
    assert min(outs) >= 10 and max(outs) <= 30
    assert all(len(tok.encode(s.prompt)) == s.prompt_len for s in samples)
    # Different within the first 16 tokens (one KV block): no prefix-cache hit between them.
    firsts = {tuple(tok.encode(s.prompt)[:16]) for s in samples}
    assert len(firsts) == len(samples)


def test_random_prefix_is_common_and_output_len_overrides():
    b, tok = _builder()
    args = DatasetArgs(random_input_len=10, random_prefix_len=30, output_len=7)
    samples = sample_requests(args, b, 5)
    prefixes = {tuple(tok.encode(s.prompt)[:30]) for s in samples}
    assert len(prefixes) == 1
    assert {s.prompt_len for s in samples} == {40}
    assert {s.expected_output_len for s in samples} == {7}


def test_shared_prefix_round_robins_system_prompts():
    b, tok = _builder()
    args = DatasetArgs(name="shared-prefix", shared_prefix_len=50,
                       shared_prefix_question_len=8, shared_prefix_num_prefixes=2)
    samples = sample_requests(args, b, 6)
    systems = [s.messages[0]["content"] for s in samples]
    assert systems[0] == systems[2] == systems[4] != systems[1] == systems[3]
    assert all(len(tok.encode(x)) == 50 for x in systems)
    assert len({s.messages[1]["content"] for s in samples}) == 6
    assert all(s.prompt.startswith(s.messages[0]["content"]) for s in samples)


def test_chat_turns_repeat_their_history_exactly():
    b, tok = _builder(3)
    samples = sample_requests(DatasetArgs(name="chat", max_model_len=100_000), b, 12)
    convs = load_chat_lengths()
    assert len(convs) >= 100 and all(1 <= len(c) <= 8 for c in convs)
    for prev, cur in zip(samples, samples[1:]):
        if len(cur.messages) > 1:  # a later turn of the same conversation
            assert cur.messages[:len(prev.messages)] == prev.messages
            assert cur.messages[len(prev.messages)]["role"] == "assistant"
        assert cur.messages[-1]["role"] == "user"
        assert cur.prompt_len == sum(len(tok.encode(m["content"])) for m in cur.messages)


def test_chat_fits_a_small_window():
    b, _ = _builder()
    samples = sample_requests(DatasetArgs(name="chat", max_model_len=512), b, 40)
    assert all(s.prompt_len + s.expected_output_len <= 512 - 64 for s in samples)


def test_file_dataset(tmp_path):
    b, tok = _builder()
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "one two three", "output_len": 5},
        {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3},
        {"input_len": 12},
        {"prompt": [5, 6, 7]},
    ]) + "\n\n")
    samples = sample_requests(DatasetArgs(name="file", path=str(path)), b, 6)
    assert [s.expected_output_len for s in samples] == [5, 3, 128, 128, 5, 3]
    assert samples[0].prompt == "one two three" and samples[0].prompt_len == 3
    assert samples[1].messages == [{"role": "user", "content": "hi there"}]
    assert samples[2].prompt_len == 12 == len(tok.encode(samples[2].prompt))
    assert samples[3].prompt == [5, 6, 7]
    path.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"reqs.jsonl:2: .*\"prompt\", \"messages\""):
        sample_requests(DatasetArgs(name="file", path=str(path)), b, 1)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        sample_requests(DatasetArgs(name="file"), b, 1)


def test_requests_beyond_the_window_fail_before_sending():
    b, _ = _builder()
    with pytest.raises(ValueError, match="context window of 100 tokens"):
        sample_requests(DatasetArgs(random_input_len=90, random_output_len=20,
                                    max_model_len=100), b, 3)
    with pytest.raises(ValueError, match="range-ratio"):
        sample_requests(DatasetArgs(random_range_ratio=1.0), b, 3)


def test_token_id_prompts_without_a_tokenizer():
    b = PromptBuilder(None, np.random.default_rng(0), vocab_size=50)
    samples = sample_requests(DatasetArgs(random_input_len=20, random_prefix_len=4), b, 3)
    assert all(len(s.prompt) == 24 and 1 <= min(s.prompt) and max(s.prompt) < 50
               for s in samples)
    with pytest.raises(ValueError, match="chat dataset needs a tokenizer"):
        sample_requests(DatasetArgs(name="chat"), b, 1)
