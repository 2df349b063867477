"""Agent frameworks' own tool loops against `tandem serve` on the default model, as a user
wires them: the openai-agents SDK (over chat completions and over Responses) and
LangChain's ``create_agent``, each non-streamed and streamed.

A 135M model may answer badly; the protocol may not break. Each loop must end in a final
answer (a string) with no exception, after a tool call whose result the framework sent
back in its next request. The first turn forces a call (tool_choice "required"), so the
loop does not hang on the model's whim; later turns are "auto", as each framework does.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator

import httpx
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, AIMessageChunk, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

from tests.serving import serve_cli

TASK = "What is the weather in Oslo?"
INSTRUCTIONS = "Use the tools to answer."
MAX_TOKENS = 96  # a call and a short answer; the loop, not the prose, is under test

# (tool name, the string it returned), in call order; emptied before each test
CALLS: list[tuple[str, str]] = []


def get_weather(city: str) -> str:
    """The current weather in a city."""
    result = f"Sunny, 21 C in {city}."
    CALLS.append(("get_weather", result))
    return result


def get_time(city: str) -> str:
    """The local time in a city."""
    result = f"It is 14:05 in {city}."
    CALLS.append(("get_time", result))
    return result


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(url, model name): `tandem serve` on the default model, its log in a file (a full
    pipe would block it). A small KV pool: the default one's first commit would be most
    of the module's time, and these loops need a few hundred tokens."""
    log = (tmp_path_factory.mktemp("agents") / "serve.log").open("w")
    proc, url = serve_cli(["--kv-cache-memory", "64MiB", "--max-model-len", "2048",
                           "--no-access-log"], timeout=180, output=log)
    try:
        (model,) = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        yield url, model
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()
            log.close()


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    CALLS.clear()


def _strings(value) -> Iterator[str]:
    """Every string inside a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _assert_loop_closed(bodies: list[dict], stream: bool) -> None:
    """A tool ran, its result went back to the server, and every request streamed (or
    not) as asked."""
    assert CALLS, "no tool was called"
    assert len(bodies) >= 2, bodies  # the call, then the turn with its result
    assert all(bool(b.get("stream")) is stream for b in bodies), bodies
    sent_back = list(_strings(bodies[-1]))
    assert any(result in s for _, result in CALLS for s in sent_back), (CALLS, bodies[-1])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_loop(server, api: str, stream: bool):
    url, model_name = server
    bodies: list[dict] = []

    async def record(request: httpx.Request) -> None:
        bodies.append(json.loads(request.content))

    async def run():
        http = httpx.AsyncClient(timeout=120, event_hooks={"request": [record]})
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
        model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        agent = Agent(
            name="weather", instructions=INSTRUCTIONS,
            tools=[function_tool(get_weather), function_tool(get_time)],
            model=model_class(model=model_name, openai_client=client),
            # reset_tool_choice (the default) turns "required" back to auto after a call
            model_settings=ModelSettings(tool_choice="required", temperature=0,
                                         max_tokens=MAX_TOKENS))
        config = RunConfig(tracing_disabled=True)
        try:
            if not stream:
                return await Runner.run(agent, TASK, max_turns=5, run_config=config)
            result = Runner.run_streamed(agent, TASK, max_turns=5, run_config=config)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds, kinds
    assert kinds[-1] == "message_output_item", kinds
    _assert_loop_closed(bodies, stream)


@wrap_model_call
def _first_turn_calls(request, handler):
    """tool_choice "required" until a tool has answered, then the agent's own (auto)."""
    if not any(isinstance(m, ToolMessage) for m in request.messages):
        request = request.override(tool_choice="required")
    return handler(request)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_langchain_agent_loop(server, stream: bool):
    url, model_name = server
    bodies: list[dict] = []
    http = httpx.Client(timeout=120, event_hooks={
        "request": [lambda request: bodies.append(json.loads(request.content))]})
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="x", model=model_name, temperature=0,
                     max_tokens=MAX_TOKENS, max_retries=0, streaming=stream, http_client=http)
    agent = create_agent(llm, [get_weather, get_time], system_prompt=INSTRUCTIONS,
                         middleware=[_first_turn_calls])
    task = {"messages": [{"role": "user", "content": TASK}]}
    config = {"recursion_limit": 10}
    try:
        if not stream:
            messages = agent.invoke(task, config=config)["messages"]
        else:
            chunks, state = 0, None
            for mode, data in agent.stream(task, config=config,
                                           stream_mode=["messages", "values"]):
                if mode == "messages":
                    chunks += isinstance(data[0], AIMessageChunk)
                else:
                    state = data
            assert chunks > 0 and state is not None
            messages = state["messages"]
    finally:
        http.close()
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str)
    assert any(isinstance(m, AIMessage) and m.tool_calls for m in messages)
    assert any(isinstance(m, ToolMessage) for m in messages)
    _assert_loop_closed(bodies, stream)
