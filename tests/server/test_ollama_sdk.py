"""The Ollama API, driven by the official `ollama` SDK against the real default model."""

from __future__ import annotations

import httpx
import ollama
import pytest

from tests.server.conftest import API_KEY

CHAT = [{"role": "user", "content": "What is 2+2?"}]  # greedy: "... is 4." (12 tokens)
SEA = [{"role": "user", "content": "Write two sentences about the sea."}]  # greedy: 46 tokens
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def client(real_server) -> ollama.Client:
    return ollama.Client(host=real_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=120)


def assert_counters(final, tokens_received: int) -> None:
    """Ollama's counters: present, integer nanoseconds, consistent with each other."""
    for name in ("total_duration", "load_duration", "prompt_eval_count",
                 "prompt_eval_duration", "eval_count", "eval_duration"):
        assert isinstance(final[name], int), name
    assert final.prompt_eval_count > 0 and final.prompt_eval_duration > 0
    assert final.eval_count == tokens_received
    assert final.prompt_eval_duration + final.eval_duration <= final.total_duration
    assert final.load_duration == 0  # the model stays loaded


def test_generate_non_streaming(client, real_server):
    r = client.generate(model="smollm2", prompt=CHAT[0]["content"], stream=False,
                        options=GREEDY)
    assert r.done and r.done_reason in ("stop", "length") and "4" in r.response
    assert_counters(r, r.eval_count)
    assert r.eval_count <= 16
    # context = the templated prompt's ids + the output's: it continues the conversation
    prompt_ids = httpx.post(f"{real_server.url}/tokenize", json={"messages": CHAT},
                            headers=real_server.headers).json()["tokens"]
    assert r.context[:len(prompt_ids)] == prompt_ids
    assert len(r.context) == len(prompt_ids) + r.eval_count
    assert r.prompt_eval_count <= len(prompt_ids)  # a prefix-cache hit is not counted


