"""Structured outputs and tools: API fields -> the engine's StructuredOutputsParams.

Every API's way of asking for constrained output lands on one
``StructuredOutputsParams`` (vLLM's names): OpenAI's ``response_format``,
vLLM's ``structured_outputs``, Ollama's ``format``, the Responses API's
``text.format`` and a forced tool choice. A ``Constraint`` remembers the field
it came from, so a schema the grammar engine cannot compile is a 400 naming
that field, not the engine's internal name.

Tools are handed to the chat template (``apply_chat_template(tools=...)``).
A template that knows no tools (SmolLM2's) gets them as a system prompt in
Hermes's format, the calls and results of earlier turns as Hermes's
``<tool_call>`` / ``<tool_response>`` text, and its output is parsed as
Hermes; ``tool_choice`` ``required`` or a named function is enforced by a
JSON-schema grammar over the call(s), so even a small model writes a valid
call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.entrypoints.server.errors import APIError, bad_request
from tandem.entrypoints.server.protocol import (
    ChatTool,
    NamedToolChoice,
    ResponseFormat,
    ResponsesTextFormat,
    StructuredOutputsBody,
)
from tandem.entrypoints.server.tool_parsers import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Family,
    ToolCallParser,
    template_family,
)
from tandem.sampling_params import StructuredOutputsParams

_ENGINE_PREFIX = "structured_outputs"


@dataclass
class Constraint:
    """What the output must match, and the request field that asked for it."""

    params: StructuredOutputsParams
    param: str  # e.g. "response_format.json_schema.schema"
    yields: bool = False  # strict tools under auto: a response format given beside wins

    def name_field(self, err: APIError) -> APIError:
        """The engine's compile error, reworded to name this request's field."""
        if err.status == 400 and err.message.startswith(_ENGINE_PREFIX):
            return bad_request(_reworded(err.message, self.param), self.param)
        return err


def _reworded(message: str, param: str) -> str:
    """``structured_outputs.json cannot be compiled: ...`` -> ``{param} cannot be ...``."""
    if not message.startswith(_ENGINE_PREFIX):
        return f"{param}: {message}"
    return f"{param} {message.split(' ', 1)[-1]}"


def _constraint(param: str, **fields: Any) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**fields), param)
    except ValueError as e:  # the shape (exactly one of ..., types)
        raise bad_request(_reworded(str(e), param), param) from None


def _schema(schema: Any, param: str) -> Constraint:
    if not isinstance(schema, dict) or not schema:
        raise bad_request(f"{param} must be a JSON schema (a non-empty object)", param)
    return _constraint(param, json=schema)


def from_response_format(rf: ResponseFormat | None, param: str = "response_format"
                         ) -> Constraint | None:
    """OpenAI's response_format: text (none), json_object, json_schema."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return _constraint(param, json_object=True)
    if rf.json_schema is None:
        raise bad_request(f"{param}.json_schema is required when type is json_schema",
                          f"{param}.json_schema")
    return _schema(rf.json_schema.schema_, f"{param}.json_schema.schema")


def from_text_format(fmt: ResponsesTextFormat | None, param: str = "text.format"
                     ) -> Constraint | None:
    """The Responses API's text.format: response_format with the schema one level up."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _constraint(param, json_object=True)
    return _schema(fmt.schema_, f"{param}.schema")


def from_structured_outputs(so: StructuredOutputsBody | None) -> Constraint | None:
    """vLLM's structured_outputs body field."""
    if so is None:
        return None
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object),
                               ("structural_tag", so.structural_tag))
             if v not in (None, False)}
    param = f"structured_outputs.{next(iter(given))}" if len(given) == 1 \
        else "structured_outputs"
    return _constraint(param, **given)


def from_ollama_format(fmt: str | dict[str, Any] | None) -> Constraint | None:
    """Ollama's format: "json" (any JSON object) or a JSON schema ({}, which Ollama
    passes on as a schema that takes anything, as "json")."""
    if fmt in (None, ""):
        return None
    if fmt == "json" or fmt == {}:
        return _constraint("format", json_object=True)
    if isinstance(fmt, str):
        raise bad_request(f'format must be "json" or a JSON schema, got {fmt!r}', "format")
    return _schema(fmt, "format")


