"""Structured outputs over HTTP, driven by the official SDKs against the real default model:
OpenAI's response_format (json_object, json_schema, a pydantic model through
``chat.completions.parse``), vLLM's structured_outputs, Ollama's format.

Sampling at temperature 1 with no top-k/top-p: whatever the 135M model would
write, the grammar leaves it only text that matches.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import API_KEY

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
HOT = {"temperature": 1.0, "top_p": 1.0, "extra_body": {"top_k": 0}}  # no filtering at all


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=50_000_000)
    capital: bool


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def test_json_schema_holds_for_20_of_20_seeds(client):
    """n=20 fans out to seeds 0..19, sampled together; every choice validates."""
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, n=20, seed=0, max_tokens=80, **HOT,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert len(r.choices) == 20
    texts = [c.message.content for c in r.choices]
    for c, text in zip(r.choices, texts):
        assert c.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1  # sampled, not one forced string


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Tell me about Paris."}],
        response_format=City, max_tokens=60, seed=3, **HOT)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 50_000_000


def test_json_object_streamed_is_one_json_object(client):
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=120, seed=5, stream=True, **HOT,
        response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.lstrip().startswith("{")


def test_vllm_structured_outputs_choice_regex_and_grammar(client):
    for seed in range(6):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Is the sea wet?"}],
            max_tokens=5, seed=seed, **{**HOT, "extra_body": {
                "top_k": 0, "structured_outputs": {"choice": ["yes", "no", "maybe"]}}})
        assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.completions.create(
        model="smollm2", prompt="My phone number is", max_tokens=20, seed=1,
        temperature=1.0, extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}})
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text)
    r = client.completions.create(
        model="smollm2", prompt="Answer:", max_tokens=10, seed=2, temperature=1.0,
        extra_body={"structured_outputs": {"grammar": 'start: "A" | "B" "C"'}})
    assert r.choices[0].text in ("A", "BC")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_vllm_older_guided_fields_constrain(real_server, route):
    """guided_choice / guided_regex / guided_json / guided_grammar, which older
    vLLM servers took and clients still send, constrain as structured_outputs
    does (they were ignored: free text an agent took for constrained)."""
    body = {"messages": ASK} if route == "chat" else {"prompt": "Colour:"}
    cases = [({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
             ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
             ({"guided_json": PERSON},
              lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
             ({"guided_grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no"))]
    for fields, ok in cases:
        r = httpx.post(f"{real_server.url}/v1/{route.replace('chat', 'chat/completions')}",
                       headers=real_server.headers, timeout=60,
                       json={**body, "max_tokens": 60, "temperature": 1.0, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        assert choice["finish_reason"] == "stop" and ok(text), (fields, text)
    r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                   json={"messages": ASK, "guided_choice": ["a"],
                         "structured_outputs": {"regex": "a"}}, timeout=60)
    assert r.status_code == 400 and "guided_" in r.json()["error"]["message"]


def test_completions_take_response_format(client):
    r = client.completions.create(
        model="smollm2", prompt="A person:", max_tokens=80, seed=4, temperature=1.0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_text_format_is_unconstrained(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4,
                                       temperature=0, response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_constraint_is_a_400_naming_the_field(real_server, body, param, stream):
    r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                   json={"messages": ASK, "max_tokens": 4, "stream": stream, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err


def test_a_grammar_failing_mid_output_is_its_own_400(real_server, client):
    """A property referring to the whole schema compiles, then exceeds llguidance's
    parser limit at the first token: a 400 naming the field, without the
    grammar engine's state dump, while a stream beside it goes on to its end
    (such a request failed every request in flight, telling each its grammar)."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=24, stream=True, temperature=0,
        extra_body={"ignore_eos": True})
    first = next(iter(stream))
    r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                   json={"messages": ASK, "max_tokens": 8, "response_format": {
                       "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                   timeout=60)
    chunks = [first, *stream]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema"
    assert "failed mid-output" in err["message"] and "<state>" not in err["message"]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def ollama_client(real_server) -> ollama.Client:
    return ollama.Client(host=real_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=120)


def test_ollama_format_schema_and_json(ollama_client):
    r = ollama_client.chat(model="smollm2", messages=ASK, format=PERSON,
                           options={"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 7,
                                    "num_predict": 80})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), PERSON)
    parts = list(ollama_client.generate(model="smollm2", prompt="Describe a cat as JSON.",
                                        format="json", stream=True,
                                        options={"temperature": 1.0, "seed": 8,
                                                 "num_predict": 120}))
    text = "".join(p.response for p in parts)
    assert text.lstrip().startswith("{")
    if parts[-1].done_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_schema_silent_on_other_keys_gets_none(ollama_client):
    """A pydantic model's schema (what Ollama's docs pass as format) never says
    additionalProperties: its objects are closed, as Ollama and vLLM compile
    them, so no sampled seed adds a key."""
    class Pet(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=30)

    schema = Pet.model_json_schema()
    assert "additionalProperties" not in schema
    for seed in range(4):
        r = ollama_client.chat(model="smollm2", messages=[{"role": "user", "content": "A pet?"}],
                               format=schema, options={"temperature": 1.0, "top_k": 0,
                                                       "seed": seed, "num_predict": 60})
        assert r.done_reason == "stop", r.message.content
        assert set(json.loads(r.message.content)) == {"name", "age"}


def test_a_tool_without_parameters_is_called_with_none(client):
    """OpenAI: a function without parameters has an empty parameter list."""
    tools = [{"type": "function", "function": {"name": "now", "description": "current time"}}]
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What time is it?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "now"}}, max_tokens=40, **HOT)
    assert [c.function.arguments for c in r.choices[0].message.tool_calls] == ["{}"]


@pytest.mark.parametrize("fmt,words", [("yaml", 'format must be "json"'),
                                       ({"type": "nope"}, "format")])
def test_ollama_bad_format_is_a_400(real_server, fmt, words):
    r = httpx.post(f"{real_server.url}/api/chat", headers=real_server.headers, timeout=60,
                   json={"model": "smollm2", "messages": ASK, "format": fmt, "stream": False})
    assert r.status_code == 400 and words in r.json()["error"], r.text
