"""Ollama-compatible API: /api/generate, /api/chat, /api/tags, /api/show, /api/ps, /api/version.

Here requests are read, checked and started; their replies, stream lines and
counters are shaped in ollama_output.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tandem import __version__
from tandem.entrypoints.server import logprobs
from tandem.entrypoints.server.auth import require_api_key
from tandem.entrypoints.server.errors import APIError, bad_request
from tandem.entrypoints.server.generation import (
    Generation,
    make_sampling_params,
    open_ended_max_tokens,
    start,
)
from tandem.entrypoints.server.ollama_output import OllamaView, load_reply
from tandem.entrypoints.server.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    OllamaPullRequest,
    OllamaShowRequest,
    keep_alive_seconds,
)
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.streaming import ClosingStreamingResponse, unless_disconnected
from tandem.entrypoints.server.structured import (
    Constraint,
    ToolPlan,
    from_ollama_format,
    plan_tools,
    template_messages,
)
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The Ollama API level these endpoints follow; clients gate features on it.
OLLAMA_API_VERSION = "0.6.0"
NEVER = "9999-12-31T23:59:59Z"  # keep_alive forever: the model is never unloaded

public = APIRouter()
router = APIRouter(dependencies=[Depends(require_api_key)])


N = TypeVar("N", OllamaShowRequest, OllamaPullRequest)


def _state(request: Request) -> ServerState:
    return request.app.state.tandem


def _modified(state: ServerState) -> str:
    """The model file's time, one format on every route."""
    return datetime.fromtimestamp(state.card.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@public.get("/")
@public.head("/")
async def root() -> PlainTextResponse:
    return PlainTextResponse("Ollama is running")


@public.get("/api/version")
@public.head("/api/version")
async def version() -> dict:
    return {"version": OLLAMA_API_VERSION, "tandem_version": __version__}


# ------------------------------------------------------------- model info
def _tag(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def _details(state: ServerState) -> dict:
    c = state.card
    return {"parent_model": "", "format": c.format, "family": c.family, "families": [c.family],
            "parameter_size": c.parameter_size, "quantization_level": c.quantization_level}


@router.get("/api/tags")
@router.head("/api/tags")
async def tags(request: Request) -> dict:
    state = _state(request)
    c = state.card
    return {"models": [
        {"name": _tag(n), "model": _tag(n), "modified_at": _modified(state), "size": c.size_bytes,
         "digest": c.digest, "details": _details(state)}
        for n in c.names
    ]}


@router.get("/api/ps")
async def ps(request: Request) -> dict:
    state = _state(request)
    c = state.card
    vram = c.size_bytes if c.device == "cuda" else 0
    return {"models": [
        {"name": _tag(c.name), "model": _tag(c.name), "size": c.size_bytes, "digest": c.digest,
         "details": _details(state), "expires_at": NEVER, "size_vram": vram,
         "context_length": c.max_model_len}
    ]}


async def _named_model(state: ServerState, request: Request, body: type[N]) -> N:
    """A body naming a model (``model``, or older clients' ``name``): the served one, or a 404."""
    req = await state.read(request, body)
    name = req.model or req.name
    if not name:
        raise bad_request("model is required", "model")
    state.check_model(name)
    return req


@router.post("/api/show")
async def show(request: Request) -> dict:
    state = _state(request)
    await _named_model(state, request, OllamaShowRequest)
    c = state.card
    cfg = state.engine.model_info
    arch = c.family
    params = [f"num_ctx {c.max_model_len}", *state.defaults.ollama_parameters()]
    if state.has_tokenizer:  # the model's end-of-turn tokens, as a Modelfile lists them
        tok = state.tokenizer
        params += [f"stop {json.dumps(tok.decode([i], skip_special_tokens=False))}"
                   for i in sorted(tok.stop_token_ids)]
    return {
        "license": "",
        "modelfile": "".join([f"# served by tandem {__version__}\nFROM {c.root}\n",
                              f"# sampling defaults: {state.defaults.describe()}\n",
                              *(f"PARAMETER {p}\n" for p in params)]),
        "parameters": "\n".join(params),
        "template": c.chat_template or "{{ .Prompt }}",
        "details": _details(state),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": c.parameter_count,
            f"{arch}.context_length": c.max_model_len,
            f"{arch}.embedding_length": cfg.hidden_size,
            f"{arch}.block_count": cfg.num_hidden_layers,
            f"{arch}.attention.head_count": cfg.num_attention_heads,
            f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        },
        "capabilities": ["completion", "tools", *(["thinking"] if state.reasoning else [])],
        "modified_at": _modified(state),
    }


@router.post("/api/pull")
async def pull(request: Request):
    """The served model is there already: success, as Ollama answers a pull of a
    model it has (clients that pull before use go on); any other is a 404
    naming what is served. Nothing is downloaded."""
    req = await _named_model(_state(request), request, OllamaPullRequest)
    if req.stream:  # Ollama's progress lines: here only the last
        return Response(b'{"status":"success"}\n', media_type="application/x-ndjson")
    return {"status": "success"}


# Ollama's model management and embeddings, which a server of one loaded model
# does not do: a 501 that says so, not a 404 its clients read as "no such model".
UNSUPPORTED = {
    "/api/embed": "embeddings", "/api/embeddings": "embeddings",
    "/api/create": "creating models", "/api/copy": "copying models",
    "/api/delete": "deleting models", "/api/push": "pushing models",
    "/api/blobs/{digest}": "model blobs",
}


async def _unsupported(request: Request) -> None:
    what = UNSUPPORTED[request.scope["route"].path]
    name = _state(request).card.name
    if what == "embeddings":
        why = f"this server generates text with {name}; run an embedding model elsewhere"
    else:
        why = f"this server serves one model, {name}, loaded at start-up"
    raise APIError(501, f"{what} is not supported: {why}")


for _path in UNSUPPORTED:
    router.add_api_route(_path, _unsupported, methods=["POST", "DELETE", "HEAD"],
                         include_in_schema=False)


# ------------------------------------------------------------- generation
def _load_reason(req: OllamaGenerateRequest | OllamaChatRequest) -> str:
    """An empty request's done_reason: "unload" when keep_alive is 0 (a UI's unload
    button), else "load". The model stays loaded either way."""
    unload = req.keep_alive is not None and keep_alive_seconds(req.keep_alive) == 0
    return "unload" if unload else "load"


@router.post("/api/generate")
async def generate(request: Request):
    t0 = time.monotonic()
    state = _state(request)
    req = await state.read(request, OllamaGenerateRequest)
    model, constraint = _check_common(state, req)
    if req.images:
        raise bad_request("images are not supported")
    if req.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported")
    if req.template:
        raise bad_request("a custom template is not supported; send raw=true with a "
                          "formatted prompt")
    if req.raw and (req.system or req.context):
        raise bad_request("raw mode does not support template, system, or context")
    if not req.prompt and not req.context:  # Ollama's "load the model" request
        return load_reply(model, False, _load_reason(req))
    ids = list(req.context or [])
    prompt = req.prompt or ""
    if prompt:
        if req.raw or not state.tokenizer.chat_template:
            ids += (await state.encode([prompt], "prompt"))[0]
        else:
            messages = [{"role": "user", "content": prompt}]
            if req.system:
                messages.insert(0, {"role": "system", "content": req.system})
            ids += await state.chat_ids(messages, template_kwargs=_no_thinking(req))
    return await _run(request, state, req, model, ids, t0, constraint)


@router.post("/api/chat")
async def chat(request: Request):
    t0 = time.monotonic()
    state = _state(request)
    req = await state.read(request, OllamaChatRequest)
    model, constraint = _check_common(state, req)
    if not req.messages:
        return load_reply(model, True, _load_reason(req))
    plan = plan_tools(req.tools, None, True,
                      state.tokenizer.chat_template if req.tools else None)
    messages = []
    for i, m in enumerate(req.messages):
        if m.images:
            raise bad_request(f"messages[{i}]: images are not supported")
        msg: dict = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments},
                **({"id": c.id} if c.id else {})} for c in m.tool_calls]
        if m.tool_name is not None:
            msg["name"] = m.tool_name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.thinking and m.role == "assistant":
            msg["reasoning_content"] = m.thinking  # what thinking models' templates read
        messages.append(msg)
    # A last assistant message with text is continued, not answered, as Ollama does.
    last = req.messages[-1]
    go_on = last.role == "assistant" and bool(last.content) and not last.tool_calls
    kwargs = _no_thinking(req)

    async def ids_of(kept: list[dict], last_try: bool = False) -> list[int] | None:
        """The prompt of these messages; None if their text is beyond the bound (the
        last try: chat_ids's 400 says so)."""
        templated, tools = template_messages(kept, plan, state.tokenizer.chat_template)
        if not (last_try or state.chat_fits(templated, tools, kwargs)):
            return None
        return await state.chat_ids(templated, not go_on, tools, continue_final=go_on,
                                    template_kwargs=kwargs)

    ids = await _fit_history(state, req, messages, ids_of)
    return await _run(request, state, req, model, ids, t0, constraint, chat=True, plan=plan)


