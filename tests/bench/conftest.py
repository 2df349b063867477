"""Servers for the bench tests, and a proxy that timestamps what really went over the wire.

* ``real_server`` (tests/server/conftest.py): the default model behind an API key;
* ``tiny_server``: the tiny random model, slowed down, with a one-slot queue
  (real 503s) — token-id prompts only;
* ``fake_server``: a scriptable OpenAI/Ollama stand-in with exact delays and
  faults (503, a dropped connection, an error event, a stream that stops);
* ``recording_proxy(upstream)``: forwards everything and records, per
  ``x-request-id``, when the request arrived and when each streamed event
  passed through — timestamps taken independently of the benchmark's code.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tandem.entrypoints.server.app import ServerConfig
from tests.server.conftest import (
    API_KEY,
    RunningServer,
    real_server,
    slow_down,
    start_server,
    tiny_engine,
)
from tests.serving import app_servers, serve_app

# the session fixtures (one real-model server for the whole suite), re-exported here
__all__ = ["API_KEY", "real_server", "start_server"]


# ------------------------------------------------------------ real servers
@pytest.fixture(scope="session")
def tiny_server(start_server, tiny_config_path) -> RunningServer:
    """One sequence at a time and no queue: a burst gets real 503s from tandem."""
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=1), 0.01)
    return start_server(engine, ServerConfig(max_queue=0, served_model_names=["tiny"]))


@pytest.fixture(scope="session")
def tiny_batch_server(start_server, tiny_config_path) -> RunningServer:
    """Batches of 8, a deep queue: nothing is rejected (sweeps, schedules)."""
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=8), 0.005)
    return start_server(engine, ServerConfig(max_queue=64, served_model_names=["tiny"]))


# -------------------------------------------------------------- fake server
@dataclass
class FakePlan:
    """What the fake does for request i (its x-request-id ends in i): plan[i % len(plan)].

    ok | 503 | drop (2 tokens, then the connection dies) | error (1 token, then an
    error event) | truncated (2 tokens, then a clean end without the final event).
    """

    plan: list[str] = field(default_factory=lambda: ["ok"])
    first_delay: float = 0.0
    token_delay: float = 0.0
    tokens: int = 4


def _index(request: Request) -> int:
    rid = request.headers.get("x-request-id", "0")
    digits = rid[len(rid.rstrip("0123456789")):]
    return int(digits or 0)


def fake_app(p: FakePlan) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        what = p.plan[_index(request) % len(p.plan)]
        if what == "503":
            return JSONResponse({"error": {"message": "server overloaded: try later",
                                           "type": "server_overloaded", "code": 503}},
                                status_code=503)
        n = {"drop": 2, "error": 1, "truncated": 2}.get(what, p.tokens)

        async def events():
            await asyncio.sleep(p.first_delay)
            for k in range(n):
                if k:
                    await asyncio.sleep(p.token_delay)
                last = what == "ok" and k == n - 1
                yield ("data: " + json.dumps({"choices": [{
                    "index": 0, "text": f"t{k} ",
                    "finish_reason": "length" if last else None}]}) + "\n\n").encode()
            if what == "drop":
                raise RuntimeError("connection dropped on purpose")
            if what == "error":
                yield b'data: {"error": {"message": "engine exploded"}}\n\n'
            if what == "ok":
                prompt = body["prompt"]
                usage = {"completion_tokens": n}  # prompt_tokens only for token ids
                if isinstance(prompt, list):
                    usage["prompt_tokens"] = len(prompt)
                yield ("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n").encode()
            if what in ("ok", "error"):
                yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
def fake_server():
    """fake_server(FakePlan) -> url; every server stopped after the test."""
    with app_servers(fake_app) as start:
        yield start


# ---------------------------------------------------------- recording proxy
@dataclass
class Exchange:
    """One generation request as the proxy saw it (perf_counter times)."""

    request_id: str
    path: str
    t_request: float
    events: list[tuple[float, dict | str]] = field(default_factory=list)
    t_end: float = 0.0

    def token_events(self) -> list[tuple[float, dict]]:
        """Events that carry a token: OpenAI chunks with choices; Ollama objects with text."""
        out = []
        for t, e in self.events:
            if not isinstance(e, dict):
                continue
            if "choices" in e and e["choices"]:
                out.append((t, e))
            elif "done" in e and (not e["done"] or e.get("response")
                                  or (e.get("message") or {}).get("content")):
                out.append((t, e))
        return out

    def final(self) -> dict:
        """The usage chunk (OpenAI) or the done object (Ollama)."""
        for _, e in reversed(self.events):
            if isinstance(e, dict) and (e.get("usage") or e.get("done")):
                return e
        raise AssertionError(f"{self.request_id}: no final event")


class RecordingProxy:
    GENERATION = ("/v1/completions", "/v1/chat/completions", "/api/generate", "/api/chat")

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: dict[str, Exchange] = {}
        self.active = 0
        self.max_active = 0
        self.client: httpx.AsyncClient | None = None  # made on the proxy's own loop
        self.app = Starlette(routes=[Route("/{path:path}", self.forward,
                                           methods=["GET", "POST"])])
        self.url, self.stop = serve_app(self.app)

    async def forward(self, request: Request) -> Response:
        t0 = time.perf_counter()
        path = request.url.path
        body = await request.body()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "x-request-id")}
        if self.client is None:
            self.client = httpx.AsyncClient(base_url=self.upstream, timeout=None,
                                            limits=httpx.Limits(max_connections=None))
        up = self.client.build_request(request.method, path, content=body, headers=headers)
        r = await self.client.send(up, stream=True)
        if path not in self.GENERATION:
            content = await r.aread()
            await r.aclose()
            return Response(content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        ex = Exchange(request.headers.get("x-request-id", ""), path, t0)
        self.exchanges[ex.request_id] = ex
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        sse = path.startswith("/v1/")

        async def body_iter():
            buf = b""
            try:
                async for chunk in r.aiter_raw():
                    now = time.perf_counter()
                    buf += chunk
                    sep = b"\n\n" if sse else b"\n"
                    while sep in buf:
                        event, buf = buf.split(sep, 1)
                        ex.events.append((now, _parse_event(event, sse)))
                    yield chunk
            finally:
                ex.t_end = time.perf_counter()
                self.active -= 1
                await r.aclose()

        return StreamingResponse(body_iter(), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"))


def _parse_event(raw: bytes, sse: bool) -> dict | str:
    text = raw.decode().strip()
    if sse:
        text = text.removeprefix("data:").strip()
    return "[DONE]" if text == "[DONE]" else json.loads(text)


def _proxies():
    """start(upstream) -> RecordingProxy; every proxy stopped when the fixture ends."""
    proxies: list[RecordingProxy] = []

    def start(upstream: str) -> RecordingProxy:
        proxies.append(RecordingProxy(upstream))
        return proxies[-1]

    yield start
    for p in proxies:
        p.stop()


@pytest.fixture
def recording_proxy():
    yield from _proxies()


@pytest.fixture(scope="module")
def recording_proxy_module():
    """recording_proxy, shared by one module's tests."""
    yield from _proxies()
