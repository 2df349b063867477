"""The OpenAI API, driven by the official `openai` SDK against the real default model."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY

COUNTING = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8," (SmolLM2-135M-Instruct)
CHAT = [{"role": "user", "content": "What is 2+2?"}]  # greedy: "... is 4." (12 tokens)
SEA = [{"role": "user", "content": "Write two sentences about the sea."}]  # greedy: 46 tokens


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def test_models_lists_the_served_name_and_window(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    assert models[0].max_model_len == 1024 and models[0].root.endswith(".gguf")
    assert client.models.retrieve("smollm2:latest").id == "smollm2:latest"
    r = httpx.get(str(client.base_url).rstrip("/") + "/models/",
                  headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_non_streaming_reports_usage_and_phase_split(client, real_server):
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=16,
                                       temperature=0)
    choice = r.choices[0]
    assert "4" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    ids = httpx.post(f"{real_server.url}/tokenize", json={"messages": CHAT},
                     headers=real_server.headers).json()
    assert r.usage.prompt_tokens == ids["count"]
    assert 1 <= r.usage.completion_tokens <= 16
    split = r.tandem
    assert split["output_tokens"] == r.usage.completion_tokens
    assert split["prefill_s"] > 0 and split["queue_s"] >= 0 and split["decode_s"] >= 0
    assert split["ttft_s"] <= split["e2e_s"]
    assert split["prefill_tokens_per_s"] > 0


def test_chat_without_limits_runs_until_the_model_stops(client):
    """No max_tokens: until the model stops or the context is full (OpenAI's and vLLM's
    default), not 16 tokens; greedy, and with the server's sampling defaults."""
    r = client.chat.completions.create(model="smollm2", messages=SEA, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 16
    r = client.chat.completions.create(model="smollm2", messages=SEA, seed=1)
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="smollm2", messages=SEA, seed=1,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        r.choices[0].message.content


def test_chat_streaming_matches_non_streaming_one_chunk_per_token(client):
    kwargs = dict(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks if c.choices]
    # The role arrives with the first token, never alone before it.
    first = token_chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is not None
    assert all(c.choices[0].delta.role is None for c in token_chunks[1:])
    text = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    assert text == whole.choices[0].message.content
    assert token_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len(token_chunks) == whole.usage.completion_tokens
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.tandem["output_tokens"] == whole.usage.completion_tokens


def test_completions_streaming_and_not_agree(client):
    whole = client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=8,
                                      temperature=0)
    assert whole.choices[0].text == " 5, 6, 7"  # 3 tokens a number: " ", "5", ","
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    stream = list(client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    assert stream[-1].choices[0].finish_reason == "length"
    assert stream[-1].tandem["output_tokens"] == 8  # no include_usage: on the last chunk


def test_completions_prompt_forms_and_echo(client, real_server):
    ids = httpx.post(f"{real_server.url}/tokenize", json={"prompt": COUNTING},
                     headers=real_server.headers).json()["tokens"]
    r = client.completions.create(model="smollm2", prompt=[COUNTING, "Once upon a time"],
                                  max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == COUNTING + " 5, 6,"
    assert r.choices[1].text.startswith("Once upon a time")
    for prompt in (ids, [ids]):  # token ids: one prompt, and a batch of one
        r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6,
                                      temperature=0, echo=True)
        assert r.choices[0].text == COUNTING + " 5, 6,"
        assert r.usage.prompt_tokens == len(ids)
    # The prompt as sent, special tokens and all (a text prompt's echo keeps them too).
    r = client.completions.create(model="smollm2", prompt=[1, *ids], max_tokens=1,
                                  temperature=0, echo=True)
    assert r.choices[0].text.startswith("<|im_start|>" + COUNTING)


def test_completions_echo_with_logprobs_scores_the_prompt(client):
    # lm-evaluation-harness's log-likelihood request: the prompt's tokens and their
    # logprobs first (the first token none), then the generated one.
    r = client.completions.create(model="smollm2", prompt=COUNTING + " 5, 6", max_tokens=1,
                                  temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    n = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n + 1)]
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == v and 1 <= len(top) <= 2
    # A counting model is sure of the continuation it was shown: the last prompt
    # token (" 6" after " 5,") is its greedy choice, scored as such.
    assert lp.token_logprobs[n - 1] == max(lp.top_logprobs[n - 1].values())
    # Streaming: the first chunk carries the echoed prompt's entries.
    first = next(iter(client.completions.create(
        model="smollm2", prompt=COUNTING + " 5, 6", max_tokens=1, temperature=0, echo=True,
        logprobs=1, stream=True)))
    assert first.choices[0].logprobs.token_logprobs == lp.token_logprobs
    plain = client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=2,
                                      temperature=0, logprobs=1)
    assert len(plain.choices[0].logprobs.tokens) == 2  # no echo: the output's only
    # OpenAI's legacy scoring request: max_tokens 0 with echo, the prompt alone.
    for stream in (False, True):
        r = client.completions.create(model="smollm2", prompt=COUNTING + " 5, 6", max_tokens=0,
                                      echo=True, logprobs=1, stream=stream)
        parts = list(r) if stream else [r]
        [choice] = [c for part in parts for c in part.choices]
        assert choice.text == COUNTING + " 5, 6" and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == lp.token_logprobs[:-1]
        assert stream or r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=0)


