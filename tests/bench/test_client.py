"""Request bodies per backend and error messages (the parts not visible in a run's numbers)."""

from __future__ import annotations

from tandem.tools.bench.client import (
    RequestInput,
    _ollama_payload,
    _openai_payload,
    error_message,
)
from tandem.tools.bench.datasets import SampleRequest


def _input(**kw) -> RequestInput:
    sample = SampleRequest("hello there", 2, 7, kw.pop("messages", None))
    return RequestInput("http://x/v1/completions", "m", sample, "id-1", **kw)


def test_openai_bodies_stream_with_usage_and_only_the_given_sampling_flags():
    body = _openai_payload(_input(ignore_eos=True, sampling={"temperature": 0.0},
                                  extra_body={"top_k": 5}), chat=False)
    assert body == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": 7, "prompt": "hello there", "ignore_eos": True,
                    "temperature": 0.0, "top_k": 5}
    chat = _openai_payload(_input(messages=[{"role": "user", "content": "hi"}]), chat=True)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_completion_tokens"] == chat["max_tokens"] == 7
    assert "ignore_eos" not in chat and "prompt" not in chat


def test_ollama_bodies_map_vllm_flag_names_to_options():
    body = _ollama_payload(_input(sampling={"temperature": 0.5, "repetition_penalty": 1.1}),
                           chat=False)
    assert body["raw"] is True and body["prompt"] == "hello there"
    assert body["options"] == {"num_predict": 7, "temperature": 0.5, "repeat_penalty": 1.1}
    chat = _ollama_payload(_input(), chat=True)
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]


def test_error_messages_from_each_api_shape():
    assert error_message(503, b'{"error": {"message": "server overloaded"}}') \
        == "HTTP 503: server overloaded"
    assert error_message(503, b'{"error": "server busy"}') == "HTTP 503: server busy"
    assert error_message(502, b"Bad Gateway") == "HTTP 502: Bad Gateway"
    assert error_message(500, b"") == "HTTP 500"
