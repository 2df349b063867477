"""Reasoning ("thinking") out of generated text: ``<think> ... </think>``, for all three APIs.

Qwen3, QwQ and DeepSeek-R1 (and the models distilled from it) think inside
``<think> ... </think>`` before they answer. With a reasoning parser on, that
text leaves the answer and travels in its own field: ``reasoning_content``
and ``reasoning`` (vLLM's older and newer names) in chat completions, a
``reasoning`` output item in /v1/responses, ``thinking`` in Ollama's API.

Where the output starts is read off the prompt, so one parser serves every
template: a generation prompt that ends with ``<think>`` (DeepSeek-R1's
template, and Qwen3's newer ones, open the block themselves) means the
output starts inside the block and only ``</think>`` will come; otherwise a
model that thinks opens the block as its first text (Qwen3's original
template), and one that does not (``enable_thinking: false``, whose prompt
closes an empty block) writes only content. A grammar (``response_format``,
a forced tool call) waits for the block to end, as vLLM's does: the prompt's
position travels to the engine in ``StructuredOutputsParams.reasoning``.

Whitespace at the block's edges is dropped (the newlines after ``<think>``,
before and after ``</think>``), as Ollama does. An output cut off inside the
block (max_tokens) is all reasoning.

One incremental parser serves streaming and whole responses alike (a whole
response is fed output by output, as its stream is), so both always agree; a
tag split across tokens is held back until it is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tandem.sampling_params import THINK_CLOSE, THINK_OPEN, partial_suffix

if TYPE_CHECKING:
    from tandem.outputs import RequestOutput

# --reasoning-parser: auto (on when the chat template writes think blocks), none,
# or vLLM's parser names, which this parser covers both of.
MODES = ("auto", "none", "qwen3", "deepseek_r1")


def reasoning_enabled(mode: str, chat_template: str | None) -> bool:
    """Whether a server parses reasoning: as ``--reasoning-parser`` says, or under
    ``auto`` when the chat template knows both tags."""
    if mode not in MODES:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        text = chat_template or ""
        return THINK_OPEN in text and THINK_CLOSE in text
    return mode != "none"


def prompt_position(prompt_tail: str) -> Literal["inside", "closed", "may_open"]:
    """Where a prompt ending in ``prompt_tail`` leaves its output: inside a think block
    (the template opened it), after one (it closed one: thinking turned off), or
    where the model may open one."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_OPEN):
        return "inside"
    return "closed" if tail.endswith(THINK_CLOSE) else "may_open"


@dataclass
class ReasoningParser:
    """Splits generated text into reasoning and content, delta by delta.

    ``feed`` and ``finish`` return this step's (reasoning, content) text;
    ``reasoning`` and ``content`` hold the whole of each so far, and
    ``reasoning_tokens`` counts the tokens fed while the block was open (the
    one that closes it included).
    """

    state: Literal["start", "reasoning", "content"] = "start"
    reasoning: str = ""
    content: str = ""
    reasoning_tokens: int = 0
    _held: str = ""  # a tag's first characters, or whitespace that may end the block
    _trim: bool = False  # drop the whitespace that opens the block, or the answer after it
    _reopen: bool = False  # a block the prompt opened: one <think> the model adds is dropped

    @classmethod
    def for_prompt(cls, prompt_tail: str) -> ReasoningParser:
        """The parser for a prompt ending in ``prompt_tail``: after a prompt that closed
        a block (thinking turned off) everything is content, as the grammar sees it."""
        position = prompt_position(prompt_tail)
        if position == "inside":
            return cls(state="reasoning", _trim=True, _reopen=True)
        return cls(state="content") if position == "closed" else cls()

    def feed(self, text: str, tokens: int = 1) -> tuple[str, str]:
        """The next delta (``tokens`` tokens' text) -> its (reasoning, content)."""
        counted = self.state == "reasoning"
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.state, self._trim = "reasoning", True
                    buf = stripped[len(THINK_OPEN):]
                    counted = True
                elif THINK_OPEN.startswith(stripped):  # "", or a tag's first characters
                    self._held = buf
                    buf = ""
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if self._trim:  # the block's start: its whitespace goes, and a
                    buf = buf.lstrip()  # <think> the model adds to the prompt's, once
                    if self._reopen and buf.startswith(THINK_OPEN):
                        buf, self._reopen = buf[len(THINK_OPEN):], False
                        continue
                    if not buf or (self._reopen and THINK_OPEN.startswith(buf)):
                        self._held = buf
                        break
                    self._trim = self._reopen = False
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += buf[:end].rstrip()
                    self.state, self._trim = "content", True
                    buf = buf[end + len(THINK_CLOSE):]
                    continue
                keep = len(buf) - partial_suffix(buf, THINK_CLOSE)
                sure = buf[:keep].rstrip()  # whitespace that may end the block waits too
                reasoning += sure
                self._held = buf[len(sure):]
                buf = ""
            else:
                if self._trim:
                    buf = buf.lstrip()
                    self._trim = not buf
                content += buf
                buf = ""
        if counted:
            self.reasoning_tokens += tokens
        return self._add(reasoning, content)

    def finish(self) -> tuple[str, str]:
        """What was held back when the output ends: a block cut off is reasoning, the
        start of a tag that never came is content."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return self._add(held.rstrip(), "")
        return self._add("", held if self.state == "start" else "")

    def feed_output(self, out: RequestOutput) -> tuple[str, str]:
        """One engine output's (reasoning, content); the last one's includes what was held."""
        reasoning, content = self.feed(out.delta_text, len(out.new_token_ids))
        if out.finished:
            more, last = self.finish()
            reasoning, content = reasoning + more, content + last
        return reasoning, content

    def feed_outputs(self, outs: list[RequestOutput]) -> tuple[str, str]:
        """A whole response, fed output by output as its stream is (so the token count
        is the stream's): the whole (reasoning, content)."""
        for out in outs:
            self.feed_output(out)
        return self.reasoning, self.content

    def _add(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.content += content
        return reasoning, content