def test_echoed_logprobs_index_the_text_and_keep_every_alternative(client):
    """Characters over several tokens (each alone decodes to U+FFFD): offsets still
    index the echoed text, and the parts are named OpenAI's way (bytes:\\xNN), so no
    two alternatives share a key and a top-1 check (lm-evaluation-harness's greedy
    test) reads the real top value."""
    text = "Héllo wörld, 日本語のテキスト, emoji 🌟🚀 done."
    r = client.completions.create(model="smollm2", prompt=text, max_tokens=2, temperature=0,
                                  echo=True, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(text)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(c.text)
    parts = [t for t in lp.tokens if t.startswith("bytes:")]
    assert parts  # the emoji and the CJK characters span tokens
    for tok, at in zip(lp.tokens, lp.text_offset):
        if not tok.startswith("bytes:"):
            assert c.text[at:at + len(tok)] == tok.lstrip(" ") or c.text[at:].startswith(tok)
    for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) >= 3 and v <= max(top.values()) + 1e-6


def test_n2_fans_out_with_distinct_seeds(client):
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, n=2,
                                       temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(c["output_tokens"] for c in r.tandem["choices"])
    again = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, n=2,
                                           temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    stream = list(client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=3,
                                            n=2, temperature=0, stream=True))
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: " 5,", 1: " 5,"}


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="smollm2", prompt="Once upon a time",
                                         max_tokens=12, temperature=1.0, seed=seed
                                         ).choices[0].text

    a = sample(1234)
    assert sample(1234) == a
    assert sample(4321) != a


def test_stop_string_and_stop_token(client):
    r = client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=12,
                                  temperature=0, stop=["7"])
    c = r.choices[0]
    assert c.text == " 5, 6, " and c.finish_reason == "stop" and c.stop_reason == "7"
    r = client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=12,
                                  temperature=0, extra_body={"stop_token_ids": [39]})
    c = r.choices[0]
    assert c.text == " 5, 6, " and c.finish_reason == "stop" and c.stop_reason == 39


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert e.logprob == pytest.approx(tops[0])  # greedy picks the most likely token
        assert e.top_logprobs[0].token == e.token
    assert "".join(e.token for e in entries).startswith(r.choices[0].message.content[:5])


def test_logprob_bytes_join_into_characters(client):
    """A character split across tokens: each token's text is U+FFFD, its bytes its own
    part, so the bytes join into the reply (OpenAI's reason for the field)."""
    r = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=1,
        extra_body={"structured_outputs": {"regex": "🌍🌍 ok"}})
    entries = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "🌍🌍 ok" and "\ufffd" in entries[0].token
    assert b"".join(bytes(e.bytes) for e in entries).decode() == "🌍🌍 ok"
    tops = [t for e in entries for t in e.top_logprobs]
    assert all(bytes(t.bytes).decode() == t.token for t in tops if "\ufffd" not in t.token)


