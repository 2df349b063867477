"""Tool calling over both APIs, with the official SDKs and the real default model.

SmolLM2's chat template knows no tools, so tandem hands them over as Hermes's
system prompt and reads Hermes's ``<tool_call>`` back. ``required`` and a named
function are enforced by a grammar, so the 135M model's calls always parse and
validate; ``auto`` is the model's own decision (the tests give it a history of
calls to follow, or force the text with a regex).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.server.conftest import API_KEY

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS,
                                      "description": "The current time in a time zone"}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HOT = {"temperature": 1.0, "top_p": 1.0, "extra_body": {"top_k": 0}}


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def assert_valid_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def streamed_calls(chunks) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls accumulated from OpenAI chunks, checking OpenAI's order: a call's first
    delta has id, type and name; later ones only argument fragments; one entry per call
    in a chunk."""
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        indices = [tc.index for tc in delta.tool_calls or []]
        assert len(set(indices)) == len(indices), delta.tool_calls
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    return calls, finish, content


def test_required_yields_a_valid_call_streamed_and_not(client):
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=120)
    for seed in range(4):
        choice = client.chat.completions.create(**kwargs, seed=seed, **HOT).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls)
    calls, finish, content = streamed_calls(client.chat.completions.create(
        **kwargs, seed=9, stream=True, **HOT))
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS[calls[0]["name"]])


# A pydantic model's schema: its nested models under $defs, referenced from the root.
PERSON_PARAMS = {
    "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}},
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "addr": {"$ref": "#/$defs/Addr"}},
    "required": ["name", "addr"], "additionalProperties": False,
}
# A recursive schema: "#" is the tool's own parameters.
TREE_PARAMS = {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                     "children": {"type": "array", "maxItems": 1,
                                                  "items": {"$ref": "#"}}},
    "required": ["name"], "additionalProperties": False,
}


def test_required_enforces_schemas_with_references(client):
    """References inside a tool's parameters ($defs, "#") resolve against those
    parameters, not against the list of calls the grammar wraps them in."""
    tools = [{"type": "function", "function": {"name": "save_person", "parameters": PERSON_PARAMS}},
             {"type": "function", "function": {"name": "save_tree", "parameters": TREE_PARAMS}}]
    schemas = {"save_person": PERSON_PARAMS, "save_tree": TREE_PARAMS}
    seen = set()
    for seed in range(6):
        choice = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Save Ann from Oslo"}],
            tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80,
            seed=seed, **HOT).choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        seen.add(call.function.name)
    assert seen, "every call was cut by max_tokens"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_a_stop_string_is_not_tool_calls(client, choice):
    """A stop string that cuts a forced call leaves its arguments unfinished: finish_reason
    says ``stop``, as ``length`` says it for max_tokens, never ``tool_calls``."""
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=False, max_tokens=60, temperature=0, stop=["Par"])
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop" and whole.stop_reason == "Par", whole
    assert not whole.message.tool_calls, whole  # cut inside its arguments: no call
    calls, finish, _ = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "stop"
    assert len(calls) == 1  # the stream had sent the call's start: it stays sent
    with pytest.raises(ValueError):
        json.loads(calls[0]["arguments"])


