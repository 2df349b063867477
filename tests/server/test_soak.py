"""Soak: mixed load on both APIs, disconnects, bursts and bad input, then an idle, intact server.

Random lengths, streaming and not, /v1 and /api, clients that leave
mid-stream or while queued, bursts past --max-queue, and every case of the
bad-input matrix, all at once for TANDEM_SOAK_SECONDS (default 15: the short
setting the default suite runs; `TANDEM_SOAK_SECONDS=600 pytest -m soak` for a
long one). Then: no 5xx but the queue's own 503 + Retry-After, no request
left hanging, running / waiting / KV usage back to 0, and the same greedy
answer as before the load.

The model is the tiny random one with the default model's tokenizer (so
chat templates and detokenization run for real) and a 2 ms step, so a few
seconds hold thousands of steps, preemptions and queueing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from collections import Counter

import httpx
import pytest

from tandem.entrypoints.server.admission import OLLAMA_BUSY
from tandem.entrypoints.server.app import ServerConfig
from tandem.model.gguf import gguf_to_hf_dir
from tandem.paths import default_model_path
from tests.conftest import TINY_CONFIG
from tests.server.conftest import RunningServer, slow_down, tiny_engine
from tests.server.test_bad_input import CASES, post_keeping_connection

pytestmark = pytest.mark.soak

SECONDS = float(os.environ.get("TANDEM_SOAK_SECONDS", "15"))
WORKERS = 10
MODEL = "smollm2"
GREEDY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
          "max_tokens": 24, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 12}},
    "required": ["q"], "additionalProperties": False}}}
WORDS = "the a sea of words streams tokens queue server cat runs fast é 東京 🙂 \n".split(" ")


@pytest.fixture(scope="module")
def soak_server(start_server, tmp_path_factory) -> RunningServer:
    d = tmp_path_factory.mktemp("soak")
    tokenizer = gguf_to_hf_dir(default_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, d / name)
    (d / "config.json").write_text(json.dumps({
        **TINY_CONFIG, "vocab_size": 49152, "max_position_embeddings": 384,
        "bos_token_id": 1, "eos_token_id": 2}))
    engine = tiny_engine(str(d), skip_tokenizer_init=False, block_size=16, max_model_len=384,
                         kv_cache_memory="256KiB", max_num_seqs=8)  # 2,048 tokens: preemption
    return start_server(slow_down(engine, 0.002),
                        ServerConfig(max_queue=8, served_model_names=[MODEL]))


class Tally:
    """What the load saw: statuses by kind of request, and what went wrong."""

    def __init__(self) -> None:
        self.statuses: Counter = Counter()
        self.failures: list[str] = []

    def check(self, kind: str, r: httpx.Response) -> bool:
        self.statuses[(kind, r.status_code)] += 1
        if r.status_code == 503 and r.headers.get("retry-after"):
            return False  # the bounded queue, by design
        if r.status_code != 200:
            self.failures.append(f"{kind}: {r.status_code} {r.text[:200]}")
            return False
        return True


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(WORDS) + " " for _ in range(rng.randint(lo, hi)))


def _request(rng: random.Random) -> tuple[str, str, dict]:
    """(kind, path, body): a valid request of random API, length and streaming."""
    stream = rng.random() < 0.5
    limit = rng.randint(1, 48)
    kind = rng.choice(["completion", "completion_ids", "chat", "generate", "ollama_chat",
                       "chat_tools", "chat_json", "responses"])
    messages = [{"role": "user", "content": _text(rng, 1, 60)}]
    if rng.random() < 0.3:
        messages = [{"role": "system", "content": _text(rng, 1, 20)}, *messages,
                    {"role": "assistant", "content": _text(rng, 1, 20)},
                    {"role": "user", "content": _text(rng, 1, 20)}]
    open_ended = rng.random() < 0.2  # no limit: until EOS or the context is full
    if kind == "completion":
        return kind, "/v1/completions", {"model": MODEL, "prompt": _text(rng, 1, 80),
                                         "max_tokens": limit, "stream": stream}
    if kind == "completion_ids":
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 200))]
        return kind, "/v1/completions", {"prompt": prompt, "max_tokens": limit, "n":
                                         rng.choice([1, 1, 2]), "stream": stream, "seed": 1}
    if kind in ("chat", "chat_tools", "chat_json"):
        body = {"model": MODEL, "messages": messages, "stream": stream}
        if kind == "chat_tools":  # a grammar-forced call, or the parser on free text
            body.update(tools=[TOOL], tool_choice=rng.choice(["required", "auto"]))
        elif kind == "chat_json":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "t", "schema": TOOL["function"]["parameters"]}}
        return kind, "/v1/chat/completions", body if open_ended else {**body,
                                                                       "max_tokens": limit}
    if kind == "responses":
        body = {"model": MODEL, "input": messages, "stream": stream}
        if rng.random() < 0.5:
            body.update(tools=[{"type": "function", **TOOL["function"]}], tool_choice="required")
        return kind, "/v1/responses", body if open_ended else {**body,
                                                               "max_output_tokens": max(limit, 16)}
    options = {} if open_ended else {"num_predict": limit}
    if kind == "generate":
        return kind, "/api/generate", {"model": MODEL, "prompt": _text(rng, 1, 80),
                                       "stream": stream, "options": options}
    return kind, "/api/chat", {"model": MODEL, "messages": messages, "stream": stream,
                               "options": options}


async def _complete(client: httpx.AsyncClient, tally: Tally, kind: str, path: str,
                    body: dict) -> None:
    """One request read to its end, its final object checked."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        if tally.check(kind, r):
            out = r.json()
            done = out.get("done_reason") or out.get("status") or \
                out["choices"][0]["finish_reason"]
            if done not in ("stop", "length", "tool_calls", "completed", "incomplete"):
                tally.failures.append(f"{kind}: finished with {done!r}")
        return
    async with client.stream("POST", path, json=body) as r:
        if not tally.check(kind, r):
            await r.aread()
            return
        last = ""
        async for line in r.aiter_lines():
            if line.strip():
                last = line
        if path == "/v1/responses":
            ended = json.loads(last.removeprefix("data: "))["type"] in (
                "response.completed", "response.incomplete")
        else:
            ended = last == "data: [DONE]" if path.startswith("/v1") else \
                json.loads(last).get("done") is True
        if not ended:
            tally.failures.append(f"{kind} stream ended with {last[:200]!r}")