def test_completion_logprobs(client):
    r = client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == " 5, "
    assert len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [0, 1, 2, 3]
    # Sampled at T=1, a token outside the top 2 still has its entry (up to logprobs + 1).
    r = client.completions.create(model="smollm2", prompt="My favourite word is", max_tokens=32,
                                  temperature=2.0, seed=3, logprobs=1)
    lp = r.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some token was not the likeliest


def test_list_of_parts_content(client):
    parts = [{"type": "text", "text": "What is the capital"},
             {"type": "text", "text": "of France?"}]
    r = client.chat.completions.create(model="smollm2", max_tokens=1, temperature=0,
                                       messages=[{"role": "user", "content": parts}])
    assert r.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="only text parts"):
        client.chat.completions.create(model="smollm2", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}])
    # An assistant turn's refusal part, replayed in the history, is its text (as the
    # same words in a text part); a user's refusal part is a 400.
    asked = {"role": "user", "content": "Tell me a secret."}
    refused = [{"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
               {"role": "assistant", "content": [{"type": "text", "text": "I can't."}]}]
    counts = {client.chat.completions.create(
        model="smollm2", max_tokens=1, messages=[asked, turn, {"role": "user", "content": "Ok"}]
    ).usage.prompt_tokens for turn in refused}
    assert len(counts) == 1
    with pytest.raises(openai.BadRequestError, match="only text parts are supported"):
        client.chat.completions.create(model="smollm2", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])


def test_prefix_cache_shows_in_cached_tokens(client):
    system = "You answer in one word. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < r.usage.prompt_tokens
    assert r.tandem["cached_tokens"] == cached


def test_errors_map_to_sdk_exceptions(client, real_server):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=-1)
    with pytest.raises(openai.BadRequestError) as e:  # never a silent truncation
        client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=5000)
    assert "1024" in str(e.value) and "5000" in str(e.value)
    with pytest.raises(openai.BadRequestError):  # before any byte of the stream
        client.chat.completions.create(model="smollm2", messages=CHAT, stream=True,
                                       temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
    bad = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{real_server.url}/v1/chat/completions", json={"messages": CHAT})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{real_server.url}/health").status_code == 200  # probes need no key


def test_tokenize_detokenize_round_trip(real_server):
    h = real_server.headers
    tok = httpx.post(f"{real_server.url}/tokenize", json={"prompt": "hello world"},
                     headers=h).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    text = httpx.post(f"{real_server.url}/detokenize", json={"tokens": tok["tokens"]},
                      headers=h).json()["prompt"]
    assert text == "hello world"
    r = httpx.post(f"{real_server.url}/detokenize", json={"tokens": [10**9]}, headers=h)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_tokenize_counts_the_tools_chat_renders(client, real_server):
    """/tokenize with tools (vLLM's field) counts what a chat completion's prompt is."""
    tools = [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}}}}]
    messages = [*CHAT, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tok = httpx.post(f"{real_server.url}/tokenize", headers=real_server.headers,
                     json={"messages": messages, "tools": tools}).json()
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=tools,
                                       max_tokens=1)
    assert tok["count"] == r.usage.prompt_tokens
    bare = httpx.post(f"{real_server.url}/tokenize", headers=real_server.headers,
                      json={"messages": messages}).json()
    assert bare["count"] < tok["count"]


def test_continue_final_message(client, real_server):
    """vLLM's continue_final_message: the last (assistant) message is left open and the
    model goes on with it; the prompt ends with its text, not a new turn's header."""
    messages = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    h = real_server.headers
    ids = httpx.post(f"{real_server.url}/tokenize", json=body, headers=h).json()["tokens"]
    text = httpx.post(f"{real_server.url}/detokenize", json={"tokens": ids},
                      headers=h).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    r = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                       max_tokens=4, extra_body=body)
    assert r.usage.prompt_tokens == len(ids) and "4" in r.choices[0].message.content
    bad = httpx.post(f"{real_server.url}/v1/chat/completions", headers=h,
                     json={**body, "add_generation_prompt": True})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "continue_final_message"
