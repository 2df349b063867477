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
from dataclasses import replace
from typing import Literal

from tandem.entrypoints.server.call_scanner import CallScanner, Delta, ToolCall, new_call_id
from tandem.sampling_params import partial_suffix

Family = Literal["hermes", "llama3_json"]
Mode = Literal["hermes", "llama3_json", "array", "arguments"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def template_family(chat_template: str | None) -> Family:
    """How a model writes tool calls, read off its chat template: Llama 3.1's
    template mentions ``<|python_tag|>`` or ``ipython``; everything else, and a
    template that knows no tools (which then gets Hermes's tool prompt), Hermes."""
    text = chat_template or ""
    if "<tool_call>" not in text and ("<|python_tag|>" in text or "ipython" in text):
        return "llama3_json"
    return "hermes"


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
        self._scan: CallScanner | None = None
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
        self._scan = CallScanner([], []) if self._held_calls else CallScanner(self.calls, out)
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

    def _accept(self, scan: CallScanner, out: list[Delta]) -> bool:
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
