"""OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /tokenize.

Shapes follow OpenAI's (and vLLM's extensions: top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, return_token_ids).
Streaming sends one SSE chunk per generated token; a chat's role arrives with
the first token, never before it, so the client's time to first token is the
real one. Every final response (or final chunk) carries a ``tandem`` object
with the request's queue, prefill and decode times, so an OpenAI client sees
the same phase split an Ollama client gets from its counters.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from tandem.entrypoints.server import logprobs
from tandem.entrypoints.server.auth import require_api_key
from tandem.entrypoints.server.errors import APIError, bad_request
from tandem.entrypoints.server.generation import (
    Generation,
    given_max_tokens,
    make_sampling_params,
    open_ended_max_tokens,
    start,
    to_api_error,
)
from tandem.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TextPart,
    TokenizeRequest,
)
from tandem.entrypoints.server.reasoning import ReasoningParser
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.streaming import ClosingStreamingResponse, unless_disconnected
from tandem.entrypoints.server.structured import (
    Constraint,
    ToolPlan,
    from_response_format,
    from_structured_outputs,
    json_arguments,
    one_constraint,
    plan_tools,
    template_messages,
)
from tandem.entrypoints.server.tool_parsers import Delta, ToolCallParser
from tandem.outputs import RequestMetrics, RequestOutput
from tandem.sampling_params import SamplingParams

CompletionPrompt = str | list[str] | list[int] | list[list[int]]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) legacy default

router = APIRouter(dependencies=[Depends(require_api_key)])


def _state(request: Request) -> ServerState:
    return request.app.state.tandem


# ------------------------------------------------------------------ models
def _model_entry(state: ServerState, name: str) -> dict:
    card = state.card
    return {
        "id": name, "object": "model", "created": card.created, "owned_by": "tandem",
        "root": card.root, "parent": None, "max_model_len": card.max_model_len,
        "permission": [],
        # tandem's: the sequence slots (tandem doctor tells a full batch from a
        # prefill budget by them)
        "max_num_seqs": state.engine.model_info.max_num_seqs,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    return {"object": "list", "data": [_model_entry(state, n) for n in state.card.names]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict:
    state = _state(request)
    if model not in state.card.names:
        if not model:  # a request's empty model means the default; a model's id is a name
            raise APIError(404, "no model named: GET /v1/models/<name>", code="model_not_found")
        state.check_model(model)
    return _model_entry(state, model)


# -------------------------------------------------------------- tokenizer
@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state = _state(request)
    req = await state.read(request, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send either 'prompt' or 'messages'", "prompt")
    if req.messages is not None:
        plan = plan_tools(req.tools, None, True,
                          state.tokenizer.chat_template if req.tools else None)
        ids = await _chat_ids(state, req, plan)
    else:
        ids = (await state.encode([req.prompt], "prompt", req.add_special_tokens))[0]
    return {"count": len(ids), "max_model_len": state.card.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state = _state(request)
    req = await state.read(request, DetokenizeRequest, state.max_text_chars)
    state.check_model(req.model)
    tok = state.tokenizer
    vocab = state.engine.model_info.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": await state.off_loop(tok.decode, req.tokens, False)}


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    """A 501 that says so: a 404 reads as a wrong URL to a RAG client's user."""
    raise APIError(501, "embeddings are not supported: this server generates text with "
                   f"{_state(request).card.name}; run an embedding model elsewhere")


# ------------------------------------------------------------ completions
@router.post("/v1/completions")
async def completions(request: Request):
    state = _state(request)
    req = await state.read(request, CompletionRequest)
    state.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (use n)", "best_of")
    logprobs.check_top(req.logprobs, "logprobs")
    batch = isinstance(req.prompt, list) and bool(req.prompt) and \
        not isinstance(req.prompt[0], int)
    state.check_fan_out(req.n, len(req.prompt) if batch else 1)
    constraint = one_constraint(from_response_format(req.response_format),
                                from_structured_outputs(req.structured_outputs))
    # echo with logprobs: the prompt's tokens get theirs too (OpenAI's legacy API;
    # what lm-evaluation-harness reads for log-likelihoods).
    params = _params(state, req, req.max_tokens if req.max_tokens is not None
                     else COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs, constraint,
                     prompt_logprobs=req.logprobs if req.echo else None)
    prompts = await _completion_prompts(state, req.prompt)
    per_prompt = params.fan_out()
    echo = [await _echo_text(state, req.prompt, ids, i) if req.echo else "" for i, ids in
            enumerate(prompts)]
    gen = Generation(state, state.new_id("cmpl-"), [ids for ids in prompts for _ in per_prompt],
                     per_prompt * len(prompts))
    view = _View(state, req.model or state.card.name, gen, len(per_prompt), req.return_token_ids)
    await start(request, gen, constraint)  # from here on, gen.close() must run
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _sse(gen, view.completion_chunks(echo, include_usage))
    try:
        outs = await unless_disconnected(request, gen.collect())
    finally:
        gen.close()
    return JSONResponse(view.completion_response(outs, echo))


