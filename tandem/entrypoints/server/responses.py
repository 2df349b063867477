"""OpenAI's Responses API, stateless (as Ollama serves it): POST /v1/responses.

Nothing is stored: every turn travels in ``input`` (messages, the model's
``function_call`` items and the caller's ``function_call_output`` items; a
``reasoning`` item reaches the template as the next assistant turn's
``reasoning_content``), so ``previous_response_id`` and ``conversation`` are
refused, and ``store`` and ``background`` are only ever false. The request
becomes a chat (instructions as the system message), runs through the same
tools, grammar and parsers as /v1/chat/completions, and comes back as
``output`` items: a ``reasoning`` item with the model's thinking (see
tandem.entrypoints.server.reasoning), a ``message`` with ``output_text`` and a
``function_call`` per tool call. Streaming sends the Responses events, each
with its ``sequence_number``, one text, reasoning or argument delta per
generated token.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from tandem.entrypoints.server import logprobs
from tandem.entrypoints.server.auth import require_api_key
from tandem.entrypoints.server.call_scanner import Delta
from tandem.entrypoints.server.errors import bad_request, from_validation_error
from tandem.entrypoints.server.generation import (
    Generation,
    given_max_tokens,
    make_sampling_params,
    open_ended_max_tokens,
    start,
    to_api_error,
)
from tandem.entrypoints.server.protocol import (
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesInputPart,
    ResponsesMessageItem,
    ResponsesRequest,
)
from tandem.entrypoints.server.reasoning import ReasoningParser
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.streaming import ClosingStreamingResponse, unless_disconnected
from tandem.entrypoints.server.structured import (
    ToolPlan,
    from_text_format,
    json_arguments,
    one_constraint,
    plan_tools,
    template_messages,
)
from tandem.entrypoints.server.tool_parsers import ToolCallParser
from tandem.outputs import RequestOutput

router = APIRouter(dependencies=[Depends(require_api_key)])

_ITEMS: dict[str, type[BaseModel]] = {
    "message": ResponsesMessageItem,
    "function_call": ResponsesFunctionCallItem,
    "function_call_output": ResponsesFunctionCallOutputItem,
}


LOGPROBS = "message.output_text.logprobs"  # the include value that asks for them
# OpenAI's floor for max_output_tokens: a smaller value is a 400 there ("integer below
# minimum value"), so a client tried here first does not fail on OpenAI.
MIN_OUTPUT_TOKENS = 16


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@router.post("/v1/responses")
async def responses(request: Request):
    state: ServerState = request.app.state.tandem
    req = await state.read(request, ResponsesRequest)
    state.check_model(req.model)
    for field in ("previous_response_id", "conversation"):
        if getattr(req, field) is not None:
            raise bad_request(f"{field} is not supported: this server stores no responses or "
                              "conversations; send the whole conversation in input", field)
    if req.store:
        raise bad_request("store=true is not supported: this server stores no responses",
                          "store")
    if req.background:
        raise bad_request("background=true is not supported: a response runs in its request "
                          "(stream it to see it as it comes)", "background")
    plan = plan_tools(_chat_tools(req), _chat_tool_choice(req), req.parallel_tool_calls,
                      state.tokenizer.chat_template if req.tools else None, flat=True)
    constraint = one_constraint(from_text_format(req.text.format if req.text else None),
                                plan.constraint() if plan else None)
    messages, tools = template_messages(_messages(req), plan, state.tokenizer.chat_template)
    ids = await state.chat_ids(messages, tools=tools)
    reasoner, constraint = state.reasoning_for(ids, constraint)
    max_tokens = given_max_tokens(req.max_output_tokens, "max_output_tokens",
                                  MIN_OUTPUT_TOKENS)
    if max_tokens is None:
        max_tokens = open_ended_max_tokens(state, len(ids))
    logprobs.check_top(req.top_logprobs, "top_logprobs")
    want = req.top_logprobs is not None or LOGPROBS in (req.include or [])
    params = make_sampling_params(
        state, max_tokens, temperature=req.temperature, top_p=req.top_p,
        logprobs=(req.top_logprobs or 0) if want else None,
        structured_outputs=constraint.params if constraint else None)
    gen = Generation(state, state.new_id("resp_"), [ids], [params])
    view = _View(req, state.card.name if req.model is None else req.model, gen, plan,
                 logprobs.TokenNames(state.engine.tokenizer), reasoner)
    await start(request, gen, constraint)
    if req.stream:
        return ClosingStreamingResponse(view.events(), gen.close,
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache"})
    try:
        outs = await unless_disconnected(request, gen.collect())
    finally:
        gen.close()
    return JSONResponse(view.whole(outs[0]))


def _chat_tools(req: ResponsesRequest) -> list[ChatTool]:
    """The flat Responses tools in chat completions' nested shape; ``strict`` defaults to
    true here, as OpenAI's Responses API has it (chat completions: false)."""
    return [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters,
        strict=t.strict is not False)) for t in req.tools or []]


