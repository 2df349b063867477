"""Request bodies of both APIs, as pydantic models.

Unknown fields are ignored (as vLLM and Ollama do), so newer SDKs keep
working; known fields are type-checked here and range-checked by
SamplingParams, and both failures become a 400 that names the field.
Known features tandem does not implement (images, logit bias, legacy
``functions``) are rejected explicitly rather than silently ignored.

Types are strict, as OpenAI's and Ollama's own decoders are: ``"max_tokens": true``
or ``"5"`` is a 400, not 1 or 5 (pydantic's lax mode turns a bool into an int);
null is the field's default.
An int converts to a float field; only Ollama's ``options`` take a whole float
for an integer, as Ollama's option decoding does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from starlette.requests import Request

from tandem.entrypoints.server.errors import APIError, from_validation_error


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's nullable fields and
        Ollama's decoder treat it: the OpenAI SDK sends a Python None as null
        (``n=None``), which a strict int rejected."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    return value


# An Ollama option's integer: 100 or 100.0, not true or "100" (a fraction stays a 400);
# a Go int64, as Ollama decodes it.
_OptionInt = Annotated[int, BeforeValidator(_number),
                       Field(strict=False, ge=-(2**63), le=2**63 - 1)]

# Go's time.ParseDuration, what Ollama reads a keep_alive string with ("5m", "1h30m",
# "-1s", "0"), and a number of seconds as text.
_GO_DURATION = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|ms|s|m|h))+|[+-]?0|"
                          r"[+-]?(?:\d+\.?\d*|\.\d+)")
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h)?")  # a number, its unit
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                   "h": 3600.0}


def keep_alive_seconds(value: float | str) -> float:
    """Seconds of a keep_alive (negative: forever), or ValueError for what Ollama refuses."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if not _GO_DURATION.fullmatch(text):
        raise ValueError(f'time: invalid duration "{value}"')
    sign = -1.0 if text.startswith("-") else 1.0
    return sign * sum(float(n) * _DURATION_UNITS[u or "s"]
                      for n, u in _DURATION_PART.findall(text))


def _format(value: Any) -> Any:
    if not isinstance(value, (str, dict)):
        raise ValueError('must be "json" or a JSON schema (an object)')
    return value


def _keep_alive(value: Any) -> Any:
    if isinstance(value, str):
        keep_alive_seconds(value)  # refused here: a 400 naming keep_alive
    return value


B = TypeVar("B", bound=_Body)
logger = logging.getLogger("tandem.entrypoints.server")