def test_forced_calls_stream_no_empty_deltas(client):
    """A forced call's grammar scaffolding ('[{"name": "') sends no chunks of its own, as
    in vLLM: every chunk between the first (the role) and the last (finish_reason) carries
    a call delta, and none carries content."""
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=120, seed=9, **HOT)
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert all(c.choices[0].delta.tool_calls for c in chunks[1:-1]), chunks
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_cut_before_its_arguments_goes_back(client):
    """A forced call that max_tokens cut before its arguments ('' as the server sent it)
    goes back in the history as a call with no arguments (vLLM reads '' as {})."""
    messages = [*ASK, {"role": "assistant", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                       max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_required_cut_before_a_name_is_no_content(client):
    """max_tokens ends a forced call before its name: the whole response says what the
    stream said, no content and no call (the grammar's '[{"name": "' is not a reply)."""
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=3, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and choice.message.tool_calls is None
    calls, finish, content = streamed_calls(client.chat.completions.create(**kwargs,
                                                                            stream=True))
    assert (calls, finish, content) == ({}, "length", "")


def test_required_with_parallel_calls(client):
    """Parallel calls (the default): a list of at least one, each call the list completed
    valid. A sampled 135M model may go on calling until max_tokens cuts the last one."""
    for seed in range(3):
        choice = client.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            max_tokens=150, **HOT).choices[0]
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None
        assert choice.finish_reason in ("tool_calls", "length")
        assert_valid_calls(calls)  # a call max_tokens cut is not among them


def test_the_oslo_loop_replays_its_own_history(client):
    """The agent's loop: a forced call that max_tokens cuts mid-arguments is left out of
    tool_calls (finish_reason still ``length``), and the history the server wrote,
    replayed with a call whose arguments are unfinished JSON, is a 200, not a 400."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.chat.completions.create(model="smollm2", messages=ask, tools=[tool],
                                       tool_choice="required", temperature=0, max_tokens=100)
    choice = r.choices[0]
    if choice.finish_reason == "length":
        for call in choice.message.tool_calls or []:
            json.loads(call.function.arguments)  # only finished calls
    cut = {"id": "call_cut", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit":'}}
    done = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [done, cut]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
               {"role": "tool", "tool_call_id": "call_cut", "content": "error: cut"}]
    again = client.chat.completions.create(model="smollm2", messages=history, tools=[tool],
                                           temperature=0, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_parallel_forced_calls_never_repeat_one(client):
    """Under ``required`` with parallel calls the grammar admits no second call with the
    name and arguments of one already made (the default model repeated a search until
    max_tokens): 100 seeds at temperature 1.0."""
    tool = {"type": "function", "function": {"name": "web_search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    ask = [{"role": "user", "content": "Search the web for the latest Python release."}]

    def calls(seed: int) -> list[tuple[str, str]]:
        choice = client.chat.completions.create(
            model="smollm2", messages=ask, tools=[tool], tool_choice="required",
            max_tokens=64, seed=seed, **HOT).choices[0]
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]

    with ThreadPoolExecutor(50) as pool:
        made = list(pool.map(calls, range(100)))
    assert all(len(set(c)) == len(c) for c in made), [c for c in made if len(set(c)) < len(c)]
    assert sum(len(c) > 1 for c in made) >= 5  # parallel calls are still made


def test_named_function_yields_that_function_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named,
                  max_tokens=60)
    for seed in range(3):
        r = client.chat.completions.create(**kwargs, seed=seed, **HOT)
        assert len(r.choices[0].message.tool_calls) == 1
        assert r.choices[0].finish_reason == "stop"  # OpenAI's, for a named choice
        assert_valid_calls(r.choices[0].message.tool_calls, names=("get_time",))
    # greedy: the stream carries the same call as the whole response
    whole = client.chat.completions.create(**kwargs, temperature=0).choices[0].message
    streamed, finish, _ = streamed_calls(client.chat.completions.create(
        **kwargs, temperature=0, stream=True))
    assert finish == "stop" and list(streamed) == [0]
    assert streamed[0]["name"] == "get_time"
    assert streamed[0]["arguments"] == whole.tool_calls[0].function.arguments
    # the SDK's own accumulator assembles the same call from the chunks
    with client.chat.completions.stream(**kwargs, temperature=0) as s:
        [call] = s.get_final_completion().choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == \
        ("get_time", whole.tool_calls[0].function.arguments)


def test_two_turn_round_trip(client):
    """call -> the caller runs it -> its result goes back -> the final answer."""
    first = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    final = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=40, temperature=0)
    answer = final.choices[0].message
    assert answer.tool_calls is None and answer.content
    assert final.choices[0].finish_reason in ("stop", "length")
    # the call and its result reached the prompt (Hermes's text for this template)
    ids = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                     headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"messages": ASK}).json()["count"]
    assert final.usage.prompt_tokens > first.usage.prompt_tokens > ids


def test_auto_parses_hermes_calls_and_leaves_text_as_content(client):
    """auto: a <tool_call> the model writes (here forced by a regex) is a tool call, with
    the text before it as content; text without one stays content."""
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    regex = r"Checking\.\n<tool_call>\n" + call.replace("{", r"\{").replace("}", r"\}") \
        + r"\n</tool_call>"
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="auto",
                  max_tokens=80, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert message.content == "Checking." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    calls, finish, content = streamed_calls(client.chat.completions.create(**kwargs,
                                                                            stream=True))
    assert content == "Checking." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [("get_weather", '{"city": "Oslo", "unit": "celsius"}')]
    plain = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                           max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


STRICT_TOOLS = [{"type": "function", "function": {**t["function"], "strict": True}}
                for t in TOOLS]


def _weather_call(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]}


# Two turns answered by calls: the default model follows with a call of its own.
FOLLOW = [{"role": "user", "content": "Weather in Oslo?"}, _weather_call(1, "Oslo"),
          {"role": "user", "content": "Weather in Rome?"}, _weather_call(2, "Rome"),
          {"role": "user", "content": "Weather in Paris?"}]


def test_strict_tools_under_auto_call_only_valid_arguments(client):
    """strict tools under auto: once the model opens a call, its name is a tool's and its
    arguments follow that tool's schema (50 seeds at temperature 1); text stays free.
    Unconstrained, one of these 50 opened a <tool_call> with no name, left as content."""
    def choice(seed: int, messages: list[dict]):
        return client.chat.completions.create(
            model="smollm2", messages=messages, tools=STRICT_TOOLS, tool_choice="auto",
            max_tokens=80, seed=seed, **HOT).choices[0]

    with ThreadPoolExecutor(16) as pool:
        made = list(pool.map(lambda s: choice(s, FOLLOW), range(50)))
        free = list(pool.map(lambda s: choice(s, ASK), range(8)))
    calls = [c for ch in made for c in ch.message.tool_calls or []]
    assert len(calls) >= 40
    assert_valid_calls(calls)
    assert not any("<tool_call>" in (ch.message.content or "") for ch in made)
    assert any(ch.message.content and not ch.message.tool_calls for ch in free)


def test_a_response_format_beside_strict_tools_under_auto_wins(client):
    """Both cannot hold: the response format the client asked for is the constraint,
    as OpenAI lets the two be sent together (no 400)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    r = client.chat.completions.create(model="smollm2", messages=FOLLOW, tools=STRICT_TOOLS,
                                       response_format=fmt, max_tokens=20, temperature=0)
    assert json.loads(r.choices[0].message.content) in ({"ok": True}, {"ok": False})


def _forced(text: str) -> dict:
    """A structured_outputs regex that makes the model write exactly ``text``."""
    return {"structured_outputs": {"regex": re.escape(text)}}


@pytest.mark.parametrize("text,content,names", [
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, []),  # unknown
    ('<tool_call>{"name": "get_time", "arguments": "Paris"}</tool_call>', None, []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', None, []),  # unclosed
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
     '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>', "", ["get_time"]),
])
def test_auto_streams_only_the_calls_the_whole_response_holds(client, text, content, names):
    """auto: what the model chose to write is checked before it is sent, so the stream and
    the whole response agree; parallel_tool_calls false keeps the first call."""
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="auto",
                  parallel_tool_calls=False, max_tokens=80, temperature=0,
                  extra_body=_forced(text))
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, finish, streamed = streamed_calls(client.chat.completions.create(**kwargs,
                                                                            stream=True))
    want = text if content is None else content
    assert (whole.message.content or "") == streamed == want
    assert [c.function.name for c in whole.message.tool_calls or []] == names
    assert [c["name"] for c in calls.values()] == names
    assert whole.finish_reason == finish == ("tool_calls" if names else "stop")


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "Field required"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "dictionary"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "x"}}}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "type 'object'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tools", "both constrain"),
])
def test_bad_tools_are_a_400_naming_the_field(real_server, body, param, words):
    r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                   json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


