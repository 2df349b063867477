"""OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /tokenize.

Shapes follow OpenAI's (and vLLM's extensions: top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, return_token_ids).
Here requests are read, checked and started; their responses and stream
chunks are shaped in openai_output.py.
"""

from __future__ import annotations

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
)
from tandem.entrypoints.server.openai_output import OpenAIView, sse_response
from tandem.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TextPart,
    TokenizeRequest,
)
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.streaming import unless_disconnected
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
    view = OpenAIView(state, req.model or state.card.name, gen, len(per_prompt),
                      req.return_token_ids)
    await start(request, gen, constraint)  # from here on, gen.close() must run
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_response(gen, view.completion_chunks(echo, include_usage))
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
    view = OpenAIView(state, req.model or state.card.name, gen, len(per_choice),
                      req.return_token_ids, plan,
                      [None if reasoner is None else replace(reasoner) for _ in per_choice])
    await start(request, gen, constraint)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_response(gen, view.chat_chunks(include_usage))
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
