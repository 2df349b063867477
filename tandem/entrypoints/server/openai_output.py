"""OpenAI's response shapes: a Generation's outputs as completion and chat JSON.

Whole responses and stream chunks both come from ``OpenAIView``. Streaming
sends one SSE chunk per generated token; a chat's role arrives with the first
token, never before it, so the client's time to first token is the real one.
Every final response (or final chunk) carries a ``tandem`` object with the
request's queue, prefill and decode times, so an OpenAI client sees the same
phase split an Ollama client gets from its counters.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from tandem.entrypoints.server import logprobs
from tandem.entrypoints.server.call_scanner import Delta
from tandem.entrypoints.server.generation import Generation, to_api_error
from tandem.entrypoints.server.reasoning import ReasoningParser
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.streaming import ClosingStreamingResponse
from tandem.entrypoints.server.structured import ToolPlan
from tandem.entrypoints.server.tool_parsers import ToolCallParser
from tandem.outputs import RequestMetrics, RequestOutput


def sse_response(gen: Generation, chunks: AsyncIterator[dict]) -> ClosingStreamingResponse:
    """The chunks as SSE events, then ``[DONE]``; closing the response closes ``gen``."""
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield _event(chunk)
        except Exception as e:  # after the 200 went out: an error event, then [DONE]
            yield _event(to_api_error(e).openai_body())
        yield b"data: [DONE]\n\n"

    return ClosingStreamingResponse(body(), gen.close, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def phase_split(m: RequestMetrics | None) -> dict | None:
    """The ``tandem`` extension: where this request's time went."""
    if m is None:
        return None
    split = {
        "queue_s": round(m.queued_s, 6), "prefill_s": round(m.prefill_s, 6),
        "decode_s": round(m.decode_s, 6),
        "ttft_s": None if m.ttft_s is None else round(m.ttft_s, 6),
        "e2e_s": None if m.e2e_s is None else round(m.e2e_s, 6),
        "prefill_tokens_per_s": round(m.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(m.decode_tokens_per_s, 2),
        "prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
        "output_tokens": m.num_output_tokens, "preemptions": m.num_preemptions,
    }
    if m.kv_transfer_s is not None:  # disaggregated: prefill and decode on two replicas
        split["kv_transfer_s"] = round(m.kv_transfer_s, 6)
        split["kv_transfer_bytes"] = m.kv_transfer_bytes
    return split


class OpenAIView:
    """Renders one Generation's outputs as OpenAI JSON (whole responses or chunks)."""

    def __init__(self, state: ServerState, model: str, gen: Generation, n: int,
                 return_token_ids: bool, plan: ToolPlan | None = None,
                 reasoners: list[ReasoningParser | None] | None = None) -> None:
        self.state = state
        self._names = logprobs.TokenNames(state.engine.tokenizer)
        self.model = model
        self.gen = gen
        self.n = n  # choices per prompt
        self.return_token_ids = return_token_ids
        self.created = int(time.time())
        self._offsets: list[logprobs.TextOffsets | None] = [None] * len(gen.choices)
        self._parsers = [plan.parser() if plan else None for _ in gen.choices]
        self._reasoners = reasoners or [None] * len(gen.choices)

    # --------------------------------------------------------- shared parts
    def _finals(self) -> list[RequestOutput | None]:
        return [c.final for c in self.gen.choices]

    def usage(self) -> dict:
        finals = self._finals()
        prompt = cached = completion = 0
        for i, c in enumerate(self.gen.choices):
            m = finals[i].metrics if finals[i] is not None else None
            completion += m.num_output_tokens if m else c.num_tokens
            if i % self.n == 0:  # a prompt shared by n choices is counted once
                prompt += len(c.prompt_ids)
                cached += m.num_cached_tokens if m else 0
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if any(self._reasoners):
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                r.reasoning_tokens for r in self._reasoners if r is not None)}
        return usage

    def tandem(self) -> dict | None:
        """The phase split: the first choice's at the top level, each choice's in
        ``choices`` when there are several (``usage`` sums them; a split cannot)."""
        splits = [phase_split(f.metrics) if f is not None else None for f in self._finals()]
        if not splits or splits[0] is None:
            return None
        out = dict(splits[0])
        if len(splits) > 1:
            out["choices"] = splits
        return out

    def _completion_logprobs(self, index: int, outs: list[RequestOutput], k: int,
                             echoed: RequestOutput | None = None) -> dict:
        """``echoed``: the output holding the prompt's logprobs, whose tokens come
        first (the first with none: nothing precedes it)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        name, at = self._names.name, self._offsets[index]

        def add(tid: int, lp: float | None, top: list | None, offset: int) -> None:
            tokens.append(name(tid))
            token_lps.append(lp)
            tops.append(None if top is None else {name(t): v for t, v in top})
            offsets.append(offset)

        if echoed is not None:
            first = echoed.prompt_token_ids[0]
            add(first, None, None, at.prompt_token(first, name(first)))
            for tid, lp, top in logprobs.prompt_entries(echoed, k):
                add(tid, lp, top, at.prompt_token(tid, name(tid)))
        for tid, lp, top in logprobs.entries(outs, k, with_sampled=True):
            add(tid, lp, top, at.output_token(tid, name(tid)))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _start_offsets(self, index: int, echo: str) -> None:
        """A choice's text offsets, when it reports logprobs (they decode as they go)."""
        c = self.gen.choices[index]
        if c.params.logprobs is not None:
            self._offsets[index] = logprobs.TextOffsets(
                self.state.engine.tokenizer, c.prompt_ids, echo,
                c.params.prompt_logprobs is not None, c.params.skip_special_tokens)

    def _chat_logprobs(self, outs: list[RequestOutput], k: int) -> dict:
        return {"content": logprobs.token_logprobs(outs, k, self._names)}

    def _header(self, obj: str) -> dict:
        return {"id": self.gen.request_id, "object": obj, "created": self.created,
                "model": self.model}

    # ------------------------------------------------------------ completions
    def completion_response(self, outs: list[list[RequestOutput]], echo: list[str]) -> dict:
        choices = []
        for c, c_outs in zip(self.gen.choices, outs):
            final = c_outs[-1]
            prefix = echo[c.index // self.n]
            k = c.params.logprobs
            self._start_offsets(c.index, prefix)
            echoed = final if c.params.prompt_logprobs is not None else None
            choice = {
                "index": c.index, "text": prefix + final.outputs[0].text,
                "logprobs": None if k is None else self._completion_logprobs(
                    c.index, c_outs, k, echoed),
                "finish_reason": final.finish_reason, "stop_reason": final.outputs[0].stop_reason,
            }
            if self.return_token_ids:
                choice["prompt_token_ids"] = c.prompt_ids
                choice["token_ids"] = final.outputs[0].token_ids
            choices.append(choice)
        return {**self._header("text_completion"), "choices": choices, "usage": self.usage(),
                "tandem": self.tandem()}

    def completion_chunks(self, echo: list[str], include_usage: bool) -> AsyncIterator[dict]:
        def body(index: int, out: RequestOutput, first: bool) -> dict:
            text = out.delta_text
            if first:  # echo: the prompt precedes the first token's text
                prefix = echo[index // self.n]
                self._start_offsets(index, prefix)
                text = prefix + text
            params = self.gen.choices[index].params
            k = params.logprobs
            echoed = out if first and params.prompt_logprobs is not None else None
            return {"text": text, "logprobs": None if k is None else self._completion_logprobs(
                index, [out], k, echoed)}

        return self._chunks("text_completion", include_usage, body)

    async def _chunks(
        self, obj: str, include_usage: bool,
        body: Callable[[int, RequestOutput, bool], dict | None],
    ) -> AsyncIterator[dict]:
        """The streaming loop both endpoints share; body(index, out, first) gives the
        choice's text or delta and logprobs, or None: this output sends no chunk."""
        started: set[int] = set()
        left = len(self.gen.choices)
        async for index, out in self.gen:
            part = body(index, out, index not in started)
            if part is None:
                continue
            started.add(index)
            choice = {"index": index,
                      "finish_reason": out.finish_reason if out.finished else None}
            choice.update(part)
            if out.finished:
                choice["stop_reason"] = out.outputs[0].stop_reason
                left -= 1
            if self.return_token_ids:
                choice["token_ids"] = out.new_token_ids
            chunk = {**self._header(obj), "choices": [choice]}
            yield self._finish_chunk(chunk, include_usage, last=left == 0)
        if include_usage:
            yield {**self._header(obj), "choices": [], "usage": self.usage(),
                   "tandem": self.tandem()}

    def _finish_chunk(self, chunk: dict, include_usage: bool, last: bool) -> dict:
        if include_usage:
            chunk["usage"] = None
        elif last:
            chunk["tandem"] = self.tandem()
        return chunk

    # ------------------------------------------------------------------ chat
    def chat_response(self, outs: list[list[RequestOutput]]) -> dict:
        choices = []
        for c, c_outs in zip(self.gen.choices, outs):
            final = c_outs[-1]
            k = c.params.logprobs
            text, reasoning = final.outputs[0].text, None
            reasoner = self._reasoners[c.index]
            if reasoner is not None:
                reasoning, text = reasoner.feed_outputs(c_outs)
            message: dict = {"role": "assistant", "content": text}
            if reasoning:
                message["content"] = text or None
                message.update(reasoning_fields(reasoning))
            finish_reason = final.finish_reason
            parser = self._parsers[c.index]
            if parser is not None:
                parser.feed(text)
                parser.finish()
                # The parser's content, as the stream sent it: a forced call that
                # max_tokens cut before its name is no content either.
                message["content"], calls = parser.result()
                if calls:
                    message["tool_calls"] = [
                        {"id": t.id, "type": "function",
                         "function": {"name": t.name, "arguments": t.arguments}}
                        for t in calls]
                    finish_reason = tool_finish_reason(parser, finish_reason,
                                                       final.outputs[0].stop_reason)
            choice = {
                "index": c.index, "message": message,
                "logprobs": None if k is None else self._chat_logprobs(c_outs, k),
                "finish_reason": finish_reason, "stop_reason": final.outputs[0].stop_reason,
            }
            if self.return_token_ids:
                choice["token_ids"] = final.outputs[0].token_ids
            choices.append(choice)
        resp = {**self._header("chat.completion"), "choices": choices, "usage": self.usage(),
                "tandem": self.tandem()}
        if self.return_token_ids:
            resp["prompt_token_ids"] = self.gen.choices[0].prompt_ids
        return resp

    def chat_chunks(self, include_usage: bool) -> AsyncIterator[dict]:
        def body(index: int, out: RequestOutput, first: bool) -> dict | None:
            # The role travels with the first token, so client-side TTFT is honest.
            delta = {"role": "assistant"} if first else {}
            text, reasoning = out.delta_text, ""
            reasoner = self._reasoners[index]
            if reasoner is not None:
                reasoning, text = reasoner.feed_output(out)
            delta["content"] = text
            if reasoning:
                delta["content"] = text or None
                delta.update(reasoning_fields(reasoning))
            k = self.gen.choices[index].params.logprobs
            body = {"delta": delta,
                    "logprobs": None if k is None else self._chat_logprobs([out], k)}
            parser = self._parsers[index]
            if parser is not None:
                deltas = parser.feed(text) + (parser.finish() if out.finished else [])
                if not (deltas or reasoning or first or out.finished or k is not None
                        or self.return_token_ids):
                    # A token the parser holds (a forced call's scaffolding, a tag's
                    # start) sends nothing, as in vLLM: no empty content deltas.
                    return None
                delta["content"] = "".join(d.content for d in deltas)
                calls = tool_call_deltas(deltas)
                if calls:
                    delta["tool_calls"] = calls
                if calls or reasoning:
                    delta["content"] = delta["content"] or None
                if out.finished and parser.calls:
                    body["finish_reason"] = tool_finish_reason(parser, out.finish_reason,
                                                               out.outputs[0].stop_reason)
            return body

        return self._chunks("chat.completion.chunk", include_usage, body)


def reasoning_fields(text: str) -> dict[str, str]:
    """A message's or delta's reasoning under both of vLLM's names: ``reasoning_content``
    (vLLM before 0.11, DeepSeek's API, most clients) and ``reasoning`` (vLLM since)."""
    return {"reasoning_content": text, "reasoning": text}


def tool_finish_reason(parser: ToolCallParser, reason: str | None,
                       stop_reason: int | str | None) -> str | None:
    """A response that called tools ends with ``tool_calls`` unless it was cut short:
    by max_tokens (``length``), or a forced call by a stop string or stop token
    (``stop``): its arguments are unfinished, and an agent that reads
    ``tool_calls`` parses them. A grammar that completes its calls ends on EOS. A
    named tool choice ends with ``stop``, streamed or not, as OpenAI's does (and
    vLLM's): the call was asked for, not chosen."""
    if reason != "stop" or (parser.forced and stop_reason is not None) \
            or parser.mode == "arguments":
        return reason
    return "tool_calls"


def tool_call_deltas(deltas: list[Delta]) -> list[dict]:
    """OpenAI's streamed tool calls: a call's first delta has its index, id, type and name
    (and the arguments this step wrote); the next ones carry argument fragments. One
    entry per call and chunk."""
    out: list[dict] = []
    for d in deltas:
        if d.index is None:
            continue
        if d.call_id is not None:
            out.append({"index": d.index, "id": d.call_id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        elif out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        elif d.arguments:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out
