"""Bad input is a 4xx with a message that says what is wrong — never a 500 or a traceback."""

from __future__ import annotations

import socket

import httpx
import pytest

CHAT = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, raw body or JSON object, status, words the message must contain)
    ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("/v1/chat/completions", b"\xff\xfe", 400, "not valid JSON"),
    ("/v1/chat/completions", b"", 400, "empty"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "lots"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": [1]}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n must be"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tool"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2000}, 400, "1024"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "options": {"num_predict": "x"}},
     400, "num_predict"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "options": {"num_predict": 0}},
     400, "num_predict"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "format": "json"}, 400, "format"),
    ("/api/chat", {"model": "smollm2", "messages": "hi"}, 400, "messages"),
    ("/api/chat", {"messages": CHAT}, 400, "model is required"),
    ("/api/chat", b"{", 400, "not valid JSON"),
]


def _message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


@pytest.mark.parametrize("path,body,status,words", CASES)
def test_bad_request_is_4xx_with_a_clear_message(real_server, path, body, status, words):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(real_server.url + path, headers=real_server.headers, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    assert words in _message(r)
    assert "Traceback" not in r.text


def test_unknown_fields_are_ignored(real_server):
    r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                   json={"messages": CHAT, "max_tokens": 1, "frobnicate": {"x": 1},
                         "user": "someone"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_wrong_method_and_path(real_server):
    assert httpx.get(f"{real_server.url}/v1/chat/completions",
                     headers=real_server.headers).status_code == 405
    r = httpx.get(f"{real_server.url}/v1/nothing-here", headers=real_server.headers)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_huge_declared_body_is_refused_before_reading(real_server):
    """Content-Length over the limit: 413 from the headers alone, no 100 MB upload."""
    host, port = real_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {real_server.api_key}\r\n".encode()
            + b"Content-Length: 100000000\r\n\r\n{")
        data = b""
        while b"exceeds the limit" not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
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