# ------------------------------------------------------------------ Ollama
@pytest.fixture(scope="module")
def ollama_client(real_server) -> ollama.Client:
    return ollama.Client(host=real_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=120)


def _earlier_call(city: str) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "get_weather",
                                         "arguments": {"city": city, "unit": "celsius"}}}]}


# Two earlier turns in which the assistant called get_weather: the model (greedy)
# follows them and calls it for London too, in Hermes's format.
HISTORY = [{"role": "user", "content": "Weather in Paris?"}, _earlier_call("Paris"),
           {"role": "user", "content": "Weather in Rome?"}, _earlier_call("Rome"),
           {"role": "user", "content": "Weather in London?"}]


def test_ollama_tools_streamed_and_not(ollama_client):
    opts = {"temperature": 0, "num_predict": 60}
    r = ollama_client.chat(model="smollm2", messages=HISTORY, tools=TOOLS, options=opts)
    assert r.done_reason == "stop" and r.message.content == ""
    calls = r.message.tool_calls
    assert [(c.function.name, c.function.arguments["city"]) for c in calls] == \
        [("get_weather", "London")]
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER_PARAMS)
    parts = list(ollama_client.chat(model="smollm2", messages=HISTORY, tools=TOOLS,
                                    options=opts, stream=True))
    with_calls = [p for p in parts if p.message.tool_calls]
    assert len(with_calls) == 1  # whole, once
    assert [c.function for c in with_calls[0].message.tool_calls] == \
        [c.function for c in calls]
    assert "".join(p.message.content for p in parts) == ""
    assert parts[-1].done and parts[-1].eval_count == len(parts)


