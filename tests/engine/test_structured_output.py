"""Structured outputs through the engine, on the real default model: every
constrained output matches its spec, whatever sampling, batching, chunking,
prefix caching or preemption did; unconstrained requests are untouched."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tandem import LLM, AsyncEngine, SamplingParams  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.sampling_params import StructuredOutputsParams as SO  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="128MiB")


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON: name, age, favourite color."}])


def json_params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 80)
    return SamplingParams(structured_outputs=SO(json=SCHEMA), **kw)


def assert_valid(out) -> dict:
    c = out.outputs[0]
    assert c.finish_reason == "stop", (c.finish_reason, c.text)
    doc = json.loads(c.text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_json_schema_at_temperature_1_is_valid_for_20_seeds(llm, prompt):
    outs = llm.generate([prompt] * 20, [json_params(temperature=1.0, seed=s) for s in range(20)])
    docs = [assert_valid(o) for o in outs]
    assert len({json.dumps(d) for d in docs}) > 1  # sampled, not one forced answer
    # The grammar ended each one: the last token is the closing brace, no EOS needed.
    assert all(o.outputs[0].text.endswith("}") for o in outs)


def test_regex_choice_json_object_and_grammar(llm, prompt):
    specs = [SO(regex=r"[0-9]{3}-[0-9]{4}"), SO(choice=["yes", "no", "maybe"]),
             SO(json_object=True), SO(grammar='start: "The answer is " ("yes" | "no") "."')]
    outs = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=7, max_tokens=60,
                                                      structured_outputs=s) for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[0])
    assert texts[1] in ("yes", "no", "maybe")
    assert isinstance(json.loads(texts[2]), dict)
    assert texts[3] in ("The answer is yes.", "The answer is no.")


def test_greedy_constrained_rows_beside_plain_greedy_rows(llm, prompt):
    """Plain greedy rows keep the C++ step's argmax; constrained greedy rows go
    through the masked sampler; the plain rows' ids do not change."""
    assert llm.engine.runner.decode_step is not None  # the argmax path is in play
    plain = [SamplingParams(temperature=0, max_tokens=24) for _ in range(3)]
    alone = llm.generate([prompt, "The capital of France is", "1, 2, 3,"], plain)
    constrained = json_params(temperature=0)
    mixed = llm.generate(
        [prompt, prompt, "The capital of France is", prompt, "1, 2, 3,"],
        [plain[0], constrained, plain[1], json_params(temperature=0.8, seed=3), plain[2]])
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2], mixed[4])] == \
        [o.outputs[0].token_ids for o in alone]
    greedy_doc = assert_valid(mixed[1])
    assert_valid(mixed[3])
    assert assert_valid(llm.generate(prompt, constrained)[0]) == greedy_doc


