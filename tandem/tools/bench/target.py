"""The server under test: URL, endpoint, auth headers, model name and context window.

Shared by ``bench serve`` and ``bench phases``. Discovery errors (nothing
listening, wrong key) become one clear ValueError before any load is sent.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import httpx

from tandem.tools.bench.client import BACKENDS, DEFAULT_ENDPOINTS


@dataclass
class Target:
    base_url: str
    endpoint: str
    backend: str
    model: str
    headers: dict[str, str]
    max_model_len: int | None = None

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint


def parse_headers(pairs: list[str] | None, api_key: str | None) -> dict[str, str]:
    """``--header KEY=VALUE`` pairs plus ``Authorization: Bearer`` from ``--api-key``."""
    headers: dict[str, str] = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    for item in pairs or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header {item!r}: use KEY=VALUE")
        headers[key.strip()] = value.strip()
    return headers


def resolve_target(base_url: str | None, host: str, port: int, backend: str,
                   endpoint: str | None, model: str | None, headers: dict[str, str],
                   client: httpx.Client) -> Target:
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: choose from {', '.join(BACKENDS)}")
    base = (base_url or f"http://{host}:{port}").rstrip("/")
    if base.endswith("/v1"):  # a common slip: the OpenAI SDK's base_url
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {base_url!r} must start with http:// or https://")
    endpoint = endpoint or DEFAULT_ENDPOINTS[backend]
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    _check_endpoint(backend, endpoint)
    models = _discover(client, base, headers)
    if model is None:
        if not models:
            raise ValueError(still_loading(client, base, headers) or
                             f"no model listed at {base} (/v1/models, /api/tags); pass --model")
        model = models[0][0]
    max_len = next((n for name, n in models if name == model), None)
    return Target(base, endpoint, backend, model, headers, max_len)


def _check_endpoint(backend: str, endpoint: str) -> None:
    ok = {"openai": ("completions",), "openai-chat": ("chat/completions",),
          "ollama": ("/api/generate", "/api/chat")}[backend]
    if not endpoint.rstrip("/").endswith(ok) or (
            backend == "openai" and endpoint.rstrip("/").endswith("chat/completions")):
        raise ValueError(f"--endpoint {endpoint} does not fit --backend {backend} "
                         f"(default {DEFAULT_ENDPOINTS[backend]})")


def still_loading(client: httpx.Client, base: str, headers: dict[str, str] | None = None
                  ) -> str | None:
    """What to tell an operator when a server lists no model because it is still
    loading one (its /health is a 503 "Loading model", as tandem's and
    llama-server's are): "pass --model" was the wrong advice. None otherwise."""
    try:
        r = client.get(base + "/health", headers=headers or {})
    except httpx.HTTPError:
        return None
    if r.status_code == 503 and "loading" in r.text.lower():
        return (f"the server at {base} is still loading its model (/health: 503 Loading "
                "model); try again once /health answers 200")
    return None


def _discover(client: httpx.Client, base: str, headers: dict[str, str]
              ) -> list[tuple[str, int | None]]:
    """(name, max_model_len) of each model in /v1/models, else Ollama's /api/tags."""
    for path in ("/v1/models", "/api/tags"):
        try:
            r = client.get(base + path, headers=headers)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
        if r.status_code in (401, 403):
            raise ValueError(f"{base}{path} answered {r.status_code}: pass --api-key "
                             "(or set OPENAI_API_KEY)")
        if r.status_code != 200:
            continue
        try:
            body = r.json()
        except ValueError:
            continue
        listed = body.get("data") if path == "/v1/models" else body.get("models")
        out = []
        for m in listed or []:
            name = m.get("id") or m.get("name") or m.get("model")
            max_len = m.get("max_model_len")
            out.append((str(name), max_len if isinstance(max_len, int) else None))
        if out:
            return out
    return []


def resolve_seed(seed: int | None) -> int:
    """The given seed, or a fresh one: identical prompts in a second run would hit the
    server's prefix cache from the first and flatter its prefill."""
    return seed if seed is not None else secrets.randbelow(2**31)


def default_api_key() -> str | None:
    """vLLM's bench reads OPENAI_API_KEY; tandem serve reads TANDEM_API_KEY."""
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("TANDEM_API_KEY")