async def _completion_prompts(state: ServerState, prompt: CompletionPrompt) -> list[list[int]]:
    """The four OpenAI prompt forms: str, [str], [int], [[int]] -> token id lists."""
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        return await state.encode([prompt] if isinstance(prompt, str) else prompt, "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


async def _echo_text(state: ServerState, prompt: CompletionPrompt, ids: list[int], i: int
                     ) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[i]
    # the prompt as sent: its special tokens too, as a text prompt's echo keeps them
    return await state.off_loop(state.tokenizer.decode, ids, False) if state.has_tokenizer \
        else ""


# ------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = _state(request)
    req = await state.read(request, ChatCompletionRequest)
    state.check_model(req.model)
    if req.functions:
        raise bad_request("functions (deprecated by OpenAI) are not supported; send tools",
                          "functions")
    if req.top_logprobs and not req.logprobs:  # 0 asks for nothing (vLLM's rule)
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    logprobs.check_top(req.top_logprobs, "top_logprobs")
    state.check_fan_out(req.n)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                      state.tokenizer.chat_template if req.tools else None)
    constraint = one_constraint(from_response_format(req.response_format),
                                from_structured_outputs(req.structured_outputs),
                                plan.constraint() if plan else None)
    ids = await _chat_ids(state, req, plan)
    reasoner, constraint = state.reasoning_for(ids, constraint)
    max_tokens = req.max_tokens if req.max_completion_tokens is None \
        else given_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = open_ended_max_tokens(state, len(ids))
    params = _params(state, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                     constraint)
    per_choice = params.fan_out()
    gen = Generation(state, state.new_id("chatcmpl-"), [ids] * len(per_choice), per_choice)
    view = _View(state, req.model or state.card.name, gen, len(per_choice), req.return_token_ids,
                 plan, [None if reasoner is None else replace(reasoner) for _ in per_choice])
    await start(request, gen, constraint)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _sse(gen, view.chat_chunks(include_usage))
    try:
        outs = await unless_disconnected(request, gen.collect())
    finally:
        gen.close()
    return JSONResponse(view.chat_response(outs))


def flatten_content(content: str | list[TextPart] | None, where: str,
                    role: str = "user") -> str:
    """OpenAI's list-of-parts content -> text (parts joined by newlines, as vLLM does).
    An assistant turn's ``refusal`` parts (what OpenAI answered, replayed in the
    history) are its text too."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        field = "refusal" if part.type == "refusal" and role == "assistant" else "text"
        if part.type != field:
            allowed = "text parts" + (" and refusal parts" if role == "assistant" else "")
            raise bad_request(f"{where}.content[{j}]: only {allowed} are supported, "
                              f"got type {part.type!r}", f"{where}.content[{j}].type")
        text = getattr(part, field)
        if text is None:
            raise bad_request(f"{where}.content[{j}]: a {field} part needs its {field}",
                              f"{where}.content[{j}].{field}")
        texts.append(text)
    return "\n".join(texts)


async def _chat_ids(state: ServerState, req: ChatCompletionRequest | TokenizeRequest,
                    plan: ToolPlan | None = None) -> list[int]:
    """The chat template's token ids, rendered and encoded in a tokenizer thread.

    OpenAI's "developer" role is its newer name for "system", which is what
    chat templates know; an assistant's tool calls reach the template with
    their arguments as objects (HF's convention), a tool result with its
    ``tool_call_id``. ``continue_final_message`` (vLLM's) leaves the last message open
    for the model to go on with, instead of a new assistant turn.
    """
    messages = req.messages
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if req.continue_final_message and req.add_generation_prompt:  # as vLLM answers
        raise bad_request("continue_final_message needs add_generation_prompt=false",
                          "continue_final_message")
    flat = []
    for i, m in enumerate(messages):
        # As OpenAI: only an assistant turn (which may be all tool calls) may leave it out.
        if (m.content is None and m.role != "assistant") or m.content == []:
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}"
                              if m.content is None else
                              f"messages[{i}].content must not be an empty list",
                              f"messages[{i}].content")
        msg: dict = {"role": "system" if m.role == "developer" else m.role,
                     "content": flatten_content(m.content, f"messages[{i}]", m.role)}
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": json_arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        thinking = m.reasoning_content or m.reasoning
        if thinking and m.role == "assistant":
            msg["reasoning_content"] = thinking  # what thinking models' templates read
        flat.append(msg)
    flat, tools = template_messages(flat, plan, state.tokenizer.chat_template)
    return await state.chat_ids(flat, req.add_generation_prompt, tools,
                                req.continue_final_message, req.chat_template_kwargs)


# ---------------------------------------------------------------- helpers
def _params(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
            max_tokens: int | None, logprobs: int | None, constraint: Constraint | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.prompt_logprobs is not None:  # ignored, a scoring client would read no scores
        raise bad_request("prompt_logprobs (vLLM's field) is not offered over HTTP: send "
                          "/v1/completions with echo and logprobs (the prompt's tokens come "
                          "first), or use the Python API's SamplingParams.prompt_logprobs",
                          "prompt_logprobs")
    if max_tokens is not None and max_tokens < (0 if getattr(req, "echo", False) else 1):
        raise bad_request(f"max_tokens must be at least 1 (0 only with echo: the prompt "
                          f"alone), got {max_tokens}", "max_tokens")
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM answer
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    return make_sampling_params(
        state, max_tokens, n=req.n, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=constraint.params if constraint else None,
    )


def _sse(gen: Generation, chunks: AsyncIterator[dict]) -> ClosingStreamingResponse:
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


class _View:
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
    ``tool_calls`` parses them. A grammar that completes its calls ends on EOS."""
    if reason != "stop" or (parser.forced and stop_reason is not None):
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