def test_max_tokens_first_is_length_never_stop(llm, prompt):
    out = llm.generate(prompt, json_params(temperature=0, max_tokens=5))[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(c.text)  # cut short, not closed


def test_same_seed_same_output_and_n2_fan_out(llm, prompt):
    """n=2 as the server fans it out: one spec object, two requests (seed, seed + 1),
    each with its own matcher; each equals its own run alone."""
    spec = SO(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=80,
                             structured_outputs=spec) for i in range(2)]
    pair = llm.generate([prompt, prompt], params)
    for out, p in zip(pair, params):
        assert_valid(out)
        assert llm.generate(prompt, p)[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert pair[0].outputs[0].token_ids != pair[1].outputs[0].token_ids


def test_preemption_chunked_prefill_and_prefix_hits_keep_json_valid(prompt):
    """A tiny pool (preemption by recompute), a small token budget (prompts in
    chunks) and a repeated prompt (prefix-cache hits) under one workload."""
    bytes_per_block = 2 * 30 * 3 * 64 * 2 * 16  # fp16 KV, 30 layers, 3 KV heads x 64, 16 slots
    llm = LLM(kv_cache_memory=7 * bytes_per_block, max_model_len=112,
              max_num_batched_tokens=32)
    params = [json_params(temperature=1.0, seed=s, max_tokens=60) for s in range(4)]
    outs = llm.generate([prompt] * 4, params)
    sched, kv = llm.engine.scheduler, llm.engine.kv_manager
    assert sched.num_preemptions > 0 and kv.prefix_cache_hits > 0
    assert sum(o.metrics.num_preemptions for o in outs) == sched.num_preemptions
    for o in outs:
        assert_valid(o)


def test_bad_spec_is_a_value_error_naming_the_field_before_queueing(llm):
    engine = llm.engine
    for spec, field in ((SO(json={"type": "no-such-type"}), "structured_outputs.json"),
                        (SO(regex="(unclosed"), "structured_outputs.regex"),
                        (SO(grammar="start: undefined_rule"), "structured_outputs.grammar")):
        with pytest.raises(ValueError, match=re.escape(field)):
            engine.add_request([1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests() and not engine.requests


def test_async_engine_compiles_off_the_loop_and_rejects_bad_specs(llm, prompt, monkeypatch):
    engine = AsyncEngine(engine=llm.engine)
    manager = llm.engine.structured_output
    compiled_in = []

    def recording(spec, new_request=manager.new_request):
        compiled_in.append(threading.current_thread())
        return new_request(spec)

    monkeypatch.setattr(manager, "new_request", recording)

    async def main():
        outs = [o async for o in engine.generate(prompt, json_params(temperature=0))]
        with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
            async for _ in engine.generate(prompt, SamplingParams(
                    structured_outputs=SO(regex="a{2,1}"))):
                pass
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert_valid(outs[-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].outputs[0].text
    assert len(compiled_in) == 2 and threading.main_thread() not in compiled_in  # the loop's


# Schemas that compile but whose grammar fails mid-output: llguidance's parser
# limit (a property that refers to the whole schema), a regex past its lexer's
# limit, and a cycle of $refs (no finite instance: no token is ever admitted).
FAILING = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "string", "pattern": "^(a{998}){1000}$"},
    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
]


@pytest.mark.parametrize("schema", FAILING, ids=["parser-limit", "lexer-limit", "ref-cycle"])
def test_a_failing_grammar_ends_its_own_request_only(llm, prompt, schema):
    """Such a request finishes "error" (the failure logged) in its first steps;
    the unconstrained and constrained requests in the same steps finish as if it
    had not been there. (A failing grammar raised out of the step: the engine
    loop failed every request in flight, each told the other's grammar.)"""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(2):  # the second time from the grammar cache
        outs = llm.generate([prompt] * 3, [
            plain, SamplingParams(structured_outputs=SO(json=schema), max_tokens=24),
            json_params(temperature=0)])
        assert outs[1].outputs[0].finish_reason == "error"
        assert outs[0].outputs[0].finish_reason == "length"
        assert len(outs[0].outputs[0].token_ids) == 24
        assert_valid(outs[2])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.usage == 0


def test_async_engine_raises_a_failing_grammar_to_its_caller_only(llm, prompt):
    engine = AsyncEngine(engine=llm.engine)

    async def bad() -> str:
        with pytest.raises(ValueError, match="failed mid-output") as e:
            async for _ in engine.generate(prompt, SamplingParams(
                    structured_outputs=SO(json=FAILING[0]), max_tokens=24)):
                pass
        return str(e.value)

    async def good() -> list:
        return [o async for o in engine.generate(prompt, SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True))]

    async def main():
        return await asyncio.gather(bad(), good())

    try:
        message, outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs) == 16
    assert "<state>" not in message and "$ref" not in message  # no grammar dump


def test_no_tokenizer_means_no_constraint(tiny_config_path):
    engine = LLMEngine(EngineConfig(model=tiny_config_path, load_format="dummy",
                                    skip_tokenizer_init=True, kv_cache_memory="1MiB",
                                    max_model_len=64))
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=SO(regex="a+")))