def test_generate_streaming_one_object_per_token(client):
    parts = list(client.generate(model="smollm2", prompt="Count: 1, 2, 3,", stream=True,
                                 options={"temperature": 0, "num_predict": 8}, raw=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert parts[-1].done_reason == "length"
    # Ollama's last object holds the counters and no text: one after the 8 tokens'.
    assert parts[-1].response == "" and all(p.response for p in parts[:-1])
    assert_counters(parts[-1], len(parts) - 1)
    assert "".join(p.response for p in parts) == " 4, 5, 6"


def test_a_last_assistant_message_is_continued(client):
    """As Ollama: a trailing assistant message is a prefix the model goes on with."""
    messages = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    r = client.chat(model="smollm2", messages=messages, stream=False,
                    options={**GREEDY, "num_predict": 4})
    assert r.message.content.lstrip().startswith("4")  # a new turn begins "The answer to"


def test_think_false_is_accepted_and_true_refused(client):
    """think=false reaches a template's enable_thinking (none here: the same reply);
    think=true needs a thinking model, which this is not, as Ollama answers."""
    plain = client.chat(model="smollm2", messages=CHAT, stream=False, options=GREEDY)
    off = client.chat(model="smollm2", messages=CHAT, stream=False, options=GREEDY,
                      think=False)
    assert off.message.content == plain.message.content
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2", messages=CHAT, stream=False, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error


def test_chat_streaming_and_not_agree(client):
    whole = client.chat(model="smollm2", messages=CHAT, stream=False, options=GREEDY)
    assert whole.message.role == "assistant" and "4" in whole.message.content
    assert_counters(whole, whole.eval_count)
    parts = list(client.chat(model="smollm2:latest", messages=CHAT, stream=True,
                             options=GREEDY))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == ""
    # The end-of-turn token, not text, counts in eval_count with no object of its own.
    assert_counters(parts[-1], len(parts) - (parts[-1].done_reason == "length"))
    assert parts[-1].done_reason == whole.done_reason


def test_no_num_predict_runs_until_the_model_stops(client):
    """num_predict left out is Ollama's -1: until the model stops, with the sampling
    defaults /api/show reports (the model sets none: tandem's, Ollama's own values)."""
    r = client.chat(model="smollm2", messages=SEA, stream=False, options={"temperature": 0})
    assert r.done_reason == "stop" and r.eval_count > 16
    r = client.generate(model="smollm2", prompt=SEA[0]["content"], stream=False,
                        options={"seed": 1})
    assert r.done_reason == "stop"
    show = client.show("smollm2")
    assert show.parameters.splitlines()[1:4] == ["temperature 0.8", "top_k 40", "top_p 0.9"]
    # the end-of-turn tokens, which clients such as Continue send back as stop strings
    assert 'stop "<|im_end|>"' in show.parameters.splitlines()[4:]
    assert "PARAMETER temperature 0.8" in show.modelfile


def test_options_are_honoured(client):
    r = client.generate(model="smollm2", prompt="Count: 1, 2, 3,", raw=True, stream=False,
                        options={"temperature": 0, "num_predict": 20, "stop": ["6"]})
    assert r.response == " 4, 5, " and r.done_reason == "stop"
    # raw: 4 prompt tokens, no cached block, so both runs compute the same way (int4
    # weights make a prompt's logits depend slightly on how much of it was cached)
    a, b = (client.generate(model="smollm2", prompt="Once upon a time", stream=False, raw=True,
                            options={"seed": 5, "num_predict": 8, "temperature": 1.0})
            for _ in range(2))
    assert a.response == b.response
    # A whole float for an integer option is that integer, as Ollama's option decoding has it.
    r = client.generate(model="smollm2", prompt="hi", stream=False, raw=True,
                        options={"num_predict": 3.0, "temperature": 0})
    assert r.eval_count == 3 and r.done_reason == "length"
    # Values Ollama's runner reads, not refuses: num_predict <= 0 is no bound, top_p <= 0
    # keeps the likeliest token (greedy), above 1 all of them.
    greedy = client.chat(model="smollm2", messages=CHAT, stream=False,
                         options={"temperature": 0})
    for opts in ({"num_predict": 0, "temperature": 0}, {"num_predict": -5, "temperature": 0},
                 {"top_p": 0, "temperature": 1.5},
                 {"top_p": 1.5, "temperature": 0}):
        r = client.chat(model="smollm2", messages=CHAT, stream=False, options=opts)
        assert r.done_reason == "stop", opts
        if "top_p" in opts:
            assert r.message.content == greedy.message.content, opts


def test_num_ctx_and_num_predict_are_bounds(client):
    """As in Ollama: a num_ctx above the server's window is capped at it (clients send
    one to every model), num_predict ends at the window ("length"), and only a prompt
    that leaves no room is an error."""
    r = client.generate(model="smollm2", prompt="hi", raw=True, stream=False,
                        options={"num_ctx": 4096, "num_predict": 3, "temperature": 0})
    assert r.eval_count == 3 and r.done_reason == "length"
    r = client.generate(model="smollm2", prompt="Count: 1, 2, 3,", raw=True, stream=False,
                        options={"num_ctx": 24, "num_predict": 500, "temperature": 0})
    assert r.done_reason == "length" and r.prompt_eval_count + r.eval_count == 24
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="smollm2", prompt="hi " * 40, stream=False,
                        options={"num_ctx": 32, "num_predict": 4})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


def test_ollama_names_on_every_api(client, real_server):
    """The name /api/tags lists (and Ollama's full one) is the model on /v1 too, as
    Ollama's own /v1 takes it; format {} is any JSON, as Ollama passes it on."""
    for name in ("smollm2:latest", "registry.ollama.ai/library/smollm2:latest"):
        r = httpx.post(f"{real_server.url}/v1/chat/completions", headers=real_server.headers,
                       json={"model": name, "messages": CHAT, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert client.show(name).details.family
    r = client.generate(model="smollm2", prompt="A person as JSON:", format={}, stream=False,
                        options={"num_predict": 12, "temperature": 0})
    assert r.response.lstrip().startswith("{")


def _long_chat(turns: int) -> list[dict]:
    chat = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        chat += [{"role": "user", "content": f"Question {i}: " + "tell me about the sea. " * 6},
                 {"role": "assistant", "content": f"Answer {i}: " + "the sea is wide. " * 6}]
    return chat + [{"role": "user", "content": "Say hi."}]


def test_a_chat_longer_than_the_window_loses_its_oldest_turns(client, real_server):
    """Ollama's truncate: the system message and the last turn stay, the oldest turns
    go, and the reply still has room; truncate false keeps the 400."""
    opts = {"num_ctx": 400, "num_predict": 8, "temperature": 0}
    whole = client.chat(model="smollm2", messages=_long_chat(2), options=opts)
    r = client.chat(model="smollm2", messages=_long_chat(30), options=opts)
    assert r.done_reason in ("stop", "length") and r.eval_count <= 8
    assert whole.prompt_eval_count < r.prompt_eval_count <= 400 - 8
    short = client.chat(model="smollm2", messages=_long_chat(30)[-3:], options=opts)
    assert r.prompt_eval_count > short.prompt_eval_count  # the system message and more
    body = {"model": "smollm2", "messages": _long_chat(30), "options": opts,
            "stream": False, "truncate": False}
    e = httpx.post(f"{real_server.url}/api/chat", json=body, timeout=60, headers={
        "Authorization": f"Bearer {API_KEY}"})
    assert e.status_code == 400 and "num_ctx" in e.json()["error"], e.text


def test_unknown_model_and_missing_key(client, real_server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3", messages=CHAT)
    assert e.value.status_code == 404 and "llama3" in e.value.error
    anonymous = ollama.Client(host=real_server.url)
    with pytest.raises(ollama.ResponseError) as e:
        anonymous.list()
    assert e.value.status_code == 401


def test_model_listing_endpoints(client, real_server):
    tags = client.list().models
    assert [m.model for m in tags] == ["smollm2:latest"]
    assert tags[0].size > 100e6 and tags[0].details.family == "llama"
    ps = client.ps().models
    assert ps[0].context_length == 1024 and ps[0].expires_at.year == 9999
    show = client.show("smollm2")
    assert show.modelinfo["llama.context_length"] == 1024 and "im_start" in show.template
    assert httpx.get(real_server.url + "/").text == "Ollama is running"
    assert httpx.get(real_server.url + "/api/version").json()["version"]


def test_pulling_the_served_model_succeeds_and_others_are_named(client):
    """Clients that pull before use go on: the served model is there already."""
    assert client.pull("smollm2").status == "success"
    assert [p.status for p in client.pull("smollm2:latest", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2:1b")
    assert e.value.status_code == 404 and "llama3.2:1b" in e.value.error


def test_empty_prompt_is_a_load_request(client):
    r = client.generate(model="smollm2", prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""
    # A UI's unload button: keep_alive 0 (the model stays loaded here all the same).
    assert client.generate(model="smollm2", prompt="", keep_alive=0).done_reason == "unload"
    assert client.chat(model="smollm2", messages=[], keep_alive="0s").done_reason == "unload"
    assert client.generate(model="smollm2", prompt="", keep_alive="5m").done_reason == "load"