def one_constraint(*found: Constraint | None) -> Constraint | None:
    """At most one way of constraining the output per request."""
    given = [c for c in found if c is not None]
    if len(given) > 1:
        given = [c for c in given if not c.yields]
    if len(given) > 1:
        raise bad_request(f"{given[0].param} and {given[1].param} both constrain the output; "
                          "send one", given[1].param)
    return given[0] if given else None


# ------------------------------------------------------------------- tools
@dataclass
class ToolPlan:
    """The tools of one chat request: how they reach the template, what constrains the
    output, and how the output is read back."""

    tools: list[dict[str, Any]]  # OpenAI's nested shape, as chat templates expect
    choice: str  # "none" | "auto" | "required" | "function"
    name: str | None  # the function a named tool_choice forces
    parallel: bool
    native: bool  # the chat template renders tools itself
    family: Family  # how the model writes calls when it decides to
    fields: str = "function."  # where a tool's name and parameters are, for 400s

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def _parameters(self, i: int) -> dict[str, Any]:
        # None: no arguments, OpenAI's reading of a function without parameters.
        return self.tools[i]["function"].get("parameters") or {"type": "object",
                                                                 "properties": {}}

    def constraint(self) -> Constraint | None:
        """required: a JSON list of calls (one if not parallel); a named function: its
        arguments (both JSON schemas the grammar engine enforces); auto with a strict
        tool: each call the model opens (a structural tag)."""
        if self.choice == "function":
            i = self.names.index(self.name)  # type: ignore[arg-type]
            return _schema(self._parameters(i), _tool_field(i, self.fields, "parameters"))
        if self.choice == "auto":
            return self._strict_calls()
        if self.choice != "required":
            return None
        # Each tool's parameters sit under $defs, their own "#..." refs rebased there:
        # inlined, a pydantic model's "#/$defs/Addr" pointed into the wrapper (a 400)
        # and a recursive "#" at the array of calls (calls nested in arguments).
        calls = [{"type": "object", "properties": {
                      "name": {"type": "string", "enum": [name]},
                      "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for i, name in enumerate(self.names)]
        schema: dict[str, Any] = {
            "$defs": {f"tool_{i}": _rebased(self._parameters(i), f"#/$defs/tool_{i}")
                      for i in range(len(self.names))},
            "type": "array", "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if self.parallel:  # distinct calls: a small model repeated one until max_tokens
            schema["uniqueItems"] = True
        else:
            schema["maxItems"] = 1
        return _schema(schema, "tools")

    def _strict_calls(self) -> Constraint | None:
        """With a ``strict`` tool under auto, text stays free but a call, once its tag
        (Hermes) or its ``{"name": `` (Llama 3) starts it, names one of the tools and
        follows that tool's parameters (any JSON object for a tool not strict), as
        OpenAI guarantees strict functions."""
        if not any(t["function"].get("strict") for t in self.tools):
            return None
        if self.family == "hermes":
            trigger, key, end = TOOL_CALL_OPEN, "arguments", "}\n" + TOOL_CALL_CLOSE
            prefix = TOOL_CALL_OPEN + '\n{"name": '
        else:
            trigger = prefix = '{"name": '
            key, end = "parameters", "}"
        structures = [{"begin": f'{prefix}{json.dumps(name)}, "{key}": ', "end": end,
                       "schema": self._parameters(i) if self.tools[i]["function"].get("strict")
                       else {"type": "object"}}
                      for i, name in enumerate(self.names)]
        c = _constraint("tools", structural_tag={"triggers": [trigger], "structures": structures})
        return Constraint(c.params, c.param, yields=True)

    def parser(self) -> ToolCallParser | None:
        known = set(self.names)
        if self.choice == "none":
            return None
        if self.choice == "function":
            return ToolCallParser("arguments", known, self.name)
        if self.choice == "required":
            return ToolCallParser("array", known)
        return ToolCallParser(self.family, known, max_calls=None if self.parallel else 1)


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its document-local references (``"$ref": "#..."``) pointing into
    ``base`` (a JSON pointer such as ``#/$defs/tool_0``), where it is placed."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else v if k in _DATA_KEYWORDS else _rebased(v, base)
            for k, v in schema.items()}


def _tool_field(i: int, fields: str, name: str) -> str:
    """A tool's field as a 400 names it: ``tools[i].function.name`` (chat completions,
    Ollama) or ``tools[i].name`` (the Responses API's flat tools)."""
    return f"tools[{i}].{fields}{name}"


def plan_tools(tools: list[ChatTool] | None, tool_choice: str | NamedToolChoice | None,
               parallel: bool, chat_template: str | None, flat: bool = False
               ) -> ToolPlan | None:
    """The request's tools checked against each other and tool_choice (400s name the
    field; ``flat``: the client sent the Responses API's flat tools, ``tools[i].name``)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    fields = "" if flat else "function."
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.function.name in seen:
            where = _tool_field(i, fields, "name")
            raise bad_request(f"{where} {t.function.name!r} is given twice", where)
        seen.add(t.function.name)
        kind = (t.function.parameters or {}).get("type", "object")
        if kind != "object":  # a call's arguments are an object, as OpenAI requires
            where = _tool_field(i, fields, "parameters")
            raise bad_request(f"{where} must be a JSON schema of type 'object', "
                              f"got type {kind!r}", where)
    name = None
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in seen:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among "
                              f"tools ({', '.join(sorted(seen))})", "tool_choice")
        choice = "function"
    else:
        choice = tool_choice or "auto"
    return ToolPlan(
        tools=[{"type": "function", "function": t.function.model_dump(exclude_none=True)}
               for t in tools],
        choice=choice, name=name, parallel=parallel,
        native=knows_tools(chat_template), family=template_family(chat_template),
        fields=fields)


def knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools, calls and results itself."""
    return "tools" in (chat_template or "")


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan | None,
                      chat_template: str | None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template.

    ``messages`` are HF's shape: content a string, an assistant's ``tool_calls``
    with arguments as objects, tool results with role ``tool``. A template that
    knows no tools gets Hermes's text for all three instead, and the tools'
    system prompt when the request has tools: a conversation's calls and
    results are rendered whether or not this request offers tools (an agent's
    last "answer now" turn often does not; the calls vanished from its prompt).
    """
    if knows_tools(chat_template) or (plan is None and not any(
            m.get("tool_calls") or m["role"] == "tool" for m in messages)):
        return messages, plan.tools if plan else None
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            text = (m["content"] + "\n" if m["content"] else "") + calls
            out.append({"role": m["role"], "content": text})
        elif m["role"] == "tool":  # Qwen2.5's way: consecutive results in one user turn
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if plan is None:
        return out, None
    prompt = _hermes_system_prompt(plan.tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def json_arguments(text: str) -> dict | str:
    """A tool call's arguments string as chat templates render it: the JSON object it
    holds, or the text itself when it holds none. OpenAI takes ``arguments`` back as
    an opaque string, and a history this server wrote may carry a call cut by
    max_tokens; refused, the agent's next turn was a 400 and its loop was dead. An
    empty string (a call cut before its arguments) is {}, as vLLM reads it."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _call_text(call: dict[str, Any]) -> str:
    """One call as Hermes's tags hold it; arguments that are no JSON object as their
    raw text, where the model would have written them."""
    name, args = call["function"]["name"], call["function"]["arguments"]
    if isinstance(args, str):
        return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n' \
               f"{TOOL_CALL_CLOSE}"
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n" \
           f"{TOOL_CALL_CLOSE}"


def _hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Qwen2.5's tool prompt (the Hermes format its parser reads back)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")