# ------------------------------------------------------------------ OpenAI
class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``response_format``: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` body field (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class OllamaTool(ChatTool):
    type: Literal["function"] = "function"  # Ollama does not require it


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# vLLM's constraint fields before structured_outputs (older vLLM servers take
# them; agent frameworks still send them): read as structured_outputs, not
# ignored, which left an agent with free text it took for constrained.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class _OpenAISampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extensions too)."""

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(
                data.get(k) is not None for k in GUIDED_FIELDS):
            return data
        if data.get("structured_outputs") is not None:
            raise ValueError("give structured_outputs or vLLM's older guided_* fields, not both")
        out = {k: v for k, v in data.items() if k not in GUIDED_FIELDS}
        out["structured_outputs"] = {GUIDED_FIELDS[k]: v for k, v in data.items()
                                     if k in GUIDED_FIELDS and v is not None}
        return out

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored (OpenAI uses it for abuse monitoring)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    prompt_logprobs: Any = None  # vLLM's; refused with what to send instead (openai.py)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant turn's refusal part, as OpenAI returns it


# OpenAI's roles: any other is a 400, as OpenAI answers (a typo such as
# "assitant" would otherwise reach the chat template as a role of its own).
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Body):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    # An assistant turn's thinking, as the reasoning parser returned it (both of vLLM's names).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message goes on, no new turn
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, e.g. enable_thinking
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered as chat completions render them (vLLM)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------- OpenAI Responses
class ResponsesTool(FunctionDefinition):
    """The Responses API's flat function tool: a function definition with a type."""

    type: Literal["function"]


class ResponsesToolChoice(_Body):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = None


class ResponsesInputPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponsesMessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponsesInputPart]


class ResponsesFunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class ResponsesFunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsesInputPart]  # OpenAI's SDK types both


class ResponsesRequest(_Body):
    """POST /v1/responses, stateless: every turn travels in ``input``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" is the one honoured
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored, as in chat completions


# ------------------------------------------------------------------ Ollama
class OllamaOptions(_Body):
    """The Modelfile parameters tandem honours; the rest (mirostat, num_gpu...) are ignored."""

    num_predict: _OptionInt | None = None
    num_ctx: _OptionInt | None = None
    temperature: float | None = None
    top_k: _OptionInt | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: _OptionInt | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class _OllamaBody(_Body):
    model: str | None = None
    stream: bool = True
    options: OllamaOptions | None = None
    format: Annotated[str | dict[str, Any], BeforeValidator(_format)] | None = None
    # The model always stays loaded; 0 answers an empty request "unload", as Ollama.
    keep_alive: Annotated[float | str, AfterValidator(_keep_alive)] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class OllamaGenerateRequest(_OllamaBody):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


class OllamaFunctionCall(_Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(_Body):
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(_Body):
    role: str  # passed to the chat template as is, as Ollama does
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool result: the tool that produced it
    tool_call_id: str | None = None  # a tool result: the call it answers
    thinking: str | None = None  # an assistant turn's thinking, as /api/chat returned it


class OllamaChatRequest(_OllamaBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None
    truncate: bool | None = None  # a history beyond the window loses its oldest turns


class OllamaPullRequest(_Body):
    model: str | None = None
    name: str | None = None  # older clients send "name"
    stream: bool = True


class OllamaShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # older clients send "name"
    verbose: bool = False


# ------------------------------------------------------------ reading bodies
# A body that stops arriving (shorter than its Content-Length, or trickled) is a
# 408 after this long without a byte, as nginx's client_body_timeout: each one
# held a connection and its handler forever.
BODY_READ_TIMEOUT_S = 60.0
# Deeper bodies are a 400: json.loads reads ~990 levels, but a template or schema
# walk past ~500 (chat_template_kwargs rendered by jinja) hit Python's recursion
# limit, a 500. JSON schemas and tool arguments are a few levels deep.
MAX_JSON_DEPTH = 128


def _deeper_than(body: Any, limit: int) -> bool:
    """Whether the parsed body nests containers more than ``limit`` deep (no recursion)."""
    stack = [(body, 1)] if isinstance(body, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


async def read_bytes(request: Request, max_bytes: int) -> bytes:
    """The request's body, or a 413: the bound is checked against Content-Length
    before reading and again while reading (chunked bodies), so a huge body is
    refused without being held in memory."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"request body of {int(length)} bytes exceeds the limit of "
                            f"{max_bytes} bytes")
    buf = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), BODY_READ_TIMEOUT_S)
        except StopAsyncIteration:
            return bytes(buf)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stopped arriving ({len(buf)} bytes in, "
                                f"none for {BODY_READ_TIMEOUT_S:.0f} s)") from None
        buf += chunk
        if len(buf) > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, or a 4xx that says what is wrong with it."""
    buf = await read_bytes(request, max_bytes)
    if not buf:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(buf)
        deep = _deeper_than(body, MAX_JSON_DEPTH)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        deep = True
    if deep:
        raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} "
                            "levels") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(buf):
        where = _lone_surrogate(body)
        if where is not None:
            raise APIError(400, f"{where} contains a lone UTF-16 surrogate (\\ud800-\\udfff "
                                "without its pair), which is not valid Unicode", param=where)
    return body


# A \uD800-\uDFFF escape: the only way a JSON body decodes to a str that is not
# valid Unicode (raw surrogate bytes already fail UTF-8 decoding); pairs decode
# to one character, lone ones stay and break the tokenizer and UTF-8 output.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(body: dict) -> str | None:
    """The path (``messages[0].content``) of the first string holding a lone surrogate.

    Iterative: the body may be nested as deeply as json.loads allows. A bad key
    is named with the surrogate escaped, so the message itself stays valid UTF-8.
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _is_unicode(value):
            return path or "body"
        if isinstance(value, dict):
            for k, v in value.items():
                if not _is_unicode(k):
                    k = k.encode("utf-8", "backslashreplace").decode()
                    return f"{path}.{k}" if path else k
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_body(model: type[B], body: dict, max_items: int | None = None) -> B:
    """Validate; unknown top-level fields are ignored but logged (so a typo is findable).

    With ``max_items``, longer lists are refused before validation, whose cost grows
    with them (0.6 s for a prompt of 2.6 million token ids, the event loop held).
    """
    if max_items is not None:
        _check_lengths(body, max_items)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    ignored = body.keys() - model.model_fields.keys() - GUIDED_FIELDS.keys()
    if ignored:  # a bounded line, whatever the body holds
        names = sorted(ignored)
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        logger.warning("fields present in the request but ignored: %s%s",
                       ", ".join(n[:64] for n in names[:10]), more)
    return parsed


def _check_lengths(body: dict, max_items: int) -> None:
    """The body's lists, the lists in them and the lists in their objects (a message's
    content parts) at most max_items long; a 400 naming the first that is not."""
    for name, value in body.items():
        if not isinstance(value, list):
            continue
        lists = [(name, value)]
        if len(value) <= max_items:
            for i, item in enumerate(value):
                inner = item.items() if isinstance(item, dict) else [("", item)]
                lists += [(f"{name}[{i}]" + (f".{k}" if k else ""), v) for k, v in inner
                          if isinstance(v, list)]
        for where, items in lists:
            if len(items) > max_items:
                raise APIError(400, f"{where} has {len(items)} items, more than this server "
                                    f"accepts ({max_items})", param=name)
