"""The ASGI gates in front of every route, and errors in each API's shape.

OriginGate refuses foreign origins and DNS rebinding, UntilReady holds
requests while the model loads (there is no ServerState yet), and
NoUnhandledErrors turns what no handler caught into a 500. An error takes the
shape of the API its path belongs to: Ollama's under /api/, OpenAI's elsewhere.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import traceback
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers, State
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.entrypoints.server.errors import APIError

logger = logging.getLogger("tandem.entrypoints.server")

# Browser pages that may call the APIs unless --allowed-origins says otherwise: what
# Ollama allows by default (pages served from this machine, desktop apps' schemes).
LOCAL_ORIGINS = (r"(https?://(localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\])(:\d+)?"
                 r"|(app|file|tauri|vscode-webview|vscode-file)://.*)")
# Answer while the model loads: they need no engine, and clients probe them
# to find out whether a server is there at all (Ollama's CLI: HEAD /).
OPEN_WHILE_LOADING = frozenset({"/version", "/api/version", "/"})


class OriginGate:
    """ASGI middleware: a request a browser sends for a page of another origin than
    the server's own, and not one --allowed-origins (default: LOCAL_ORIGINS) admits,
    gets a 403 before it runs, as Ollama answers it. CORS alone only keeps the answer
    from such a page: a request that needs no preflight (a text/plain POST) still ran,
    so any web site could drive generation on a server on localhost."""

    def __init__(self, app: ASGIApp, origins: list[str] | None, check_host: bool = True) -> None:
        self.app = app
        self.check_host = check_host
        self.own_name = socket.gethostname().lower()
        self.any = origins is not None and "*" in origins
        self.exact = frozenset(origins or ())
        self.pattern = re.compile(LOCAL_ORIGINS)  # --allowed-origins adds to them, as Ollama

    def allowed(self, origin: str, hosts: tuple[str | None, ...]) -> bool:
        if self.any or origin in self.exact or urlsplit(origin).netloc in hosts:
            return True  # the last: the server's own pages (the dashboard), by any name
        return self.pattern.fullmatch(origin) is not None

    def local_name(self, host: str | None) -> bool:
        """Whether a Host header names this machine as no DNS answer could: an IP
        address, localhost (or a name under .localhost), the machine's own name."""
        name = urlsplit(f"//{host or ''}").hostname or ""
        if name == "localhost" or name.endswith(".localhost") or name == self.own_name:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def rebound(self, scope: Scope, headers: Headers) -> bool:
        """DNS rebinding: a page of another site whose name the attacker re-points at
        127.0.0.1 is same-origin with it (Origin matches Host, or no Origin at all),
        so on the loopback interface, without an API key, a Host that is not a local
        name is refused, as Ollama refuses it."""
        server = scope.get("server")
        if not self.check_host or not server:
            return False
        try:
            loopback = ipaddress.ip_address(server[0]).is_loopback
        except ValueError:  # a Unix socket's path
            return False
        return loopback and not self.local_name(headers.get("host"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":  # preflights: CORS's
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            # its own name: Host, or the one a proxy that rewrote Host passes on
            hosts = (headers.get("host"), headers.get("x-forwarded-host"))
            message = None
            if self.rebound(scope, headers):
                message = (f"host {headers.get('host')!r} is not a name of this server: on "
                           "the loopback interface without --api-key only local names are "
                           "served")
            elif origin is not None and not self.allowed(origin, hosts):
                message = (f"origin {origin} may not call this server: start it with "
                           "--allowed-origins naming it")
            if message is not None:
                err = APIError(403, message, error_type="permission_error",
                               ollama_message=message)
                await render_error(Request(scope), err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class UntilReady:
    """ASGI middleware: the readiness gate (see app.build_app); a pass-through once loaded.

    Ollama's routes wait for the load instead of a 503: Ollama loads a model on
    its first request and answers that request once it is in, and its clients
    (its SDKs, chat UIs) do not retry a 503 as the OpenAI SDK does.
    """

    def __init__(self, app: ASGIApp, app_state: State) -> None:
        self.app = app
        self.app_state = app_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gated = scope["type"] == "http" and scope["path"] not in OPEN_WHILE_LOADING
        if gated and self.app_state.tandem is None and scope["path"].startswith("/api/"):
            await self.app_state.load_done.wait()
        if gated and self.app_state.tandem is None:
            failed = self.app_state.load_error is not None
            err = APIError(503, "The model failed to load" if failed else "Loading model",
                           error_type="unavailable_error",
                           ollama_message="the model failed to load" if failed
                           else "loading model")
            await render_error(Request(scope), err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def render_error(request: Request, err: APIError) -> Response:
    ollama_style = request.url.path.startswith("/api/")
    body = err.ollama_body() if ollama_style else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        if err.code == "server_overloaded":
            app.state.tandem.metrics.rejections.inc()
        return render_error(request, err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> Response:
        return render_error(request, APIError(400, f"invalid request: {err.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        return render_error(request, APIError(err.status_code, str(err.detail),
                                         headers=err.headers))  # a 405's Allow


class NoUnhandledErrors:
    """ASGI middleware: an exception no handler turned into an APIError becomes a 500
    in the route's API shape, logged on one line, and the connection stays open.

    Starlette's own last-resort handler re-raises after answering, so uvicorn logs
    a full traceback and closes the keep-alive connection under the client's next
    request. If the response had started (a stream), its body is ended cleanly
    instead. A client that left mid-upload needs no answer at all.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body"
                              and not message.get("more_body", False))
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            return
        except Exception as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            logger.error("unhandled %s on %s %s: %s (%s:%d)", type(e).__name__,
                         scope["method"], scope["path"], e, frame.filename, frame.lineno)
            if not started:
                err = APIError(500, f"internal server error ({type(e).__name__})",
                               code="internal_error")
                await render_error(Request(scope), err)(scope, receive, send)
            elif not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

