"""Reasoning (``<think>`` blocks) out of the answer, in all three APIs.

The parser alone: every way a text can be split into deltas gives the same
reasoning and content. Over HTTP: the default model behind a chat template
that opens a think block (DeepSeek-R1's way), so its reply is reasoning; the
same prompt through /v1/completions is the raw text the parsed fields must add
up to. A regex makes the model open and close a block itself (Qwen3's way).
"""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest

from tandem.config import EngineConfig
from tandem.engine.async_engine import AsyncEngine
from tandem.entrypoints.server.app import ServerConfig
from tandem.entrypoints.server.reasoning import ReasoningParser, reasoning_enabled

# ----------------------------------------------------------------- the parser


def parse(text: str, tail: str = "", step: int = 1, cut: int = 0
          ) -> tuple[str, str, ReasoningParser]:
    """text fed as its first ``cut`` characters, then ``step`` at a time."""
    p = ReasoningParser.for_prompt(tail)
    pieces = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
    reasoning = content = ""
    for piece in pieces:
        r, c = p.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = p.finish()
    reasoning, content = reasoning + r, content + c
    assert (reasoning, content) == (p.reasoning, p.content)
    return reasoning, content, p


OPENED = "<|im_start|>assistant\n<think>\n"  # DeepSeek-R1's generation prompt
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's, thinking off


@pytest.mark.parametrize("text,tail,expected", [
    ("<think>\nI think.\n</think>\n\nParis.", "", ("I think.", "Paris.")),
    ("\n<think>I think.</think>Paris.", "", ("I think.", "Paris.")),
    ("I think.\n</think>\n\nParis.", OPENED, ("I think.", "Paris.")),
    ("<think>\nI think.\n</think>\n\nParis.", OPENED, ("I think.", "Paris.")),
    ("</think>\n\nParis.", OPENED, ("", "Paris.")),
    ("cut off mid thought <", OPENED, ("cut off mid thought <", "")),
    ("<think>\ncut off\n", "", ("cut off", "")),
    ('{"a": 1}', CLOSED, ("", '{"a": 1}')),
    ("Paris <think> x", "", ("", "Paris <think> x")),
    ("\n\nParis", "", ("", "\n\nParis")),
    ("<thi", "", ("", "<thi")),
    ("a</think>b", "", ("", "a</think>b")),
    ("<think>a</think>b</think>c", "", ("a", "b</think>c")),
    ("<think>a\n\n b</think>", "", ("a\n\n b", "")),
    ("", OPENED, ("", "")),
    ("<think>\n<think>\nx", OPENED, ("<think>\nx", "")),  # the model's one extra tag goes
    ("<think>x</think>y", CLOSED, ("", "<think>x</think>y")),  # thinking was turned off
])
def test_every_split_of_a_text_parses_alike(text, tail, expected):
    for step in (1, 2, 3, len(text) or 1):
        for cut in range(len(text) + 1):
            reasoning, content, _ = parse(text, tail, step, cut)
            assert (reasoning, content) == expected, (step, cut)


def test_tokens_inside_the_block_are_counted():
    p = ReasoningParser.for_prompt(OPENED)
    for piece in ["I", " think", ".", "</think>", "\n\n", "Paris", "."]:
        p.feed(piece)
    p.finish()
    assert p.reasoning_tokens == 4 and (p.reasoning, p.content) == ("I think.", "Paris.")


@pytest.mark.parametrize("mode,template,on", [
    ("auto", "{{ m }}<think>{{ r }}</think>", True),
    ("auto", "<|im_start|>assistant\n", False),
    ("auto", None, False),
    ("none", "<think></think>", False),
    ("qwen3", None, True),
    ("deepseek_r1", "plain", True),
])
def test_the_parser_is_on_as_the_mode_and_template_say(mode, template, on):
    assert reasoning_enabled(mode, template) is on


def test_an_unknown_mode_is_a_value_error():
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        reasoning_enabled("r1", None)


# ----------------------------------------------------------------- over HTTP

