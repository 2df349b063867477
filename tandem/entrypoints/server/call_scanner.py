"""The JSON inside a tool call, read a character at a time: each call's name as soon as
it is known and the raw text of its arguments as it comes, for the tool-call parser
(tool_parsers.py) to stream. Only enough JSON is tracked (strings, nesting, keys) to
find them; the arguments are passed through as written."""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

ARG_KEYS = ("arguments", "parameters")  # Hermes writes arguments, Llama 3 parameters
_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


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
class CallScanner:
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
        elif self.key in ARG_KEYS:
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
