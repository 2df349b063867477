"""Bad input is a 4xx with a message that says what is wrong — never a 500 or a traceback."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tandem.entrypoints.server.state import ServerState
from tests.server.conftest import tiny_engine

CHAT = [{"role": "user", "content": "hi"}]


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
LONE = "a\ud800b"  # a lone surrogate: valid JSON ("\\ud800"), not valid Unicode
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
               "/detokenize", "/api/generate", "/api/chat", "/api/show"]
OLLAMA = {"model": "smollm2", "prompt": "hi", "stream": False}

CASES = [
    *((path, DEEP, 400, "nested deeper than 128") for path in POST_ROUTES),
    ("/v1/chat/completions", {"model": LONE, "messages": CHAT}, 400, "model contains a lone"),
    ("/v1/completions", {"prompt": LONE}, 400, "prompt contains a lone"),
    ("/v1/completions", {"prompt": ["ok", LONE]}, 400, "prompt[1] contains a lone"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, 400,
     "messages[0].content contains a lone"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [LONE]}, 400, "stop[0]"),
    ("/v1/chat/completions", {"messages": CHAT, LONE: 1}, 400, "a\\ud800b contains a lone"),
    ("/tokenize", {"prompt": LONE}, 400, "prompt contains a lone"),
    ("/api/generate", {**OLLAMA, "system": LONE}, 400, "system contains a lone"),
    ("/api/generate", {**OLLAMA, "prompt": LONE}, 400, "prompt contains a lone"),
    ("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": LONE}]}, 400,
     "messages[0].content contains a lone"),
    ("/api/show", {"model": LONE}, 400, "model contains a lone"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 129, "max_tokens": 1}, 400,
     "must be at most 128"),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 2, "max_tokens": 1}, 400,
     "n x prompts (2 x 100) must be at most 128"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2**64}, 400, "seed must be a 64-bit"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed must be a 64-bit"),
    ("/api/generate", {**OLLAMA, "options": {"seed": 2**64}}, 400, "options.seed"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2**70}, 400, "context length"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 2**70}, 400,
     "min_tokens (1180591620717411303424) exceeds"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2**70}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [[2**70]]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": [-1]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": [2**70]}, 400, "vocabulary"),
    ("/api/generate", {**OLLAMA, "options": {"num_ctx": 2**70}}, 400, "num_ctx"),
    ("/api/generate", {**OLLAMA, "options": {"num_predict": 2**70}}, 400,
     "options.num_predict: Input should be less than or equal to"),
    ("/api/generate", {**OLLAMA, "context": [2**70]}, 400, "vocabulary"),
    ("/api/generate", {**OLLAMA, "raw": True, "system": "Be brief."}, 400,
     "raw mode does not support template, system, or context"),
    ("/api/embed", {"model": "smollm2", "input": "hi"}, 501, "run an embedding model elsewhere"),
    ("/v1/embeddings", {"model": "smollm2", "input": "hi"}, 501, "embeddings are not supported"),
    ("/api/create", {"model": "mine", "from": "smollm2"}, 501, "creating models is not"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"temperature": NaN}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 65}, 400, "at most 64 stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * 65}, 400, "at most 64 stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 1025]}, 400, "1024"),
    ("/v1/completions", {"prompt": "x" * 100_000}, 400, "not tokenized"),
    ("/tokenize", {"prompt": "x" * 100_000}, 400, "not tokenized"),
    ("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}] * 1025},
     400, "messages has 1025 items, more than this server accepts (1024)"),
    ("/detokenize", {"tokens": [1] * 100_000}, 400, "tokens has 100000 items"),
    ("/v1/completions", {"prompt": [1] * 2000}, 400, "prompt has 2000 items"),
    ("/v1/completions", {"prompt": [[1], [1] * 2000]}, 400, "prompt[1] has 2000 items"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}] * 2000}]}, 400, "messages[0].content has 2000 items"),
    ("/api/generate", {**OLLAMA, "context": [1] * 2000}, 400, "context has 2000 items"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "top_k": -7}, 400, "top_k"),
    # (path, raw body or JSON object, status, words the message must contain)
    ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("/v1/chat/completions", b"\xff\xfe", 400, "not valid JSON"),
    ("/v1/chat/completions", b"", 400, "empty"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "lots"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -5}, 400, "max_tokens"),
    # Types are strict, as OpenAI's and Ollama's decoders are: no bool-as-int, no string numbers.
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": True}, 400,
     "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5.0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": True}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": 1}, 400, "stream"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": True}, 400, "max_output_tokens"),
    ("/api/generate", {**OLLAMA, "options": {"num_predict": True}}, 400,
     "options.num_predict: must be an integer"),
    ("/api/generate", {**OLLAMA, "options": {"num_predict": 2.5}}, 400, "num_predict"),
    ("/api/generate", {**OLLAMA, "stream": "false"}, 400, "stream"),
    # A 400 names the field the client sent.
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens must be at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages[0].content[0]: a text part needs its text"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400,
     "messages[0].content is required for role 'user'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, 400,
     "messages[0].content must not be an empty list"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options is only allowed when stream is true"),
    ("/v1/completions", {"prompt": "hi", "stream": False, "stream_options": {}}, 400,
     "stream_options"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}] * 2}, 400,
     "tools[1].name 'f' is given twice"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs may not set tools"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1}, 400,
     "send /v1/completions with echo"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 0}, 400, "prompt_logprobs"),
    ("/v1/responses", {"input": [{"type": ["message"], "role": "user", "content": "x"}]}, 400,
     "input[0].type must be a string"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"conversations": 5}},
     400, "chat_template_kwargs may not set conversations"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"x": _nested(500)}}, 400,
     "nested deeper than 128"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": ["x"]}, 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": [1]}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n must be"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tool"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}},
     400, "response_format.type"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     400, "response_format.json_schema.schema cannot be compiled"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(a"}}, 400,
     "structured_outputs.regex cannot be compiled"),
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"choice": "yes"}}, 400,
     "structured_outputs.choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice names the function 'g'"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400,
     "previous_response_id is not supported"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c"}]}, 400,
     "input[0]: invalid request: output"),
    ("/v1/responses", {"input": "hi", "tool_choice": "required"}, 400, "tool_choice needs"),
    ("/v1/responses", {"input": LONE}, 400, "input contains a lone"),
    ("/api/chat", {"model": "smollm2", "messages": CHAT, "format": {"type": "nope"}}, 400,
     "format cannot be compiled"),
    ("/api/chat", {"model": "smollm2", "messages": CHAT, "tools": [{"type": "function"}]},
     400, "tools[0].function"),
    ("/api/chat", {"model": "smollm2", "messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "x"}}]}]}, 400, "arguments"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2000}, 400, "1024"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "options": {"num_predict": "x"}},
     400, "num_predict"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "format": "yaml"}, 400, "format"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "format": [1, 2]}, 400,
     'format: must be "json" or a JSON schema'),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "keep_alive": "banana"}, 400,
     'keep_alive: time: invalid duration "banana"'),
    ("/api/chat", {"model": "smollm2", "messages": "hi"}, 400, "messages"),
    ("/api/chat", {"messages": CHAT}, 400, "model is required"),
    ("/api/chat", b"{", 400, "not valid JSON"),
]


def _message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


def post_keeping_connection(url: str, path: str, body: bytes | dict,
                            headers: dict[str, str]) -> tuple[int, str]:
    """POST on one keep-alive connection, then GET /health on the same one.

    Returns (status, error message); asserts the server kept the connection
    open and serves the next request on it, as a client's pool expects.
    """
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, raw, {**headers, "Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode()
        sock = conn.sock
        assert sock is not None and r.getheader("connection") != "close", text
        conn.request("GET", "/health")
        probe = conn.getresponse()
        probe.read()
        assert conn.sock is sock and probe.status == 200
    finally:
        conn.close()
    error = json.loads(text)["error"] if r.status >= 400 else ""
    return r.status, error if isinstance(error, str) else error["message"]


@pytest.mark.parametrize("path,body,status,words", CASES)
def test_bad_request_is_4xx_with_a_clear_message(real_server, path, body, status, words):
    got, message = post_keeping_connection(real_server.url, path, body, real_server.headers)
    assert got == status, message
    assert words in message and "Traceback" not in message


def test_a_bad_prompt_in_a_batch_is_not_counted_as_a_client_abort(real_server):
    before = real_server.metric("tandem:request_aborts_total")
    r = httpx.post(f"{real_server.url}/v1/completions", headers=real_server.headers, timeout=60,
                   json={"prompt": [[1, 2], [10**6]], "max_tokens": 1})
    assert r.status_code == 400 and "vocabulary" in r.text
    assert real_server.metric("tandem:request_aborts_total") == before


def test_a_body_within_the_depth_bound_is_served(real_server):
    body = {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"x": _nested(120)}}
    r = httpx.post(f"{real_server.url}/v1/chat/completions", json=body,
                   headers=real_server.headers, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 2), ("presence_penalty", 3), ("n", 0), ("stop", [""]),
    ("max_tokens", 0), ("max_completion_tokens", 0), ("stream_options", {})])
def test_a_sampling_range_error_names_its_field(real_server, field, value):
    """OpenAI's error shape names the offending parameter, as pydantic's do."""
    r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                   json={"messages": CHAT, "max_tokens": 1, field: value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_unknown_fields_are_ignored(real_server):
    r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                   json={"messages": CHAT, "max_tokens": 1, "frobnicate": {"x": 1},
                         "user": "someone"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT, "n": None, "logprobs": None, "stream": None,
                              "temperature": None, "stop": None, "tools": None,
                              "tool_choice": None, "stream_options": None}),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": False, "top_logprobs": 0}),
    ("/v1/completions", {"prompt": "hi", "n": None, "echo": None, "stream": None}),
    ("/v1/responses", {"input": "hi", "stream": None, "parallel_tool_calls": None}),
    ("/api/generate", {**OLLAMA, "raw": None, "options": {"temperature": None}}),
])
def test_null_is_the_fields_default(real_server, path, body):
    """The OpenAI SDK sends a Python None as null (``n=None``), which OpenAI and
    Ollama's decoder read as the default."""
    limit = {"max_output_tokens": 16} if path == "/v1/responses" else {"max_tokens": 2}
    if path.startswith("/api/"):
        limit = {}
    r = httpx.post(f"{real_server.url}{path}", headers=real_server.headers,
                   json={**body, **limit}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # null stream: not streamed


def test_wrong_method_and_path(real_server):
    r = httpx.get(f"{real_server.url}/v1/chat/completions", headers=real_server.headers)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.get(f"{real_server.url}/v1/nothing-here", headers=real_server.headers)
    assert r.status_code == 404 and r.json()["error"]["message"]


def _partial_post(server, length: int, body: bytes, until: bytes) -> bytes:
    """A POST that says it is ``length`` bytes and sends ``body``: the answer, read
    until ``until`` shows or the server closes."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {server.api_key}\r\n".encode()
            + f"Content-Length: {length}\r\n\r\n".encode() + body)
        data = b""
        while until not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    return data


def test_a_body_that_stops_arriving_is_a_408(real_server, monkeypatch):
    """Shorter than its Content-Length: answered once nothing came for the read timeout,
    not held open forever (slowloris)."""
    from tandem.entrypoints.server import protocol

    monkeypatch.setattr(protocol, "BODY_READ_TIMEOUT_S", 0.5)
    data = _partial_post(real_server, 100, b'{"prompt": ', b"stopped arriving")
    assert data.startswith(b"HTTP/1.1 408") and b"stopped arriving" in data


def _server_closes(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_request_head_that_stops_arriving_is_closed(real_server, monkeypatch):
    """A head sent a byte at a time (slowloris), or none at all, loses its
    connection at the deadline; a neighbour is served; a head that arrived in
    time is answered however long its response takes."""
    from tandem.entrypoints.server import http_protocol

    monkeypatch.setattr(http_protocol, "HEADER_READ_TIMEOUT_S", 0.5)
    host, port = real_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as silent, \
            socket.create_connection((host, int(port)), timeout=10) as trickle:
        start = time.monotonic()
        for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: 1\r\n"):
            trickle.sendall(part)
            time.sleep(0.2)
        assert _server_closes(trickle, 5) and _server_closes(silent, 5)
        assert time.monotonic() - start < 5
    r = httpx.post(f"{real_server.url}/v1/completions", headers=real_server.headers, timeout=60,
                   json={"prompt": "Once upon a time", "max_tokens": 128, "ignore_eos": True,
                         "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    with httpx.Client(timeout=10) as client:  # keep-alive: the next head in time is served
        for _ in range(2):
            assert client.get(f"{real_server.url}/health").status_code == 200
            time.sleep(0.2)


def test_huge_declared_body_is_refused_before_reading(real_server):
    """Content-Length over the limit: 413 from the headers alone, no 100 MB upload."""
    data = _partial_post(real_server, 100_000_000, b"{", b"exceeds the limit")
    assert data.startswith(b"HTTP/1.1 413") and b"exceeds the limit" in data


def test_huge_chunked_body_is_refused_while_reading(real_server):
    chunk = b" " * 2**20

    def body():
        yield b'{"prompt": "'
        for _ in range(17):  # 17 MiB > the 16 MiB default
            yield chunk

    r = httpx.post(f"{real_server.url}/v1/completions", headers=real_server.headers,
                   content=body(), timeout=60)
    assert r.status_code == 413 and "exceeds the limit" in _message(r)


def test_templating_and_tokenizing_run_off_the_event_loop(real_server, monkeypatch):
    """A slow prompt (here a template that takes 2 s) delays its own request only."""
    tok = real_server.engine.engine.tokenizer
    render = tok.apply_chat_template
    threads: list[str] = []

    def slow(*args, **kwargs):
        threads.append(threading.current_thread().name)
        time.sleep(2.0)
        return render(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{real_server.url}/v1/chat/completions",
                              headers=real_server.headers, timeout=60,
                              json={"messages": CHAT, "max_tokens": 1})
        while not threads:
            time.sleep(0.01)
        t0 = time.monotonic()
        assert httpx.get(f"{real_server.url}/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 1.0
        assert pending.result().status_code == 200
    assert threads[0].startswith("tandem-tokenize")


def test_an_unexpected_error_is_a_500_in_shape_on_a_kept_connection(
        start_server, tiny_config_path, monkeypatch, caplog):
    s = start_server(tiny_engine(tiny_config_path))

    def broken(self, requested, ollama=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(ServerState, "check_model", broken)
    with caplog.at_level(logging.ERROR, logger="tandem.entrypoints.server"):
        for path, body in (("/v1/completions", {"prompt": [1]}),
                           ("/api/generate", {"model": s.model, "context": [1]})):
            status, message = post_keeping_connection(s.url, path, body, {})
            assert status == 500 and message == "internal server error (RuntimeError)"
    assert "unhandled RuntimeError on POST /v1/completions: boom (" in caplog.records[0].message
    assert all(r.exc_info is None for r in caplog.records)  # one line, no traceback


def test_ignored_fields_are_logged_in_one_bounded_line(caplog):
    from tandem.entrypoints.server.protocol import CompletionRequest, parse_body

    body = {"prompt": "x", "guided_choice": ["a", "b"], **{f"k{i}" * 50: 1 for i in range(5000)}}
    with caplog.at_level(logging.WARNING, logger="tandem.entrypoints.server"):
        parse_body(CompletionRequest, body)
    [record] = [r for r in caplog.records if "ignored" in r.getMessage()]
    line = record.getMessage()
    assert len(line) < 1000 and "4990 more" in line and "guided_choice" not in line