# SmolLM2's ChatML, with DeepSeek-R1's generation prompt, Qwen3's rendering of an
# assistant turn's reasoning_content and its switch to close the block (thinking off);
# model_opens leaves the block to the model (Qwen3's original generation prompt).
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content.split('</think>')[-1] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not model_opens %}<think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}"
    "{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
FORCED = "<think>\nParis is the capital\\.\n</think>\n\nParis\\."


@pytest.fixture(scope="module")
def thinker(start_server):
    """The default model behind R1_TEMPLATE, the parser on by --reasoning-parser auto."""
    engine = AsyncEngine(EngineConfig(kv_cache_memory="64MiB", max_model_len=512))
    engine.tokenizer._hf.chat_template = R1_TEMPLATE
    return start_server(engine, ServerConfig())


@pytest.fixture(scope="module")
def raw(thinker) -> str:
    """The greedy reply as written: the same prompt through /v1/completions, which
    parses nothing."""
    ids = httpx.post(f"{thinker.url}/tokenize", json={"messages": ASK}, timeout=60).json()
    r = httpx.post(f"{thinker.url}/v1/completions", json={
        "prompt": ids["tokens"], "max_tokens": 24, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.strip()
    return text


def split(raw: str) -> tuple[str, str]:
    """What the parser must make of a reply that started inside the block."""
    reasoning, _, content = raw.partition("</think>")
    return reasoning.strip(), content.lstrip()


def test_chat_completions_return_the_reasoning_apart(thinker, raw):
    client = openai.OpenAI(base_url=f"{thinker.url}/v1", api_key="-", max_retries=0,
                           timeout=120)
    whole = client.chat.completions.create(model=thinker.model, messages=ASK, max_tokens=24,
                                           **GREEDY)
    message = whole.choices[0].message
    reasoning, content = split(raw)
    assert message.model_extra["reasoning_content"] == reasoning
    assert message.model_extra["reasoning"] == reasoning
    assert (message.content or "") == content
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens <= whole.usage.completion_tokens

    stream = client.chat.completions.create(model=thinker.model, messages=ASK, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY)
    got_reasoning = got_content = ""
    usage = None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        got_reasoning += extra.get("reasoning_content") or ""
        assert extra.get("reasoning_content") == extra.get("reasoning")
        got_content += delta.content or ""
    assert (got_reasoning, got_content) == (reasoning, content)
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_a_block_the_model_opens_itself_is_parsed(thinker):
    """A regex makes the model write the whole block (Qwen3's template leaves the
    opening to the model): SmolLM2's <think> is several tokens, so the grammar
    applies from the first token. After a prompt that closed a block (thinking
    off), all of it is content, as the grammar saw it."""
    def message(kwargs: dict) -> dict:
        r = httpx.post(f"{thinker.url}/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 60, "structured_outputs": {"regex": FORCED},
            "chat_template_kwargs": kwargs, **GREEDY}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]

    opened = message({"model_opens": True})
    assert (opened["reasoning_content"], opened["content"]) == ("Paris is the capital.",
                                                                "Paris.")
    closed = message({"enable_thinking": False})
    assert "reasoning_content" not in closed
    assert closed["content"] == "<think>\nParis is the capital.\n</think>\n\nParis."


@pytest.mark.parametrize("fmt", [{"response_format": {"type": "json_object"}},
                                 {"structured_outputs": {"regex": "[0-9]+"}}])
def test_a_grammar_waits_for_the_block_to_end(thinker, raw, fmt):
    """Inside the block the model thinks freely (the raw reply, not JSON forced from
    the first token); this model never closes it, so no grammar ever applies."""
    r = httpx.post(f"{thinker.url}/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 24, **fmt, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["reasoning_content"] == split(raw)[0]


def test_ollama_returns_thinking(thinker, raw):
    client = ollama.Client(host=thinker.url, timeout=120)
    options = {"num_predict": 24, **GREEDY}
    reasoning, content = split(raw)
    whole = client.chat(model=thinker.model, messages=ASK, think=True, options=options)
    assert (whole.message.thinking, whole.message.content) == (reasoning, content)
    thinking = text = ""
    for part in client.chat(model=thinker.model, messages=ASK, stream=True, options=options):
        thinking += part.message.thinking or ""
        text += part.message.content
    assert (thinking, text) == (reasoning, content)
    gen = client.generate(model=thinker.model, prompt=ASK[0]["content"], options=options)
    assert (gen.thinking, gen.response) == (reasoning, content)
    show = client.show(thinker.model)
    assert "thinking" in show.capabilities


def test_responses_return_a_reasoning_item(thinker, raw):
    client = openai.OpenAI(base_url=f"{thinker.url}/v1", api_key="-", max_retries=0,
                           timeout=120)
    reasoning, content = split(raw)
    # An earlier turn's reasoning item, as a client sends the output back, is accepted.
    history = [{"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "old"}]}]
    resp = client.responses.create(model=thinker.model, input=[*history, *ASK],
                                   max_output_tokens=24, temperature=0)
    item = resp.output[0]
    assert item.type == "reasoning" and item.content[0].text == reasoning
    assert resp.output_text == content
    assert resp.usage.output_tokens_details.reasoning_tokens > 0

    deltas, done, kinds = "", None, []
    with client.responses.stream(model=thinker.model, input=ASK, max_output_tokens=24,
                                 temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                deltas += event.delta
            elif event.type == "response.reasoning_text.done":
                done = event.text
        final = stream.get_final_response()
    assert deltas == done == reasoning
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done:done + 3] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done"]
    assert final.output[0].type == "reasoning" and final.output_text == content


def test_earlier_reasoning_reaches_the_template(thinker):
    """An assistant turn's reasoning, as each API returned it, goes back to the template
    as reasoning_content (Qwen3's keeps it for the turns of the current tool loop)."""
    turn = [*ASK, {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Spain?"}]

    def rendered(**fields) -> str:
        messages = [dict(m, **fields) if m["role"] == "assistant" else m for m in turn]
        ids = httpx.post(f"{thinker.url}/tokenize", json={"messages": messages},
                         timeout=60).json()["tokens"]
        return httpx.post(f"{thinker.url}/detokenize", json={"tokens": ids},
                          timeout=60).json()["prompt"]

    for name in ("reasoning_content", "reasoning"):
        assert "<think>Easy.</think>Paris." in rendered(**{name: "Easy."})
    assert "<think>" not in rendered().split("And of Spain")[0]

    def ollama_prompt(**fields) -> int:
        messages = [dict(m, **fields) if m["role"] == "assistant" else m for m in turn]
        return httpx.post(f"{thinker.url}/api/chat", json={
            "model": thinker.model, "messages": messages, "stream": False,
            "options": {"num_predict": 1}}, timeout=60).json()["prompt_eval_count"]

    assert ollama_prompt(thinking="Easy, it is Paris.") > ollama_prompt()

    def responses_prompt(*thought) -> int:
        items = [ASK[0], *thought, {"role": "assistant", "content": "Paris."},
                 {"role": "user", "content": "And of Spain?"}]
        return httpx.post(f"{thinker.url}/v1/responses", json={
            "input": items, "max_output_tokens": 16}, timeout=60).json()["usage"]["input_tokens"]

    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Easy, it is Paris."}]}
    assert responses_prompt(thought) > responses_prompt()


def test_a_model_that_does_not_think_refuses_think(real_server):
    """SmolLM2's own template writes no think blocks: no parser, Ollama's 400s."""
    url, headers = real_server.url, real_server.headers
    for think, message in ((True, "does not support thinking"),
                           ("high", "think levels")):
        r = httpx.post(f"{url}/api/chat", headers=headers, json={
            "model": "smollm2", "messages": ASK, "think": think, "stream": False}, timeout=60)
        assert r.status_code == 400 and message in r.json()["error"], r.text
    r = httpx.post(f"{url}/api/show", headers=headers, json={"model": "smollm2"}, timeout=60)
    assert "thinking" not in r.json()["capabilities"]
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
        "model": "smollm2", "messages": ASK, "max_tokens": 4}, timeout=60)
    assert "reasoning_content" not in r.json()["choices"][0]["message"]
    assert "completion_tokens_details" not in r.json()["usage"]
