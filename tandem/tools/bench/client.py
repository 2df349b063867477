"""One streamed request per backend, with the timestamps vLLM's metrics are defined on.

Definitions (vLLM's ``benchmark_serving.py`` / ``vllm bench serve``), all on
``time.perf_counter()`` in the client:

* TTFT: request sent -> the first chunk whose ``choices`` is non-empty (a
  chunk may carry an empty text: a token that completes no character yet);
* ITL: the gaps between successive such chunks (one token per chunk on
  tandem, llama-server and vLLM's default streaming);
* E2EL ("latency"): request sent -> the last such chunk (the trailing usage
  chunk carries no token);
* output tokens: the server's ``usage.completion_tokens`` (Ollama:
  ``eval_count``); without either, the number of chunks.

A request fails — recorded with its error, never raised — on a non-200
status, an error event inside the stream, a dropped connection, or a stream
that ends before its final event (``[DONE]``/``finish_reason``; Ollama's
``done: true``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.tools.bench.datasets import SampleRequest

BACKENDS = ("openai", "openai-chat", "ollama")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions",
                     "ollama": "/api/generate"}
# vLLM's sampling flags -> Ollama's option names.
OLLAMA_OPTION_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "frequency_penalty": "frequency_penalty",
                       "presence_penalty": "presence_penalty",
                       "repetition_penalty": "repeat_penalty"}


@dataclass
class RequestInput:
    url: str
    model: str
    sample: SampleRequest
    request_id: str
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # only the flags the user set
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestResult:
    """What one request measured (vLLM's RequestFuncOutput, plus the server's own split)."""

    request_id: str = ""
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter when the request was sent
    client_queue_time: float = 0.0  # waiting for a --max-concurrency slot
    end_time: float = 0.0  # perf_counter when the request was over, failed or not
    generated_text: str = ""
    # The server's per-request phase split when it reports one: tandem's ``tandem``
    # object (seconds) or Ollama's counters (converted to seconds).
    server: dict[str, float] | None = None


RequestFunc = Callable[[httpx.AsyncClient, RequestInput, RequestResult], Awaitable[None]]


class _Clock:
    """Records TTFT / ITL / latency as token chunks arrive."""

    def __init__(self, out: RequestResult) -> None:
        self.out = out
        self.chunks = 0
        out.start_time = time.perf_counter()
        self.last = out.start_time

    def token_chunk(self) -> None:
        now = time.perf_counter()
        if self.chunks == 0:
            self.out.ttft = now - self.out.start_time
        else:
            self.out.itl.append(now - self.last)
        self.last = now
        self.chunks += 1
        self.out.latency = now - self.out.start_time


def error_message(status: int, body: bytes) -> str:
    """``HTTP 503: server overloaded ...`` from OpenAI's, Ollama's or any error body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            err = err.get("message", err)
        text = str(err)
    except ValueError:
        pass
    return f"HTTP {status}: {text[:300]}" if text else f"HTTP {status}"


class _Stream:
    """Per-request parsing state: ``done`` once the stream's final event arrived."""

    def __init__(self) -> None:
        self.done = False


async def _post_stream(client: httpx.AsyncClient, inp: RequestInput, payload: dict,
                       out: RequestResult, on_line: Callable[[str, _Clock, _Stream], bool]
                       ) -> None:
    """POST, then feed each non-empty line to ``on_line`` until it returns True (stop)."""
    clock = _Clock(out)
    state = _Stream()
    async with client.stream("POST", inp.url, json=payload,
                             headers={**inp.headers, "x-request-id": inp.request_id}) as r:
        if r.status_code != 200:
            out.error = error_message(r.status_code, await r.aread())
            return
        async for line in r.aiter_lines():
            if line.strip() and on_line(line, clock, state):
                break
    if out.error:
        return
    if clock.chunks == 0:
        out.error = "no token was streamed back (TTFT undefined)"
    elif not state.done:
        out.error = "the stream ended before its final event"
    else:
        out.success = True
        if not out.output_tokens:
            out.output_tokens = clock.chunks


def _stream_error(obj: dict, out: RequestResult) -> bool:
    err = obj.get("error")
    if err is None:
        return False
    out.error = "error in stream: " + str(err.get("message", err) if isinstance(err, dict)
                                          else err)
    return True


def _openai_payload(inp: RequestInput, chat: bool) -> dict:
    s = inp.sample
    payload: dict[str, Any] = {"model": inp.model, "stream": True,
                               "stream_options": {"include_usage": True},
                               "max_tokens": s.expected_output_len}
    if chat:
        payload["messages"] = s.chat_messages()
        payload["max_completion_tokens"] = s.expected_output_len
    else:
        payload["prompt"] = s.prompt
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(inp.sampling)
    payload.update(inp.extra_body)
    return payload


