"""StructuredOutputManager: compile once per spec, errors naming the field, the
step's token masks, termination; the sampler
applying a grammar mask to greedy and random rows."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from tandem.kernels import custom_ops  # noqa: E402
from tandem.model.loader import resolve_model  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tandem.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402
from tandem.worker.sampler import Sampler  # noqa: E402
from tandem.worker.sampling_metadata import SamplingMetadata  # noqa: E402
from tandem.worker.structured_output import (  # noqa: E402
    GrammarFailedError,
    StructuredOutputManager,
    apply_token_bitmask_,
    ascii_digits,
    compiled_schema,
    spec_key,
)
from tandem.worker.unique_items import ItemScanner  # noqa: E402

V = 49152
EOS = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(resolve_model(None, "auto").dir)


@pytest.fixture
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, V, EOS)


def req(grammar):
    """What masks() reads of a Request."""
    return SimpleNamespace(structured_output_request=grammar)


def allowed(mask, row: int, vocab: int = V) -> set[int]:
    rows, bitmask = mask
    assert bitmask.shape == (len(rows), -(-vocab // 32)) and bitmask.dtype == torch.int32
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def pack(ok: torch.Tensor) -> torch.Tensor:
    """[R, V] bool (True = allowed) -> llguidance's int32 bitmask [R, ceil(V / 32)]."""
    words = -(-ok.shape[1] // 32)
    padded = torch.zeros(ok.shape[0], words * 32, dtype=torch.uint8)
    padded[:, : ok.shape[1]] = ok
    packed = np.packbits(padded.numpy(), axis=1, bitorder="little")
    return torch.from_numpy(packed.copy()).view(torch.int32)


@pytest.mark.parametrize("vocab,words_short", [(1000, 0), (1024, 0), (1000, 2), (77, 0)])
@pytest.mark.parametrize("kernel", [True, False])
def test_apply_token_bitmask_sets_exactly_the_banned_entries(vocab, words_short, kernel,
                                                             monkeypatch):
    """The CPU kernel and the torch path agree with a plain reading of the bits:
    a banned token (bit 0) and any token past the mask's last word get the value,
    rows not listed are untouched."""
    if kernel and not custom_ops.available():
        pytest.skip("tandem's CPU kernels are not built")
    if not kernel:
        monkeypatch.setattr(custom_ops, "available", lambda: False)
    g = torch.Generator().manual_seed(vocab + words_short)
    ok = torch.rand(2, vocab, generator=g) < 0.3
    ok[:, :64] = True  # whole all-allowed words, which the kernel skips
    bitmask = pack(ok)
    if words_short:
        bitmask = bitmask[:, :-words_short].contiguous()
        ok[:, bitmask.shape[1] * 32:] = False
    logits = torch.randn(4, vocab, generator=g)
    out = logits.clone()
    apply_token_bitmask_(out, torch.tensor([3, 1]), bitmask, -5.0)
    want = logits.clone()
    want[3][~ok[0]] = -5.0
    want[1][~ok[1]] = -5.0
    assert torch.equal(out, want)


def test_one_compile_per_spec_and_keys_keep_property_order(manager):
    a = SO(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = SO(json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    r1, r2 = manager.new_request(a), manager.new_request(b)
    assert len(manager._grammars) == 1 and r1.matcher is not r2.matcher
    swapped = SO(json={"properties": {"y": {}, "x": {}}, "type": "object"})
    assert spec_key(swapped) != spec_key(SO(json={"type": "object",
                                                  "properties": {"x": {}, "y": {}}}))
    manager.new_request(SO(choice=["a", "b"]))
    assert len(manager._grammars) == 2


@pytest.mark.parametrize("spec,field", [
    (SO(json={"type": "no-such-type"}), "json"),
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json"),
    (SO(regex="(unclosed"), "regex"),
    (SO(regex="[z-a]"), "regex"),
    (SO(grammar="start: undefined_rule"), "grammar"),
    (SO(grammar="root ::= ("), "grammar"),
    # past int64: llguidance would clamp the bound and break it
    (SO(json={"type": "integer", "minimum": 1e308}), "json"),
    (SO(json={"type": "object", "properties": {"n": {"type": ["integer", "null"],
                                                     "maximum": -(2**64)}}}), "json"),
])
def test_a_spec_that_does_not_compile_names_its_field(manager, spec, field):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} cannot be compiled"):
        manager.new_request(spec)
    assert not manager._grammars  # nothing cached for it


def test_a_grammar_past_llguidances_limits_is_refused_without_its_backtrace(manager):
    # 100,000 terminals: an assertion (a Rust panic) in llguidance's compiler
    text = "start: " + " ".join(['"a"'] * 100_000)
    with pytest.raises(ValueError, match="cannot be compiled: panic") as e:
        manager.new_request(SO(grammar=text))
    assert "backtrace" not in str(e.value) and len(str(e.value)) < 300


def test_gbnf_grammar_is_accepted(manager, tokenizer):
    g = manager.new_request(SO(grammar='root ::= "ab" | "cd"'))
    assert not g.accept(tokenizer.encode("a", add_special_tokens=False)[0])


def test_masks_follow_the_grammar_and_end_with_eos_only(manager, tokenizer):
    grammar = manager.new_request(SO(choice=["yes", "no"]))
    vocab = tokenizer.backend.get_vocab()
    plain = req(None)
    mask = manager.masks([plain, req(grammar), plain])
    assert mask[0].tolist() == [1]  # only the constrained row, at its batch row
    first = allowed(mask, 0)
    # Every allowed token starts "yes" or "no", "y" and "n" are among them, EOS is not.
    assert {vocab["y"], vocab["n"], vocab["yes"]} <= first and not first & set(EOS)
    for t in first:
        text = tokenizer.decode([t])
        assert "yes".startswith(text) or "no".startswith(text), text
    assert not grammar.accept(vocab["y"]) and not grammar.terminated
    assert grammar.accept(vocab["es"]) and grammar.terminated  # "yes": nothing may follow
    assert allowed(manager.masks([req(grammar)]), 0) == set(EOS)


def test_a_batch_without_constrained_rows_has_no_mask(manager):
    assert manager.masks([req(None), req(None)]) is None


def test_accepting_a_token_the_mask_bans_is_an_error(manager, tokenizer):
    grammar = manager.new_request(SO(regex="[0-9]+"))
    with pytest.raises(GrammarFailedError, match="failed mid-output"):
        grammar.accept(tokenizer.encode("x", add_special_tokens=False)[0])


def test_a_grammar_that_admits_nothing_fails_on_its_first_token(manager):
    """A cycle of $refs compiles, but its mask admits only end-of-text, which the
    matcher (in error) would take: read as a finished, empty output before."""
    grammar = manager.new_request(SO(json={
        "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}))
    rows, words = manager.masks([req(grammar)])
    assert [t for t in range(V) if int(words[0, t // 32]) >> (t % 32) & 1] == list(EOS)
    with pytest.raises(GrammarFailedError, match="no token can continue") as e:
        grammar.accept(EOS[0])
    assert "<state>" not in str(e.value) and "NoExtensionBias" not in str(e.value)


def test_missing_backend_names_the_extra(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails
    fresh = StructuredOutputManager(tokenizer, V, EOS)
    with pytest.raises(ValueError, match=r"tandem\[structured\]"):
        fresh.new_request(SO(regex="a+"))


def test_sampler_applies_the_grammar_mask_to_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    ok = [7, 123, 999]
    allow = torch.zeros(2, 1000, dtype=torch.bool)
    allow[:, ok] = True
    banned = pack(allow)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0)]
    greedy = SamplingMetadata.build(params[:2], None, [[]] * 2, [[]] * 2, [], 1000)
    assert greedy.argmax_only
    greedy.grammar_mask = (torch.tensor([1]), banned[:1])
    assert not greedy.argmax_only  # a masked greedy row cannot take the raw argmax
    meta = SamplingMetadata.build(params, None, [[]] * 3, [[]] * 3, [], 1000)
    meta.grammar_mask = (torch.tensor([1, 2]), banned)
    for _ in range(20):
        out = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert out[0] == int(logits[0].argmax()) and out[1] in ok and out[2] in ok
    assert out[1] == max(ok, key=lambda t: logits[1, t])


def test_compiled_schema_closes_what_lists_its_properties():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object"}},
              "$defs": {"D": {"properties": {"x": {}}, "additionalProperties": True}},
              "items": [{"properties": {"y": {}}, "patternProperties": {"^z": {}}}],
              "allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}],
              "anyOf": [{"allOf": [{"properties": {"r": {"properties": {}}}}]}]}
    got = compiled_schema(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]["b"]  # any object
    assert got["$defs"]["D"]["additionalProperties"] is True  # said: kept
    assert "additionalProperties" not in got["items"][0]  # pattern keys allowed
    assert all("additionalProperties" not in part for part in got["allOf"])
    only = got["anyOf"][0]["allOf"][0]  # a lone allOf part is the schema itself
    assert only["additionalProperties"] is False
    assert only["properties"]["r"]["additionalProperties"] is False
    assert schema["properties"]["a"] == {"type": "object", "properties": {}}  # not modified
    # Data is not schema: a const, an enum's values and a property named "properties".
    data = {"type": "object", "properties": {
        "c": {"const": {"properties": {"x": 1}}}, "e": {"enum": [{"properties": {}}]},
        "properties": {"type": "string"}}}
    got = compiled_schema(data)
    assert got["properties"]["c"] == data["properties"]["c"]
    assert got["properties"]["e"] == data["properties"]["e"]
    assert set(got["properties"]) == {"c", "e", "properties"}


def test_a_grammar_inside_a_think_block_waits_for_its_end(manager, tokenizer):
    """reasoning="inside": no mask while the block is open, the grammar's from the token
    after ``</think>`` (several tokens in SmolLM2's vocabulary, found in the text)."""
    grammar = manager.new_request(SO(choice=["yes", "no"], reasoning="inside"))
    assert manager.masks([req(grammar)]) is None
    for t in tokenizer.encode("I think </thi", add_special_tokens=False):
        assert not grammar.accept(t) and grammar.phase == "thinking"
    *first_part, last = tokenizer.encode("nk>", add_special_tokens=False)
    for t in first_part:
        assert not grammar.accept(t) and grammar.phase == "thinking"
    assert not grammar.accept(last) and grammar.phase == "grammar"
    first = allowed(manager.masks([req(grammar)]), 0)
    assert all("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t]))
               for t in first)


def test_a_token_that_ends_the_tag_and_goes_on_is_banned(manager, tokenizer):
    """After "</think" a token ">." would start the answer with text the grammar never
    saw: while the output ends with a start of the tag, such tokens are masked; ">"
    and ">\n" (whitespace, which the answer drops) stay allowed."""
    grammar = manager.new_request(SO(choice=["yes", "no"], reasoning="inside"))
    for t in tokenizer.encode("I think </think", add_special_tokens=False):
        grammar.accept(t)
    assert grammar.phase == "thinking" and grammar.pending == "</think"
    ok = allowed(manager.masks([req(grammar)]), 0)
    vocab = tokenizer.backend.get_vocab()
    assert vocab[">"] in ok and vocab["the"] in ok and vocab["Ċ"] in ok
    assert tokenizer.encode(">.", add_special_tokens=False)[0] not in ok
    grammar.accept(vocab[">"])
    assert grammar.phase == "grammar" and grammar.pending == ""


def test_a_first_token_may_open_a_block_where_think_is_one_token(tokenizer):
    """reasoning="may_open": the first mask admits <think> (one token in Qwen3's and
    DeepSeek-R1's vocabularies) beside the grammar's tokens; taking it starts the
    block, taking a grammar token starts the grammar. Where <think> is several
    tokens (SmolLM2's own vocabulary) the grammar applies from the first token."""
    assert StructuredOutputManager(tokenizer, V, EOS).new_request(
        SO(choice=["yes"], reasoning="may_open")).phase == "grammar"
    hf = Tokenizer.from_dir(resolve_model(None, "auto").dir)._hf
    hf.add_tokens(["<think>", "</think>"])
    thinker = Tokenizer(hf)
    manager = StructuredOutputManager(thinker, V + 2, EOS)
    think, close = thinker.encode("<think></think>", add_special_tokens=False)
    vocab = thinker.backend.get_vocab()

    grammar = manager.new_request(SO(choice=["yes", "no"], reasoning="may_open"))
    first = allowed(manager.masks([req(grammar)]), 0, V + 2)
    assert think in first and vocab["y"] in first and close not in first
    assert not grammar.accept(think) and grammar.phase == "thinking"
    assert manager.masks([req(grammar)]) is None
    assert not grammar.accept(vocab["y"]) and not grammar.accept(close)
    assert grammar.phase == "grammar"
    assert think not in allowed(manager.masks([req(grammar)]), 0, V + 2)
    assert not grammar.accept(vocab["n"]) and grammar.accept(vocab["o"])  # "no", complete

    answers = manager.new_request(SO(choice=["yes", "no"], reasoning="may_open"))
    assert not answers.accept(vocab["y"]) and answers.phase == "grammar"
    assert answers.accept(vocab["es"])


def test_reasoning_is_inside_may_open_or_none():
    with pytest.raises(ValueError, match="structured_outputs.reasoning must be one of"):
        SO(regex="a", reasoning="after")


@pytest.mark.parametrize("regex,want", [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"[\d_]+", "[[:digit:]_]+"),
    (r"[^\d]\D", "[^[:digit:]][^0-9]"),
    (r"\\d\.", r"\\d\."),  # an escaped backslash, then d
    (r"[]\d]", "[][:digit:]]"),
    (r"[[:alpha:]\d]", "[[:alpha:][:digit:]]"),
])
def test_ascii_digits(regex, want):
    assert ascii_digits(regex) == want


def test_a_digit_is_an_ascii_digit(manager, tokenizer):
    r"""\d admits the ten ASCII digits, in a regex and in a JSON schema's pattern (as
    ECMA-262 and xgrammar read it), not Unicode's digit class (llguidance's:
    the default model answered \d{3}-\d{4} with U+1FBF8, byte token by token)."""
    def first_tokens(spec):
        _, words = manager.masks([req(manager.new_request(spec))])
        return {t for t in range(V) if int(words[0, t // 32]) >> (t % 32) & 1}

    digits = {tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    assert first_tokens(SO(regex=r"\d")) == digits
    assert compiled_schema({"properties": {"a": {"pattern": r"^\d+$"}}, "patternProperties": {
        r"^x\d$": {}}}) == {"properties": {"a": {"pattern": "^[0-9]+$"}},
                            "patternProperties": {"^x[0-9]$": {}}}  # open: patternProperties
    assert first_tokens(SO(regex=r"[\d_]")) == digits | {
        tokenizer.encode("_", add_special_tokens=False)[0]}


def test_the_item_scanner_reads_items_whatever_they_hold():
    s = ItemScanner()
    assert s.feed(b'[{"a": "x}]"}, "s\\"],", 1') and s.items == [b'{"a": "x}]"}', b'"s\\"],"']
    assert s.cur == b"1" and s.on_track() == []
    assert s.feed(b"2, [1, {}], 12") and s.items[2:] == [b"12", b"[1, {}]"]
    assert not s.copy().feed(b"]")  # "12" again, ended by the array's close
    assert s.copy().feed(b"3]")
    assert not s.copy().feed(b', [1, {}]')  # an object or list repeats once it closes


def walk(manager, tokenizer, schema, text):
    """A request of ``schema`` that has taken ``text``; the decoded texts its mask allows."""
    grammar = manager.new_request(SO(json=schema))
    for t in tokenizer.encode(text, add_special_tokens=False):
        grammar.accept(t)
    return grammar, {tokenizer.decode([t]) for t in allowed(manager.masks([req(grammar)]), 0)}


UNITS = {"type": "array", "uniqueItems": True,
         "items": {"type": "string", "enum": ["c", "f"]}}


def test_unique_items_bans_completing_a_copy_and_steers_off_dead_ends(manager, tokenizer):
    _, texts = walk(manager, tokenizer, UNITS, '["c", "')
    assert texts and all(t.startswith("f") for t in texts), texts  # "c" again: banned
    _, texts = walk(manager, tokenizer, UNITS, '["c", "f"')
    # ", " could only lead to a third unit, a copy: the array must close
    assert texts and all(t.startswith("]") for t in texts), texts
    _, texts = walk(manager, tokenizer, {k: v for k, v in UNITS.items() if k != "uniqueItems"},
                    '["c", "')
    assert any(t.startswith("c") for t in texts)  # without the key, llguidance's own mask


def test_unique_tool_calls_steer_the_last_free_choice(manager, tokenizer):
    call = {"type": "object", "properties": {
        "name": {"enum": ["w"]}, "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"]}}, "required": ["name", "arguments"]}
    schema = {"type": "array", "uniqueItems": True, "items": call}
    first = '[{"name": "w", "arguments": {"city": "Oslo", "unit": "c"}}, '
    _, texts = walk(manager, tokenizer, schema, first + '{"name": "w", "arguments": '
                    '{"city": "Oslo", "unit": "')
    assert texts and all(t.startswith("f") for t in texts), texts
    _, texts = walk(manager, tokenizer, schema, first + '{"name": "w", "arguments": '
                    '{"city": "Os')
    assert any(t.startswith("lo") for t in texts)  # "Oslo" with "f" is still a new call


def test_unique_items_never_empties_a_mask(manager, tokenizer):
    schema = {"type": "array", "uniqueItems": True, "minItems": 2, "items": {"const": "x"}}
    _, texts = walk(manager, tokenizer, schema, '["x", ')
    assert texts and all(t.startswith('"') for t in texts)  # the grammar asks for a copy


@pytest.mark.parametrize("tag,words", [
    ({"triggers": [], "structures": [{"begin": "<a>", "schema": {}, "end": ""}]}, "triggers"),
    ({"triggers": ["<a>"], "structures": []}, "structures must"),
    ({"triggers": ["<a>"], "structures": [{"begin": "<a>", "end": ""}]}, "structures[0] needs"),
    ({"triggers": ["<a>"], "structures": [{"begin": "<b>", "schema": {}, "end": ""}]},
     "none of the triggers"),
    ("{", "not valid JSON"),
])
def test_a_structural_tag_of_the_wrong_shape_is_refused(tag, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SO(structural_tag=tag)


def test_a_structural_tag_leaves_text_free_and_constrains_from_its_trigger(manager, tokenizer):
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
              "required": ["unit"]}
    tag = {"triggers": ["<call>"], "structures": [
        {"begin": '<call>{"name": "w", "arguments": ', "schema": schema, "end": "}</call>"}]}
    grammar = manager.new_request(SO(structural_tag=tag))
    assert len(allowed(manager.masks([req(grammar)]), 0)) > V - 200  # free text
    for t in tokenizer.encode('Sure. <call>{"name": "w", "arguments": {"unit": "',
                              add_special_tokens=False):
        grammar.accept(t)
    texts = {tokenizer.decode([t]) for t in allowed(manager.masks([req(grammar)]), 0)}
    assert texts == {"c", "f"}