def _chat_tool_choice(req: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (HF's shape, as in chat completions)."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    if not req.input:
        raise bad_request("input must not be empty", "input")
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    call_ids: set[str] = set()  # the function calls so far, which outputs answer
    for i, raw in enumerate(req.input):
        kind = raw.get("type") or "message"  # null, as left out: a message
        if not isinstance(kind, str):
            raise bad_request(f"input[{i}].type must be a string, got {type(kind).__name__}",
                              f"input[{i}].type")
        if kind == "reasoning":
            thought = _reasoning_text(raw)
            continue
        model = _ITEMS.get(kind)
        if model is None:
            raise bad_request(f"input[{i}].type {kind!r} is not supported; send "
                              f"{', '.join(_ITEMS)} items", f"input[{i}].type")
        try:
            item = model.model_validate(raw)
        except ValidationError as e:
            err = from_validation_error(e)
            raise bad_request(f"input[{i}]: {err.message}", f"input[{i}].{err.param}") from None
        if isinstance(item, ResponsesMessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role,
                        "content": _text(item.content)})
        elif isinstance(item, ResponsesFunctionCallItem):
            call_ids.add(item.call_id)
            call = {"id": item.call_id, "type": "function", "function": {
                "name": item.name,
                "arguments": json_arguments(item.arguments)}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            assert isinstance(item, ResponsesFunctionCallOutputItem)
            if item.call_id not in call_ids:  # as OpenAI answers it: the output answers nothing
                raise bad_request(f"input[{i}]: no tool call found for function call output "
                                  f"with call_id {item.call_id!r}", "input")
            out.append({"role": "tool", "content": _text(item.output),
                        "tool_call_id": item.call_id})
        if out and out[-1]["role"] == "assistant" and thought:
            out[-1]["reasoning_content"] = thought  # what thinking models' templates read
        thought = ""
    if len(out) == bool(req.instructions):
        raise bad_request("input holds only reasoning items; send a message", "input")
    return out


class _View:
    """One generation as a Response object, whole or as its stream of events."""

    def __init__(self, req: ResponsesRequest, model: str, gen: Generation,
                 plan: ToolPlan | None, names: logprobs.TokenNames,
                 reasoner: ReasoningParser | None = None) -> None:
        self.req = req
        self.model = model
        self.gen = gen
        self.k = gen.choices[0].params.logprobs  # None: no logprobs asked for
        self.names = names
        self._logprobs: list[dict[str, Any]] = []  # tokens' not yet sent with text
        self.created = int(time.time())
        self.parser: ToolCallParser | None = plan.parser() if plan else None
        self.reasoner = reasoner
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._text: dict[str, Any] | None = None  # the message item being streamed
        self._call: dict[str, Any] | None = None  # the function_call item being streamed
        self._thought: dict[str, Any] | None = None  # the reasoning item being streamed

    def response(self, status: str, final: RequestOutput | None = None) -> dict[str, Any]:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) \
            if r.text and r.text.format else {"type": "text"}
        tool_choice = r.tool_choice if isinstance(r.tool_choice, str) or r.tool_choice is None \
            else r.tool_choice.model_dump()
        body: dict[str, Any] = {
            "id": self.gen.request_id, "object": "response", "created_at": self.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": self.model, "output": self.output,
            "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": None,
            "store": False, "temperature": self.gen.choices[0].params.temperature,
            "text": {"format": fmt}, "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_p": self.gen.choices[0].params.top_p, "top_logprobs": r.top_logprobs,
            "truncation": "disabled",
            "metadata": r.metadata or {}, "usage": None,
        }
        if final is not None:
            m = final.metrics
            prompt = len(final.prompt_token_ids)
            output = m.num_output_tokens if m else len(final.outputs[0].token_ids)
            body["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": m.num_cached_tokens if m else 0},
                "output_tokens": output, "output_tokens_details": {
                    "reasoning_tokens": self.reasoner.reasoning_tokens if self.reasoner else 0},
                "total_tokens": prompt + output}
        return body

    @staticmethod
    def _status(final: RequestOutput) -> str:
        return "incomplete" if final.finish_reason == "length" else "completed"

    # ----------------------------------------------------------------- whole
    def _token_logprobs(self, outs: list[RequestOutput]) -> list[dict[str, Any]]:
        return [] if self.k is None else logprobs.token_logprobs(outs, self.k, self.names)

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        final = outs[-1]
        text = final.outputs[0].text
        status = self._status(final)
        if self.reasoner is not None:
            thought, text = self.reasoner.feed_outputs(outs)
            if thought:
                self.output.append(_reasoning(_id("rs"), thought, status))
        if self.parser is None:
            content, calls = text, []
        else:
            self.parser.feed(text)
            self.parser.finish()
            content, calls = self.parser.result()
        if content or not (calls or self.output):  # a message, unless calls or thought hold all
            self.output.append(_message(_id("msg"), content or "", status))
            self.output[-1]["content"][0]["logprobs"] = self._token_logprobs(outs)
        self.output += [_function_call(_id("fc"), c.id, c.name, c.arguments, status)
                        for c in calls]
        return self.response(status, final)

    # ------------------------------------------------------------- streaming
    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    async def events(self) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        try:
            async for _, out in self.gen:
                self._logprobs += self._token_logprobs([out])
                text = out.delta_text
                if self.reasoner is not None:
                    thought, text = self.reasoner.feed_output(out)
                    for event in self._think(thought):
                        yield event
                if self.parser is None:
                    deltas = [Delta(content=text)] if text else []
                else:
                    deltas = self.parser.feed(text)
                    if out.finished:
                        deltas += self.parser.finish()
                for d in deltas:
                    for event in self._apply(d):
                        yield event
                if out.finished:
                    status = self._status(out)
                    for event in self._close_items(status):
                        yield event
                    yield self._event(f"response.{status}", response=self.response(status, out))
        except Exception as e:  # after the 200 went out: an error event ends the stream
            err = to_api_error(e)
            yield self._event("error", code=str(err.code or err.status), message=err.message,
                              param=err.param)

    def _think(self, text: str) -> list[bytes]:
        """Reasoning text: the reasoning item's next delta (opening the item first)."""
        if not text:
            return []
        events: list[bytes] = []
        if self._thought is None:
            self._thought = _reasoning(_id("rs"), "", "in_progress")
            self.output.append(self._thought)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=self._thought))
            events.append(self._event("response.content_part.added", item_id=self._thought["id"],
                                      output_index=index, content_index=0,
                                      part=dict(self._thought["content"][0])))
        self._thought["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self._thought["id"],
                                  output_index=self.output.index(self._thought),
                                  content_index=0, delta=text))
        return events

    def _close_thought(self, status: str) -> list[bytes]:
        item, self._thought = self._thought, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        return [
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=item["content"][0]["text"]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=item["content"][0]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _apply(self, d: Delta) -> list[bytes]:
        events: list[bytes] = self._close_thought("completed") if d.content or d.call_id \
            else []
        if d.content:
            if self._call is not None:
                events += self._close_call("completed")
            if self._text is None:
                self._text = _message(_id("msg"), "", "in_progress")
                self._text["content"] = []
                self.output.append(self._text)
                events.append(self._event("response.output_item.added",
                                          output_index=len(self.output) - 1, item=self._text))
                events.append(self._event(
                    "response.content_part.added", item_id=self._text["id"],
                    output_index=len(self.output) - 1, content_index=0,
                    part=_output_text("")))
                self._text["content"] = [_output_text("")]
            events.append(self._text_delta(d.content))
        elif d.call_id is not None:
            events += self._close_items("completed")
            self._call = _function_call(_id("fc"), d.call_id, d.name or "", "", "in_progress")
            self.output.append(self._call)
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output) - 1, item=self._call))
        elif d.arguments and self._call is not None:
            self._call["arguments"] += d.arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._call["id"],
                                      output_index=len(self.output) - 1, delta=d.arguments))
        return events

    def _text_delta(self, text: str) -> bytes:
        """The open text item's next delta, with the tokens since the last one (text a
        possible tag held back, or a tool call's, has none of its own)."""
        assert self._text is not None
        sent, self._logprobs = self._logprobs, []
        part = self._text["content"][0]
        part["text"] += text
        part["logprobs"] += sent
        return self._event("response.output_text.delta", item_id=self._text["id"],
                           output_index=self.output.index(self._text), content_index=0,
                           delta=text, logprobs=sent)

    def _close_items(self, status: str) -> list[bytes]:
        return self._close_thought(status) + self._close_text(status) + self._close_call(status)

    def _close_text(self, status: str) -> list[bytes]:
        if self._text is None:
            return []
        # Tokens with no text of their own (the end of the turn) close with an empty delta.
        flush = [self._text_delta("")] if self._logprobs else []
        item, self._text = self._text, None
        index = self.output.index(item)
        part = item["content"][0]
        item["status"] = status
        return flush + [
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_call(self, status: str) -> list[bytes]:
        item, self._call = self._call, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=index, name=item["name"], arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_output_text(text)]}


def _text(content: str | list[ResponsesInputPart]) -> str:
    """An item's text, its parts joined by newlines (as chat content parts are)."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning input item's text: its ``content`` (reasoning_text parts), else its
    ``summary``; parts that are not objects with a string ``text`` are skipped."""
    for key in ("content", "summary"):
        parts = item.get(key)
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(
            p.get("text"), str)] if isinstance(parts, list) else []
        if texts:
            return "\n".join(texts)
    return ""


def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call(item_id: str, call_id: str, name: str, arguments: str, status: str
                   ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