def test_ollama_tool_calls_have_an_id_and_index(real_server):
    """Current Ollama's call fields (the SDK this suite pins predates them); a tool
    without its "type", which Ollama does not require."""
    untyped = [{"function": t["function"]} for t in TOOLS]
    r = httpx.post(f"{real_server.url}/api/chat", headers=real_server.headers, timeout=60,
                   json={"model": "smollm2", "messages": HISTORY, "tools": untyped,
                         "stream": False, "options": {"temperature": 0, "num_predict": 60}})
    [call] = r.json()["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["index"] == 0


def test_ollama_tool_result_round_trip(ollama_client):
    messages = [*HISTORY[:1], _earlier_call("Paris"),
                {"role": "tool", "tool_name": "get_weather", "content": "31 degrees, sunny"}]
    r = ollama_client.chat(model="smollm2", messages=messages, tools=TOOLS,
                           options={"temperature": 0, "num_predict": 30})
    assert r.message.content and not r.message.tool_calls
    assert r.prompt_eval_count > 0
    # The call's id as /api/chat returned it, and the result naming it, go back too.
    messages[1]["tool_calls"][0]["id"] = "call_1"
    messages[2]["tool_call_id"] = "call_1"
    again = ollama_client.chat(model="smollm2", messages=messages, tools=TOOLS,
                               options={"temperature": 0, "num_predict": 30})
    assert again.message.content == r.message.content


def test_ollama_loop_replays_its_own_history(real_server):
    """/api/chat's own assistant messages go back as the agent appends them: a whole call
    (with its id and index), and one cut by num_predict; arguments as a string stay a 400,
    as Ollama's (its arguments are objects)."""
    def chat(messages: list[dict], num_predict: int) -> httpx.Response:
        return httpx.post(f"{real_server.url}/api/chat", headers=real_server.headers,
                          timeout=60, json={"model": "smollm2", "messages": messages,
                                            "tools": TOOLS, "stream": False,
                                            "options": {"temperature": 0,
                                                        "num_predict": num_predict}})

    for num_predict in (60, 12):  # 12: cut inside the call's arguments
        r = chat(HISTORY, num_predict)
        assert r.status_code == 200, r.text
        message = r.json()["message"]
        assert r.json()["done_reason"] == ("stop" if num_predict == 60 else "length")
        result = {"role": "tool", "tool_name": "get_weather", "content": "12 C, rain"}
        again = chat([*HISTORY, message, result], 8)
        assert again.status_code == 200, again.text
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"'}}]}
    r = chat([*HISTORY[:1], bad], 8)
    assert r.status_code == 400 and "arguments" in r.json()["error"], r.text


def test_ollama_malformed_tools_are_a_400(real_server):
    r = httpx.post(f"{real_server.url}/api/chat", headers=real_server.headers, timeout=60,
                   json={"model": "smollm2", "messages": ASK, "stream": False,
                         "tools": [{"type": "function", "function": {"description": "x"}}]})
    assert r.status_code == 400 and "tools[0].function.name" in r.json()["error"], r.text
