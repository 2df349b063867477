"""StructuredOutputManager: compile once per spec, errors naming the field, the
step's token masks, termination; the sampler
applying a grammar mask to greedy and random rows."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llguidance")

from tandem.model.loader import resolve_model  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tandem.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402
from tandem.worker.sampler import Sampler, SamplingMetadata  # noqa: E402
from tandem.worker.structured_output import StructuredOutputManager, spec_key  # noqa: E402

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


def allowed(mask, row: int) -> set[int]:
    rows, banned = mask
    assert banned.shape == (len(rows), V) and banned.dtype == torch.uint8
    return set((banned[row] == 0).nonzero().squeeze(1).tolist())


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
])
def test_a_spec_that_does_not_compile_names_its_field(manager, spec, field):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} cannot be compiled"):
        manager.new_request(spec)
    assert not manager._grammars  # nothing cached for it


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
    with pytest.raises(RuntimeError, match="broke the grammar"):
        grammar.accept(tokenizer.encode("x", add_special_tokens=False)[0])


def test_missing_backend_names_the_extra(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails
    fresh = StructuredOutputManager(tokenizer, V, EOS)
    with pytest.raises(ValueError, match=r"tandem\[structured\]"):
        fresh.new_request(SO(regex="a+"))


def test_sampler_applies_the_grammar_mask_to_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    ok = [7, 123, 999]
    banned = torch.ones(2, 1000, dtype=torch.uint8)
    banned[:, ok] = 0
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
