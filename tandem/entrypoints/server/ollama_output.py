"""Ollama's response shapes: a Generation's outputs as /api/generate and /api/chat JSON.

The final object of every generation carries Ollama's counters in integer
nanoseconds, taken from the engine's own phase timings:

* prompt_eval_count / prompt_eval_duration: prompt tokens actually computed
  (a prefix-cache hit is not counted, as in Ollama) and the prefill time, so
  their ratio is the real prefill speed;
* eval_count / eval_duration: generated tokens and the decode time after the
  first token, so (eval_count - 1) / eval_duration is the streaming speed;
* total_duration: from the request's arrival to its last token, so
  total - prompt_eval - eval is queueing plus server overhead;
* load_duration: 0 — the model stays loaded, there is never a cold start.

Streaming sends one NDJSON object per generated token, then Ollama's last
object: ``done: true``, the counters and no text (a client may ignore a done
object's content, as Open WebUI's did).
A tool call arrives whole, in the object of the token that completes it, with
its arguments as an object (Ollama's shape); its text is not sent as content.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from tandem.entrypoints.server import logprobs
from tandem.entrypoints.server.call_scanner import ToolCall
from tandem.entrypoints.server.generation import Generation, to_api_error
from tandem.entrypoints.server.reasoning import ReasoningParser
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.tool_parsers import ToolCallParser, is_json_object
from tandem.outputs import RequestOutput


def now() -> str:
    """Ollama's created_at: UTC, to the microsecond."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def load_reply(model: str, chat: bool, done_reason: str) -> dict:
    """The whole reply to a request with nothing to generate (Ollama's "load the
    model" request): done at once, no text."""
    obj: dict = {"model": model, "created_at": now()}
    if chat:
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    obj.update({"done": True, "done_reason": done_reason})
    return obj


class OllamaView:
    """Renders one Generation's outputs as Ollama JSON (a whole reply or NDJSON lines)."""

    def __init__(self, state: ServerState, model: str, gen: Generation, t0: float, chat: bool,
                 parser: ToolCallParser | None = None,
                 reasoner: ReasoningParser | None = None) -> None:
        self.state = state
        self.model = model
        self.gen = gen
        self.t0 = t0
        self.chat = chat
        self._names = logprobs.TokenNames(state.engine.tokenizer)
        self.parser = parser
        self.reasoner = reasoner
        self._sent_calls = 0  # tool calls already streamed

    def _object(self, text: str, calls: list[ToolCall] | None = None, thinking: str = ""
                ) -> dict:
        obj: dict = {"model": self.model, "created_at": now()}
        if self.chat:
            obj["message"] = {"role": "assistant", "content": text}
            if thinking:  # omitted when empty, as Ollama's omitempty
                obj["message"]["thinking"] = thinking
            if calls:  # index: the call's place in the whole reply (a stream sends a few)
                index = {c.id: i for i, c in enumerate(self.parser.calls)} if self.parser else {}
                obj["message"]["tool_calls"] = [
                    {"id": c.id, "function": {"index": index.get(c.id, i), "name": c.name,
                                              "arguments": json.loads(c.arguments)}}
                    for i, c in enumerate(calls)]
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = False
        return obj

    def _finish(self, obj: dict, final: RequestOutput) -> dict:
        m = final.metrics
        total = time.monotonic() - self.t0
        obj.update({
            "done": True,
            "done_reason": final.finish_reason,
            "total_duration": _ns(total),
            "load_duration": 0,
            "prompt_eval_count": m.num_prompt_tokens - m.num_cached_tokens if m else 0,
            "prompt_eval_duration": _ns(m.prefill_s) if m else 0,
            "eval_count": m.num_output_tokens if m else len(final.outputs[0].token_ids),
            "eval_duration": _ns(m.decode_s) if m else 0,
        })
        if not self.chat:
            obj["context"] = list(final.prompt_token_ids) + list(final.outputs[0].token_ids)
        return obj

    def _logprobs(self, outs: list[RequestOutput]) -> list[dict]:
        k = self.gen.choices[0].params.logprobs or 0
        text = self._names.text
        return [{"token": text(t), "logprob": lp,
                 "top_logprobs": [{"token": text(u), "logprob": v} for u, v in top]}
                for t, lp, top in logprobs.entries(outs, k)]

    def whole(self, outs: list[RequestOutput]) -> dict:
        final = outs[-1]
        text, calls, thinking = final.outputs[0].text, None, ""
        if self.reasoner is not None:
            thinking, text = self.reasoner.feed_outputs(outs)
        if self.parser is not None:
            self.parser.feed(text)
            self.parser.finish()
            content, calls = self.parser.result()  # the stream's content (see openai_output.py)
            text = content or ""
        obj = self._finish(self._object(text, calls, thinking), final)
        if self.gen.choices[0].params.logprobs is not None:
            obj["logprobs"] = self._logprobs(outs)
        return obj

    async def lines(self) -> AsyncIterator[bytes]:
        want_lp = self.gen.choices[0].params.logprobs is not None
        try:
            async for _, out in self.gen:
                text, calls, thinking = self._stream_step(out)
                obj = self._object(text, calls, thinking)
                if want_lp:
                    obj["logprobs"] = self._logprobs([out])
                if out.finished:
                    if text or calls or thinking or obj.get("logprobs"):
                        yield _line(obj)  # the last token's object, then the done one
                        obj = self._object("")
                    obj = self._finish(obj, out)
                yield _line(obj)
        except Exception as e:  # after the 200 went out: an error object ends the stream
            yield _line(to_api_error(e).ollama_body())

    def _stream_step(self, out: RequestOutput) -> tuple[str, list[ToolCall], str]:
        """This token's content, the tool calls it completed (sent whole, as Ollama does)
        and its thinking."""
        text, thinking = out.delta_text, ""
        if self.reasoner is not None:
            thinking, text = self.reasoner.feed_output(out)
        if self.parser is None:
            return text, [], thinking
        p = self.parser
        deltas = p.feed(text) + (p.finish() if out.finished else [])
        done = list(itertools.takewhile(lambda c: c.complete, p.calls[self._sent_calls:]))
        self._sent_calls += len(done)
        calls = [c for c in done if is_json_object(c.arguments)]
        return "".join(d.content for d in deltas), calls, thinking


def _ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
