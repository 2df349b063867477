"""One error type for the whole server, rendered in the shape each API's clients parse.

Handlers raise ``APIError``; the app's exception handlers render it as
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` or Ollama's
``{"error": "..."}`` depending on the path, so the SDKs raise their own typed
exceptions (openai.BadRequestError, ollama.ResponseError, ...).
"""

from __future__ import annotations

from pydantic import ValidationError

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    """An HTTP error with a message meant for the client (never a traceback)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        ollama_message: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.ollama_message = ollama_message or message
        self.error_type = error_type  # OpenAI's "type"; default: by status

    def openai_body(self) -> dict:
        return {"error": {
            "message": self.message,
            "type": self.error_type or _OPENAI_TYPES.get(
                self.status, "invalid_request_error" if self.status < 500 else "server_error"),
            "param": self.param,
            "code": self.code if self.code is not None else self.status,
        }}

    def ollama_body(self) -> dict:
        return {"error": self.ollama_message}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_validation_error(err: ValidationError) -> APIError:
    """A 400 naming the offending field, from pydantic's (possibly many) complaints.

    Unions (e.g. ``prompt: str | list[int]``) produce one complaint per member;
    the first per field is enough for a person to fix the request.
    """
    seen: set[str] = set()
    parts: list[str] = []
    first_param = None
    for e in err.errors(include_url=False):
        field = _field(e.get("loc", ()))
        if field in seen:
            continue
        seen.add(field)
        first_param = first_param or field
        msg = e.get("msg", "invalid value")  # a validator's ValueError: its own words
        parts.append(f"{field}: {msg.removeprefix('Value error, ')}")
        if len(parts) == 3:
            break
    return APIError(400, "invalid request: " + "; ".join(parts), param=first_param)


def _field(loc: tuple) -> str:
    """pydantic's error location as the server's own messages name a field:
    ``messages[0].content``."""
    field = ""
    for x in loc:
        if isinstance(x, int):
            field += f"[{x}]"
        elif not _is_type_tag(x):
            field += f".{x}" if field else str(x)
    return field or "body"


def _is_type_tag(x: object) -> bool:
    """pydantic puts union member names (``str``, ``list[int]``) into error locations."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x)
