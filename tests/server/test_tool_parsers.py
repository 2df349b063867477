"""The tool-call parser and the tools' way into chat templates, without a server.

The parser must give the same calls and content however the text is split
into deltas (one token may be one character or a whole tag), and the argument
fragments it streams must concatenate to exactly the final arguments.
"""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.server.protocol import ChatTool, NamedToolChoice
from tandem.entrypoints.server.structured import plan_tools, template_messages
from tandem.entrypoints.server.tool_parsers import ToolCallParser, template_family
from tandem.model.gguf import gguf_to_hf_dir
from tandem.paths import default_model_path
from tandem.tokenizer import Tokenizer

KNOWN = {"get_weather", "f"}
HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Pa\\"ris}", "n": [1, {"a": 2}]}}\n</tool_call>\n<tool_call>'
          '[{"arguments": {"x": 1}, "name": "f"}]</tool_call>')


def run(mode: str, text: str, step: int, name: str | None = None,
        max_calls: int | None = None):
    """Feed ``text`` in pieces of ``step`` characters; (content, {index: (name, args)}, parser)."""
    p = ToolCallParser(mode, KNOWN, name, max_calls)  # type: ignore[arg-type]
    deltas = []
    for i in range(0, len(text), step):
        deltas += p.feed(text[i:i + step])
    deltas += p.finish()
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        if d.call_id is not None:
            assert d.index not in calls and d.arguments == ""  # the header comes first, alone
            calls[d.index] = [d.name, ""]
        elif d.index is not None:
            calls[d.index][1] += d.arguments
    return content, {i: tuple(c) for i, c in calls.items()}, p


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 1000])
def test_hermes_any_split(step):
    content, calls, p = run("hermes", HERMES, step)
    assert content == "Let me check."  # the space before the calls is not content
    assert calls == {0: ("get_weather", '{"city": "Pa\\"ris}", "n": [1, {"a": 2}]}'),
                     1: ("f", '{"x": 1}')}
    text, found = p.result()
    assert text == "Let me check." and [c.name for c in found] == ["get_weather", "f"]
    assert [c.arguments for c in found] == [calls[0][1], calls[1][1]]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in found)


@pytest.mark.parametrize("text", ["plain text <tool", "a < b and <tool_cal", "no tags at all"])
def test_hermes_text_without_a_call_is_content(text):
    for step in (1, 4, 100):
        content, calls, p = run("hermes", text, step)
        assert content == text and calls == {} and p.result() == (text, [])


BROKEN = [
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not a given tool
    '<tool_call>{"name": "f", "arguments": 5}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut short
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    "<tool_call>not json</tool_call>",
]


@pytest.mark.parametrize("text", BROKEN)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_broken_call_is_content_streamed_and_whole(text, step):
    """Nothing of a call the whole response would not hold is streamed as a call."""
    content, calls, p = run("hermes", text, step)
    assert calls == {} and content == text and p.result() == (text, [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_good_calls_beside_a_broken_one(step):
    good = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for text in (good + " " + BROKEN[0], BROKEN[1] + good):
        content, calls, p = run("hermes", text, step)
        broken = text.replace(good, "")
        assert content == broken and calls == {0: ("f", '{"a": 1}')}
        whole, found = p.result()
        assert whole == content and [(c.name, c.arguments) for c in found] == [calls[0]]


CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}'


@pytest.mark.parametrize("text,expected", [
    (f"{CALL}\n</tool_call>\n{CALL}\n</tool_call", ""),  # max_tokens cut the last tag
    (f"{CALL}\n</tool_call>\n{CALL}\n</tool_call>\n\n", ""),
    (f"\n\n{CALL}\n</tool_call>\n", ""),  # space before the first call too
    (f'{CALL} {{"name": "f", "arguments": {{"a": 1}}}}</tool_call>', ""),  # two in one tag
    (f"{CALL}\n\nThe answer.", "\n\nThe answer."),  # no closing tag: text goes on
    (f"{CALL}\n</tool_call>\n\n  Done.", "\n\n  Done."),
])
@pytest.mark.parametrize("step", [1, 2, 3, 1000])
def test_text_after_a_call_streamed_and_whole(text, expected, step):
    """Space between a call and its closing tag, and a closing tag cut short, are
    markup; space around calls is content only before text that follows (a stream
    sends no content the whole response does not hold): the same however it streams."""
    content, calls, p = run("hermes", text, step)
    assert content == expected and all(c == ("f", '{"a": 1}') for c in calls.values())
    assert p.result()[0] == (expected if expected.strip() else None)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_max_calls_keeps_the_first(step):
    """parallel_tool_calls false: the first call only, the rest dropped (vLLM's way)."""
    content, calls, p = run("hermes", HERMES, step, max_calls=1)
    assert content == "Let me check." and list(calls) == [0] and len(p.calls) == 1
    content, calls, p = run("llama3_json", '{"name": "f", "parameters": {}}; '
                            '{"name": "f", "parameters": {"b": 2}}', step, max_calls=1)
    assert content == "" and calls == {0: ("f", "{}")}


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_llama3_json(step):
    text = '{"name": "f", "parameters": {"q": true}}; {"name": "get_weather", "parameters": {}}'
    content, calls, p = run("llama3_json", text, step)
    assert content == "" and calls == {0: ("f", '{"q": true}'), 1: ("get_weather", "{}")}
    assert p.result()[0] is None
    content, calls, p = run("llama3_json", 'Hello {"name": "f"}', step)
    assert content == 'Hello {"name": "f"}' and calls == {}


@pytest.mark.parametrize("step", [1, 6, 1000])
def test_array_and_arguments_modes(step):
    text = '[{"name": "f", "arguments": {"a": "]}"}}, {"name": "get_weather", "arguments": {}}]'
    content, calls, p = run("array", text, step)
    assert calls == {0: ("f", '{"a": "]}"}'), 1: ("get_weather", "{}")}
    assert all(c.complete for c in p.result()[1])
    # cut by max_tokens: streamed as far as it went, but no call in the whole result
    _, calls, p = run("array", text[:-4], step)
    assert calls == {0: ("f", '{"a": "]}"}'), 1: ("get_weather", "")}
    assert [(c.name, c.complete) for c in p.result()[1]] == [("f", True)]
    content, calls, p = run("arguments", '{"city": "Oslo"}', step, name="get_weather")
    assert calls == {0: ("get_weather", '{"city": "Oslo"}')} and content == ""
    _, _, p = run("arguments", '{"city": "Os', step, name="get_weather")
    assert p.result() == (None, [])


def test_template_family():
    assert template_family("{{ '<tool_call>' }}{% if tools %}") == "hermes"
    assert template_family("{{ '<|python_tag|>' }}{% if tools %}ipython") == "llama3_json"
    assert template_family(None) == "hermes"


def _tools() -> list[ChatTool]:
    return [ChatTool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}})]