async def _leave_mid_stream(client: httpx.AsyncClient, tally: Tally) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if tally.check("leave_mid_stream", r):
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n == 6:
                    break  # the client goes away with the stream running


async def _leave_while_queued(client: httpx.AsyncClient, tally: Tally) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 200}
    try:
        r = await client.post("/v1/completions", json=body, timeout=0.05)
    except httpx.TimeoutException:
        tally.statuses[("leave_while_queued", "left")] += 1
        return
    tally.check("leave_while_queued", r)


async def _burst(client: httpx.AsyncClient, tally: Tally) -> None:
    """More at once than run and wait together: the rest get 503 + Retry-After."""
    body = {"model": MODEL, "prompt": "burst", "max_tokens": 30, "ignore_eos": True}
    rs = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(24)))
    for r in rs:
        tally.check("burst", r)


async def _bad_inputs(s: RunningServer, tally: Tally, deadline: float) -> None:
    """Every case of the matrix, over and over until the deadline (at least once)."""
    while True:
        for path, body, status, _ in CASES:
            got, message = await asyncio.to_thread(post_keeping_connection, s.url, path, body,
                                                   s.headers)
            tally.statuses[("bad_input", got)] += 1
            queue_full = got == 503 and (message == OLLAMA_BUSY or "overloaded" in message)
            if got != status and not queue_full:  # checks done in the engine come after it
                tally.failures.append(f"bad input {path} {str(body)[:80]}: {got} "
                                      f"{message[:200]}")
        if time.monotonic() >= deadline:
            return


async def _load(s: RunningServer, tally: Tally) -> None:
    deadline = time.monotonic() + SECONDS
    # Idle connections leave the pool before the server's keep-alive (uvicorn's
    # 5 s) closes them: at httpx's default expiry, also 5 s, a burst could pick a
    # connection the server was closing that instant (ReadError, seen once).
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=limits) as client:
        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                roll = rng.random()
                if roll < 0.08:
                    await _leave_mid_stream(client, tally)
                elif roll < 0.16:
                    await _leave_while_queued(client, tally)
                elif roll < 0.19:
                    await _burst(client, tally)
                else:
                    await _complete(client, tally, *_request(rng))

        await asyncio.gather(_bad_inputs(s, tally, deadline),
                             *(worker(i) for i in range(WORKERS)))


def _wait_idle(s: RunningServer, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    state = s.engine.engine
    while (s.metric("vllm:num_requests_running") or s.metric("vllm:num_requests_waiting")
           or state.kv_manager.usage or s.engine.num_pending):
        assert time.monotonic() < deadline, "the engine did not return to idle"
        time.sleep(0.05)


def test_soak(soak_server):
    s = soak_server
    before = httpx.post(f"{s.url}/v1/chat/completions", json=GREEDY, timeout=60).json()
    tally = Tally()
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(_load(s, tally), SECONDS + 240))  # nothing hangs
    elapsed = time.monotonic() - t0
    assert not tally.failures, tally.failures[:10]
    _wait_idle(s)
    assert s.metric("vllm:kv_cache_usage_perc") == 0
    after = httpx.post(f"{s.url}/v1/chat/completions", json=GREEDY, timeout=60).json()
    assert after["choices"][0]["message"] == before["choices"][0]["message"]
    kinds = {k for k, _ in tally.statuses}
    assert {"completion", "chat", "generate", "ollama_chat", "chat_tools", "chat_json",
            "responses", "leave_mid_stream", "burst", "bad_input"} <= kinds, tally.statuses
    assert tally.statuses[("bad_input", 400)] >= 40
    assert tally.statuses[("burst", 503)] > 0  # the bursts did overflow the queue
    print(f"soak: {elapsed:.0f} s, {sum(tally.statuses.values())} requests:",
          dict(sorted(tally.statuses.items(), key=str)))