async def _fit_history(state: ServerState, req: OllamaChatRequest, messages: list[dict],
                       ids_of: Callable[..., Awaitable[list[int] | None]]) -> list[int]:
    """The chat's prompt; a history too long for the window loses its oldest turns,
    as Ollama's ``truncate`` (on unless the request sends false) does: the system
    messages and the last message stay, and what is kept starts at a user message
    (a tool call keeps its result). The prompt leaves the reply num_predict tokens,
    at most a quarter of the window: a long chat in a chat UI goes on answering
    instead of failing once it outgrows the window."""
    ids = await ids_of(messages)
    window = _window(state, req.options)
    o = req.options or OllamaOptions()
    reply = min(o.num_predict if o.num_predict and o.num_predict > 0 else window, window // 4)
    if req.truncate is False or (ids is not None and len(ids) + reply <= window):
        return ids if ids is not None else await ids_of(messages, last_try=True)
    last = len(messages) - 1
    cuts = [i for i, m in enumerate(messages) if 0 < i < last and m["role"] == "user"] + [last]

    def kept(cut: int) -> list[dict]:
        return [m for m in messages[:cut] if m["role"] == "system"] + messages[cut:]

    lo, hi, best = 0, len(cuts) - 1, None  # the earliest cut that fits: binary search
    while lo <= hi:
        mid = (lo + hi) // 2
        found = await ids_of(kept(cuts[mid]))
        if found is not None and len(found) + reply <= window:
            best, hi = found, mid - 1
        else:
            lo = mid + 1
    if best is not None:
        return best
    # Even the last message is too long: chat_ids or _params says so.
    return await ids_of(kept(last), last_try=True)


def _no_thinking(req: OllamaGenerateRequest | OllamaChatRequest) -> dict[str, bool] | None:
    """think=false reaches a template that can turn thinking off (Qwen3's enable_thinking);
    templates without that variable ignore it."""
    return {"enable_thinking": False} if req.think is False else None


def _check_common(state: ServerState, req: OllamaGenerateRequest | OllamaChatRequest
                  ) -> tuple[str, Constraint | None]:
    if not req.model:
        raise bad_request("model is required", "model")
    state.check_model(req.model)
    constraint = from_ollama_format(req.format)
    if isinstance(req.think, str):
        raise bad_request(f'think levels ("{req.think}") are not supported; send true or '
                          'false', "think")
    if req.think and not state.reasoning:
        raise bad_request(f'"{req.model}" does not support thinking')
    logprobs.check_top(req.top_logprobs, "top_logprobs")
    return req.model, constraint


def _window(state: ServerState, opts: OllamaOptions | None) -> int:
    """The context a request runs in: num_ctx, capped at the server's window (as
    Ollama caps it at the model's: clients send one num_ctx to every model)."""
    window = state.card.max_model_len
    num_ctx = opts.num_ctx if opts else None
    if num_ctx is None:
        return window
    if num_ctx < 1:
        raise bad_request(f"num_ctx must be positive, got {num_ctx}")
    if num_ctx > window:
        logger.info("num_ctx %d capped at this server's context window of %d tokens",
                    num_ctx, window)
    return min(num_ctx, window)


# A top_p whose nucleus is the likeliest token alone (the mass ranked above it is 0).
_KEEP_ONE_TOP_P = 1e-9


def _params(state: ServerState, opts: OllamaOptions | None, prompt_len: int,
            logprobs: int | None, constraint: Constraint | None) -> SamplingParams:
    o = opts or OllamaOptions()
    window = _window(state, o)
    max_tokens = o.num_predict
    if max_tokens is None:
        max_tokens = open_ended_max_tokens(state, prompt_len, window)
    elif max_tokens <= 0:  # Ollama's runner bounds a positive num_predict only
        max_tokens = None  # -1 (documented): until the model stops; -2: the context is full
    # Checked here, in Ollama's names (the engine's own message speaks of max_tokens).
    if prompt_len >= window:
        if o.num_ctx is not None and o.num_ctx < state.card.max_model_len:
            raise bad_request(f"the prompt ({prompt_len} tokens) leaves no room in num_ctx "
                              f"({window}); shorten the prompt or raise num_ctx")
        raise bad_request(f"the prompt ({prompt_len} tokens) leaves no room in this server's "
                          f"context window of {window} tokens (--max-model-len); shorten "
                          "the prompt")
    # num_predict is a bound, as in Ollama: the reply ends ("length") where the window does.
    if max_tokens is not None:
        max_tokens = min(max_tokens, window - prompt_len)
    elif o.num_ctx is not None:
        max_tokens = window - prompt_len
    top_p = o.top_p
    if top_p is not None:  # llama.cpp's reading: <= 0 keeps the likeliest token, >= 1 all
        top_p = min(max(top_p, _KEEP_ONE_TOP_P), 1.0)
    return make_sampling_params(
        state, max_tokens, temperature=o.temperature, top_k=o.top_k, top_p=top_p,
        min_p=o.min_p, seed=o.seed, stop=o.stop, repetition_penalty=o.repeat_penalty,
        presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
        logprobs=logprobs, structured_outputs=constraint.params if constraint else None,
    )


async def _run(request: Request, state: ServerState,
               req: OllamaGenerateRequest | OllamaChatRequest, model: str, ids: list[int],
               t0: float, constraint: Constraint | None, chat: bool = False,
               plan: ToolPlan | None = None) -> Response:
    k = (req.top_logprobs or 0) if req.logprobs else None
    # think=false: the text as the model wrote it (a template that can, was told not to think).
    reasoner = None
    if req.think is not False:
        reasoner, constraint = state.reasoning_for(ids, constraint)
    params = _params(state, req.options, len(ids), k, constraint)
    gen = Generation(state, state.new_id("ollama-"), [ids], [params])
    view = OllamaView(state, model, gen, t0, chat, plan.parser() if plan else None, reasoner)
    await start(request, gen, constraint)
    if req.stream:
        return ClosingStreamingResponse(view.lines(), gen.close,
                                        media_type="application/x-ndjson")
    try:
        outs = await unless_disconnected(request, gen.collect())
    finally:
        gen.close()
    return JSONResponse(view.whole(outs[0]))