def test_a_template_without_tools_gets_hermes_text():
    plan = plan_tools(_tools(), "auto", True, "{{ messages }}")
    assert plan is not None and not plan.native and plan.parser().mode == "hermes"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {"a": 2}}}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
    ]
    out, tools = template_messages(messages, plan, "{{ messages }}")
    assert tools is None
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(plan.tools[0]) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'}
    assert out[3:] == [{"role": "user", "content": "<tool_response>\none\n</tool_response>\n"
                                                   "<tool_response>\ntwo\n</tool_response>"}]


def test_calls_in_a_conversation_without_tools_are_rendered_too():
    """An agent's last turn often offers no tools: the conversation's calls and
    results still reach a template that knows no tools, as Hermes text (they
    vanished, and an unknown role "tool" was left); no tools' system prompt."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "RESULT42", "tool_call_id": "c1"},
    ]
    out, tools = template_messages(messages, None, "{{ messages }}")
    assert tools is None and out == [
        {"role": "user", "content": "hi"},
        {"role": "assistant",
         "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\nRESULT42\n</tool_response>"}]
    plain = [{"role": "user", "content": "hi"}]
    assert template_messages(plain, None, "{{ messages }}") == (plain, None)
    native = "{% for t in tools %}{% endfor %}"  # renders calls itself
    assert template_messages(messages, None, native) == (messages, None)


def test_a_template_with_tools_gets_them_as_they_are():
    plan = plan_tools(_tools(), NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "f"}}), False,
        "{% for t in tools %}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    out, tools = template_messages(messages, plan, "{% for t in tools %}{% endfor %}")
    assert out == messages and tools == plan.tools
    assert plan.constraint().params.json == {"type": "object"}


def test_tools_and_calls_reach_a_template_that_renders_them():
    """A tools-aware template (Qwen2.5's shape, cut down) gets the tools and the calls as
    objects through Tokenizer.render_chat, the path the server's chat_ids takes."""
    tok = Tokenizer.from_dir(gguf_to_hf_dir(default_model_path()))
    tok._hf.chat_template = (
        "{% for t in tools %}<tools>{{ t.function.name }}</tools>{% endfor %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}"
        "</tool_call>{% endfor %}{% endfor %}")
    plan = plan_tools(_tools(), "auto", True, tok.chat_template)
    assert plan is not None and plan.native and plan.family == "hermes"
    messages, tools = template_messages([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"}], plan, tok.chat_template)
    text = tok.render_chat(messages, add_generation_prompt=False, tools=tools)
    assert text == '<tools>f</tools>[user]hi[assistant]<tool_call>{"a": 1}</tool_call>[tool]done'


@pytest.mark.parametrize("mode,text", [
    ("hermes", 'A <tool_call>{"nme": "f"} oops</tool_call> and on <b>'),
    ("hermes", "<tool_call>not json, just <tool_call"),
    ("llama3_json", '{"answer": 42, "why": "json content"} trailing'),
    ("llama3_json", '{"name": 5}'),
    ("llama3_json", "[1, 2]"),  # a JSON value holding no call
    ("hermes", "<tool_call>[]</tool_call> done"),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_stream_never_drops_text_that_is_not_a_call(mode, text, step):
    content, calls, p = run(mode, text, step)
    assert calls == {} and content == text and p.result() == (text, [])


def test_chat_template_kwargs_reach_the_template():
    """vLLM's chat_template_kwargs: variables a template reads (Qwen3's enable_thinking);
    the ones apply_chat_template takes itself are refused, not silently overridden."""
    tok = Tokenizer.from_dir(gguf_to_hf_dir(default_model_path()))
    tok._hf.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(messages) == "hi"
    assert tok.render_chat(messages, template_kwargs={"enable_thinking": False}) == \
        "hi<no-think>"
    with pytest.raises(ValueError, match="may not set add_generation_prompt, tools"):
        tok.render_chat(messages, template_kwargs={"tools": [], "add_generation_prompt": 1})
