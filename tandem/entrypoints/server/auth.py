"""--api-key: a bearer token on every API route (both APIs, as one server).

/health, /metrics, /version, / and /api/version stay open: probes and
scrapers should not need the key, and they reveal nothing a client sends.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from tandem.entrypoints.server.errors import APIError


async def require_api_key(request: Request) -> None:
    key = request.app.state.tandem.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", ollama_message="unauthorized",
                       headers={"WWW-Authenticate": "Bearer"})  # RFC 6750's challenge