async def openai_stream(client: httpx.AsyncClient, inp: RequestInput, out: RequestResult,
                        chat: bool) -> None:
    """``/v1/completions`` or ``/v1/chat/completions`` with ``stream_options.include_usage``."""

    def on_line(line: str, clock: _Clock, state: _Stream) -> bool:
        if not line.startswith("data:"):
            return False  # SSE comments / keep-alives
        data = line[5:].strip()
        if data == "[DONE]":
            state.done = True
            return True
        obj = json.loads(data)
        if _stream_error(obj, out):
            return True
        if choices := obj.get("choices"):
            clock.token_chunk()
            c = choices[0]
            text = (c.get("delta") or {}).get("content") if chat else c.get("text")
            out.generated_text += text or ""
            # A server that ends the stream without [DONE] has still finished here.
            state.done = state.done or bool(c.get("finish_reason"))
        if usage := obj.get("usage"):
            out.output_tokens = int(usage.get("completion_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                out.prompt_len = int(usage["prompt_tokens"])
        if isinstance(obj.get("tandem"), dict):
            out.server = _tandem_split(obj["tandem"])
        return False

    out.prompt_len = inp.sample.prompt_len
    await _post_stream(client, inp, _openai_payload(inp, chat), out, on_line)


def _tandem_split(t: dict) -> dict[str, float]:
    keys = ("queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s", "prompt_tokens",
            "cached_tokens", "output_tokens", "preemptions")
    return {k: float(t[k]) for k in keys if isinstance(t.get(k), (int, float))}


async def openai_completions(client: httpx.AsyncClient, inp: RequestInput,
                             out: RequestResult) -> None:
    await openai_stream(client, inp, out, chat=False)


async def openai_chat(client: httpx.AsyncClient, inp: RequestInput, out: RequestResult) -> None:
    await openai_stream(client, inp, out, chat=True)


def _ollama_payload(inp: RequestInput, chat: bool) -> dict:
    s = inp.sample
    if not isinstance(s.prompt, str):
        raise ValueError("the ollama backend needs text prompts (drop --skip-tokenizer-init)")
    options: dict[str, Any] = {"num_predict": s.expected_output_len}
    options.update({OLLAMA_OPTION_NAMES[k]: v for k, v in inp.sampling.items()
                    if k in OLLAMA_OPTION_NAMES})
    payload: dict[str, Any] = {"model": inp.model, "stream": True, "options": options}
    if chat:
        payload["messages"] = s.chat_messages()
    else:
        payload["prompt"] = s.prompt
        payload["raw"] = True  # the prompt as built: no template tokens added
    payload.update(inp.extra_body)
    return payload


async def ollama(client: httpx.AsyncClient, inp: RequestInput, out: RequestResult) -> None:
    """``/api/generate`` (raw prompt) or ``/api/chat``: NDJSON, counters in the last object."""
    chat = inp.url.rstrip("/").endswith("/api/chat")

    def on_line(line: str, clock: _Clock, state: _Stream) -> bool:
        obj = json.loads(line)
        if _stream_error(obj, out):
            return True
        text = (obj.get("message") or {}).get("content") if chat else obj.get("response")
        done = bool(obj.get("done"))
        # Ollama's final object is empty; tandem's carries the last token.
        if not done or text:
            clock.token_chunk()
            out.generated_text += text or ""
        if done:
            state.done = True
            out.output_tokens = int(obj.get("eval_count") or 0)
            out.server = _ollama_split(obj)
        return done

    out.prompt_len = inp.sample.prompt_len
    await _post_stream(client, inp, _ollama_payload(inp, chat), out, on_line)


def _ollama_split(obj: dict) -> dict[str, float]:
    """Ollama's nanosecond counters as the same seconds tandem's extension uses."""
    ns = 1e-9
    split = {"prefill_s": float(obj.get("prompt_eval_duration") or 0) * ns,
             "decode_s": float(obj.get("eval_duration") or 0) * ns,
             "e2e_s": float(obj.get("total_duration") or 0) * ns,
             "prompt_eval_count": float(obj.get("prompt_eval_count") or 0),
             "output_tokens": float(obj.get("eval_count") or 0),
             "load_s": float(obj.get("load_duration") or 0) * ns}
    # What is left of the total once loading, prefill and decode are taken out: the wait.
    split["queue_s"] = max(0.0, split["e2e_s"] - split["load_s"] - split["prefill_s"]
                           - split["decode_s"])
    return split


REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": openai_completions, "openai-chat": openai_chat, "ollama": ollama}


async def send(func: RequestFunc, client: httpx.AsyncClient, inp: RequestInput,
               timeout: float | None) -> RequestResult:
    """Run one request; every failure (status, protocol, timeout) ends up in ``error``."""
    out = RequestResult(request_id=inp.request_id, prompt_len=inp.sample.prompt_len)
    try:
        if timeout:
            await _wait_for(func(client, inp, out), timeout)
        else:
            await func(client, inp, out)
    except TimeoutError:
        out.success, out.error = False, f"timed out after {timeout:g} s"
    except Exception as e:  # a benchmark records a failed request and goes on
        out.success = False
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    out.end_time = time.perf_counter()
    if not out.start_time:
        out.start_time = out.end_time
    return out


async def _wait_for(aw: Awaitable[None], timeout: float) -> None:
    try:
        await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError as e:  # a distinct class before Python 3.11
        raise TimeoutError from e
