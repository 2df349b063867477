"""Tool calls out of generated text, token by token, for both APIs and /v1/responses.

One incremental parser serves streaming and whole responses alike (a whole
response is the stream fed at once), so both always agree. It knows four
shapes of output:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as
  Qwen2.5, Hermes and many fine-tunes write them (a JSON list inside the tags,
  SmolLM2's way, works too); text outside the tags is content;
* ``llama3_json``: Llama 3.1/3.2's bare ``{"name": ..., "parameters": {...}}``,
  the whole output (calls separated by ``;``) when it starts with ``{``;
* ``array``: ``[{"name": ..., "arguments": {...}}, ...]``, what the grammar of
  ``tool_choice: "required"`` lets the model write;
* ``arguments``: the arguments object of one known function (a named
  ``tool_choice``), so every character is an argument fragment.

Arguments stream as the raw JSON text the model writes, so the fragments a
client concatenates are exactly the final ``arguments`` string.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field, replace
from typing import Literal

from tandem.sampling_params import partial_suffix

Family = Literal["hermes", "llama3_json"]
Mode = Literal["hermes", "llama3_json", "array", "arguments"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_ARG_KEYS = ("arguments", "parameters")
_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def template_family(chat_template: str | None) -> Family:
    """How a model writes tool calls, read off its chat template: Llama 3.1's
    template mentions ``<|python_tag|>`` or ``ipython``; everything else, and a
    template that knows no tools (which then gets Hermes's tool prompt), Hermes."""
    text = chat_template or ""
    if "<tool_call>" not in text and ("<|python_tag|>" in text or "ipython" in text):
        return "llama3_json"
    return "hermes"


@dataclass
class Delta:
    """One step of parsed output: content text, a call's start, or an argument fragment."""

    content: str = ""
    index: int | None = None  # the tool call this delta belongs to
    call_id: str | None = None  # set on a call's first delta, with name
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """One call as parsed so far; ``complete`` once its object has closed."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class _Scan:
    """Incremental scanner over one JSON value that holds calls: a call object or a
    list of them. Tracks just enough JSON (strings, nesting, keys) to find each
    call's name and the raw text of its arguments."""

    calls: list[ToolCall]
    out: list[Delta]
    stack: list[str] = field(default_factory=list)
    in_str: bool = False
    esc: bool = False
    done: bool = False
    broken: bool = False
    call_depth: int = 0
    expect: str = "key"  # at call level: key, colon, value, primitive (skipped), comma
    key_raw: str | None = None
    key: str | None = None
    value: str | None = None  # "name" | "args" while that value is read
    name_raw: str = ""
    args: str = ""  # this call's argument text not yet sent (name unknown)
    call: ToolCall | None = None
    value_depth: int = 0
    primitive: bool = False

    def feed(self, ch: str) -> None:
        if self.done or self.broken:
            return
        if not self.stack:
            if ch.isspace():
                return
            if ch not in "[{":
                self.broken = True
                return
            self.call_depth = 1 if ch == "{" else 2
            self.stack.append(ch)
            if ch == "{":
                self._open_call()
            return
        if self.value == "args":
            self._arg_char(ch)
            return
        if self.in_str:
            self._str_char(ch)
            return
        depth = len(self.stack)
        if depth == self.call_depth and self.call is not None:
            self._call_level(ch)
        elif ch == '"':
            self.in_str = True
        elif ch in "[{":
            self.stack.append(ch)
            if depth + 1 == self.call_depth == 2 and ch == "{":
                self._open_call()
        elif ch in "]}":
            self.stack.pop()
            if not self.stack:
                self.done = True

    def _string_step(self, ch: str) -> None:
        """One character inside a JSON string: an escape, or the closing quote."""
        if self.esc:
            self.esc = False
        elif ch == "\\":
            self.esc = True
        elif ch == '"':
            self.in_str = False

    def _str_char(self, ch: str) -> None:
        self._string_step(ch)
        if self.key_raw is not None:
            self.key_raw += ch
            if not self.in_str:
                self.key = _loads_str(self.key_raw)
                self.key_raw = None
                self.expect = "colon"
        elif self.value == "name":
            self.name_raw += ch
            if not self.in_str:
                self._named(_loads_str(self.name_raw))
                self.value = None
                self.expect = "comma"

    def _call_level(self, ch: str) -> None:
        if self.expect == "primitive" and ch not in ",}":
            return  # a skipped number or literal
        if ch.isspace():
            return
        if self.expect == "primitive":
            self.expect = "comma"
        if self.expect == "key" and ch == '"':
            self.in_str, self.key_raw = True, '"'
        elif self.expect == "colon" and ch == ":":
            self.expect = "value"
        elif self.expect == "value":
            self._start_value(ch)
        elif self.expect == "comma" and ch == ",":
            self.expect = "key"
        elif ch == "}" and self.expect in ("key", "comma"):
            self._close_call()
        else:
            self.broken = True

    def _start_value(self, ch: str) -> None:
        if self.key == "name" and ch == '"':
            self.value, self.in_str, self.name_raw = "name", True, '"'
        elif self.key in _ARG_KEYS:
            self.value, self.value_depth = "args", len(self.stack)
            self.primitive = ch not in '[{"'
            self._arg_char(ch)
        elif ch == '"':  # another key's value: skipped, nesting tracked
            self.in_str, self.expect = True, "comma"
        elif ch in "[{":
            self.stack.append(ch)
            self.expect = "comma"
        else:
            self.expect = "primitive"

    def _arg_char(self, ch: str) -> None:
        """One character of the arguments value: sent on, and followed to its end."""
        if self.primitive:
            if ch in ",}" or ch.isspace():
                self.value, self.expect = None, "comma"
                self._call_level(ch)
            else:
                self._emit_args(ch)
            return
        self._emit_args(ch)
        if self.in_str:
            self._string_step(ch)
        elif ch == '"':
            self.in_str = True
        elif ch in "[{":
            self.stack.append(ch)
        elif ch in "]}":
            self.stack.pop()
        else:
            return
        if not self.in_str and len(self.stack) == self.value_depth:
            self.value, self.expect = None, "comma"

    def _emit_args(self, text: str) -> None:
        call = self.call
        assert call is not None
        if call.name:
            call.arguments += text
            self.out.append(Delta(index=self.calls.index(call), arguments=text))
        else:
            self.args += text

    def _open_call(self) -> None:
        self.call = ToolCall(new_call_id(), "")
        self.expect, self.args = "key", ""

    def _named(self, name: str | None) -> None:
        call = self.call
        if call is None or not name or call.name:
            self.broken = True
            return
        call.name = name
        self.calls.append(call)
        self.out.append(Delta(index=len(self.calls) - 1, call_id=call.id, name=name))
        if self.args:
            held, self.args = self.args, ""
            self._emit_args(held)

    def _close_call(self) -> None:
        if self.call is None or not self.call.name:
            self.broken = True
            return
        self.call.complete = True
        self.call = None
        self.stack.pop()
        if not self.stack:
            self.done = True


def _loads_str(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolCallParser:
    """Feed generated text deltas; get content and tool-call deltas back.

    ``feed`` may hold text back (a possible ``<tool_call>`` tag not yet
    complete); ``finish`` returns what is left. Where the model chose to call
    (hermes, llama3_json), a call is held until its JSON value has closed and is
    sent only if every call in it names a known function with a JSON-object
    argument; otherwise its text is content. So a stream never sends a call the
    whole response would not hold, and ``calls`` is what was sent, at most
    ``max_calls`` of them (``parallel_tool_calls: false``: later ones are
    dropped, as vLLM drops them).
    """

    def __init__(self, mode: Mode, known: set[str], name: str | None = None,
                 max_calls: int | None = None) -> None:
        self.mode = mode
        self.known = known
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.text = ""  # everything fed
        self.content = ""  # the content sent so far
        self._held = ""  # content not yet sent: a possible tag's start
        self._space = ""  # content not yet sent: only whitespace so far (_hold_space)
        self._scan: _Scan | None = None
        self._region = ""  # the text of the call being scanned, tag included
        self._region_calls = 0  # calls sent before it
        self._after_call = False  # hermes: a closing tag may follow
        self._started = False  # llama3_json: the first non-space character decided
        self._calls_mode = False
        if mode == "arguments":
            call = ToolCall(new_call_id(), name or "")
            self.calls.append(call)
            self._pending = [Delta(index=0, call_id=call.id, name=call.name)]
        else:
            self._pending = []

    # -------------------------------------------------------------- feeding
    def feed(self, text: str) -> list[Delta]:
        self.text += text
        out, self._pending = self._pending, []
        if self.mode == "arguments":
            if text:
                self.calls[0].arguments += text
                out.append(Delta(index=0, arguments=text))
            return out
        if self.mode == "hermes":
            self._hermes(text, out)
        else:
            self._json(text, out)
        return self._sent(out)

    def finish(self) -> list[Delta]:
        out, self._pending = self._pending, []
        if self._scan is not None and self._held_calls:  # a call the output never closed
            out.append(Delta(content=self._region))
            self._scan = None
        # After a call, what is held is the call's closing tag (cut short) or
        # the space before it: markup, not content.
        if self._held and not self._after_call:
            out.append(Delta(content=self._held))
        self._held = ""
        if self.mode == "arguments":  # complete once its object has closed
            self.calls[0].complete = is_json_object(self.calls[0].arguments)
        return self._sent(out, final=True)

    def _sent(self, out: list[Delta], final: bool = False) -> list[Delta]:
        out = _merge(out)
        if self._held_calls:
            out = self._hold_space(out, final)
        self.content += "".join(d.content for d in out)
        return out

    def _hold_space(self, out: list[Delta], final: bool) -> list[Delta]:
        """Content's trailing whitespace waits for text to follow it, and is dropped at
        the end if calls were sent: the space a model writes around its calls is not
        sent as content (a client that read a first content delta of "\n\n" as "a
        text answer" took the wrong branch), and where the whole response's content
        is only such space it is None. Trailing, not whitespace-only pieces: the
        content must not depend on how the text was split into tokens."""
        kept = []
        for d in out:
            if d.content:
                text = self._space + d.content
                sent = text.rstrip()
                self._space = text[len(sent):]
                d = replace(d, content=sent)
            if d.content or d.index is not None:
                kept.append(d)
        if final:
            if self._space and not self.calls:
                kept.append(Delta(content=self._space))
            self._space = ""
        return kept

    def _hermes(self, text: str, out: list[Delta]) -> None:
        buf = self._held + text
        self._held = ""
        while buf:
            if self._scan is not None:
                buf = self._scan_chars(buf, out)
                continue
            if self._after_call:  # skip to the closing tag (or give up on it)
                stripped = buf.lstrip()
                if not stripped:  # held: content if no closing tag follows
                    self._held = buf
                    return
                if TOOL_CALL_CLOSE.startswith(stripped[:len(TOOL_CALL_CLOSE)]):
                    if len(stripped) < len(TOOL_CALL_CLOSE):
                        self._held = buf
                        return
                    buf = stripped[len(TOOL_CALL_CLOSE):]
                elif stripped[0] == "{":  # another call in the same tags
                    buf = stripped
                    self._begin("", out)
                self._after_call = False
                continue
            at = buf.find(TOOL_CALL_OPEN)
            if at >= 0:
                if at:
                    out.append(Delta(content=buf[:at]))
                buf = buf[at + len(TOOL_CALL_OPEN):]
                self._begin(TOOL_CALL_OPEN, out)
                continue
            keep = partial_suffix(buf, TOOL_CALL_OPEN)
            if len(buf) > keep:
                out.append(Delta(content=buf[:len(buf) - keep]))
            self._held = buf[len(buf) - keep:]
            return

    def _json(self, text: str, out: list[Delta]) -> None:
        """array and llama3_json: one JSON value (llama3_json: several, split by ';')."""
        buf = text
        if self.mode == "llama3_json" and not self._started:
            stripped = (self._held + buf).lstrip()
            if not stripped:
                self._held += buf
                return
            self._started = True
            self._calls_mode = stripped[0] in "[{"
            buf, self._held = self._held + buf, ""
        while buf:
            if self.mode == "llama3_json" and not self._calls_mode:
                out.append(Delta(content=buf))
                return
            if self._scan is None:
                stripped = buf.lstrip()
                if self.mode == "llama3_json" and stripped.startswith(";"):
                    buf = stripped[1:]
                    continue
                if not stripped:
                    return
                if (self.calls and self.mode == "array") or stripped[0] not in "[{":
                    return
                self._begin("", out)
            buf = self._scan_chars(buf, out)

    @property
    def _held_calls(self) -> bool:
        """Whether calls are held until their value closes: the model chose to call."""
        return self.mode in ("hermes", "llama3_json")

    def _begin(self, tag: str, out: list[Delta]) -> None:
        self._scan = _Scan([], []) if self._held_calls else _Scan(self.calls, out)
        self._region, self._region_calls = tag, len(self.calls)


    def _scan_chars(self, buf: str, out: list[Delta]) -> str:
        """Feed the scan; what is left of ``buf`` once its value ended or broke.

        Text that turns out not to be a call (no call was sent from it yet) goes
        out as content after all, so a stream never loses what the model wrote.
        """
        scan = self._scan
        assert scan is not None
        if not self._held_calls:
            scan.out = out
        for i, ch in enumerate(buf):
            scan.feed(ch)
            self._region += ch
            if scan.done and self._held_calls and not self._accept(scan, out):
                scan.broken = True
            if scan.broken:
                self._scan = None
                if len(self.calls) == self._region_calls:
                    out.append(Delta(content=self._region))
                self._calls_mode = False  # llama3_json: the rest is content
                return buf[i + 1:]
            if scan.done:
                self._scan = None
                self._after_call = self.mode == "hermes"
                return buf[i + 1:]
        return ""

    def _accept(self, scan: _Scan, out: list[Delta]) -> bool:
        """A held value's calls sent, if it holds any and every one is a known function
        with an object of arguments; the first ``max_calls`` of the response only."""
        if not scan.calls or not all(
                c.complete and c.name in self.known and is_json_object(c.arguments)
                for c in scan.calls):
            return False
        room = len(scan.calls) if self.max_calls is None else max(
            0, min(len(scan.calls), self.max_calls - len(self.calls)))
        base = len(self.calls)
        self.calls += scan.calls[:room]
        out += [replace(d, index=base + d.index) for d in scan.out
                if d.index is not None and d.index < room]
        return True

    @property
    def forced(self) -> bool:
        """Whether a grammar forced the calls (required, a named function): they are
        sent as they are written, so a cut leaves the last one unfinished."""
        return self.mode in ("array", "arguments")

    # --------------------------------------------------------------- result
    def result(self) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole response. When the model chose (hermes,
        llama3_json), a call that does not parse, or names an unknown function, is
        content: it wrote something else. When a grammar forced the calls (array,
        arguments), a call that max_tokens or a stop cut short is left out: an agent
        runs every call in ``tool_calls``, and unfinished arguments are no call
        (finish_reason ``length`` or ``stop`` says it was cut). A stream has sent
        its start already; what was sent stays sent."""
        if self.forced:
            return None, [c for c in self.calls if c.complete and is_json_object(c.arguments)]
        if not self.calls:
            return self.content, []
        return (self.content if self.content.strip() else None), self.calls


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent pieces of the same kind as one delta (one chunk per token, not per character)."""
    merged: list[Delta] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is not None and d.call_id is None and last.call_id is None and (
                (d.index is None and last.index is None)
                or (d.index is not None and d.index == last.index and not d.content)):
            last.content += d.content
            last.arguments += d.arguments
        else:
            merged.append(d)
    return [d for d in merged if d.content or d.index is not None]
