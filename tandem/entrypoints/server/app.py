"""The FastAPI app: both APIs, /metrics, /health, error shapes, the stats logger.

``build_app(engine, ServerConfig(...))`` wires an EngineClient, or a loader
that makes one in the background; ``serve`` is ``tandem serve``, which listens
at once and loads the model behind a 503 "Loading model" (as llama-server does).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from tandem import __version__
from tandem.engine.client import EngineClient, ReplicaSet
from tandem.entrypoints.server import dashboard, defaults, ollama, openai, responses
from tandem.entrypoints.server.admission import Admission
from tandem.entrypoints.server.dashboard import DashboardConfig
from tandem.entrypoints.server.metrics import ServerMetrics
from tandem.entrypoints.server.middleware import (
    LOCAL_ORIGINS,
    NoUnhandledErrors,
    OriginGate,
    UntilReady,
    install_error_handlers,
)
from tandem.entrypoints.server.model_card import ModelCard
from tandem.entrypoints.server.reasoning import reasoning_enabled
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.stats import StatsLogger

logger = logging.getLogger("tandem.entrypoints.server")

Loader = Callable[[], EngineClient]
# On an exit signal requests in flight get DRAIN_S to finish; the rest end in an
# error before uvicorn cancels their handlers, GRACEFUL_SHUTDOWN_S after it.
DRAIN_S = 3.0
GRACEFUL_SHUTDOWN_S = 5


@dataclass
class ServerConfig:
    """Server-side settings (the engine's are in EngineConfig).

    max_queue: requests allowed to wait beyond the running batch before new
        ones get 503 + Retry-After; None = max_num_seqs (one batch's worth:
        a waiting request starts within about one reply's time).
    generation_config, override_generation_config: where sampling defaults
        come from (see tandem.entrypoints.server.defaults; the override as checked by
        defaults.parse_override).
    reasoning_parser: whether think blocks leave the answer for the APIs'
        reasoning fields (see tandem.entrypoints.server.reasoning).
    """

    served_model_names: list[str] | None = None
    api_key: str | None = None
    allowed_origins: list[str] | None = None  # beside LOCAL_ORIGINS; ["*"]: any
    max_queue: int | None = None
    max_body_bytes: int = 16 * 2**20
    stats_interval_s: float = 10.0
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    reasoning_parser: str = "auto"  # see tandem.entrypoints.server.reasoning.MODES
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)


def build_app(engine: EngineClient | Loader, config: ServerConfig | None = None) -> FastAPI:
    """The app over a loaded EngineClient, or over a loader that makes one.

    Given an engine (tests, embedding), the app is ready at once. Given a
    loader (``tandem serve``), the server can listen before a multi-GB model is
    in memory: the lifespan runs the loader in a daemon thread, and until it
    returns, ``app.state.tandem`` is None and one gate, the ``UntilReady``
    middleware in front of every route, answers 503 "Loading model" in the
    route's API shape (all but OPEN_WHILE_LOADING; Ollama's wait). One gate rather than a
    check per route or router because everything behind it, handlers, the
    API-key dependency, /metrics, /health, reads the ServerState that only a
    loaded engine can build; behind the gate they stay as they were.

    If the loader raises, the exception is kept in ``app.state.load_error`` and
    the gate says "The model failed to load"; what to do then (exit) is the
    caller's decision: see run_server.
    """
    config = config or ServerConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_when_loaded(app, engine, config))
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="tandem", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tandem = None
    app.state.load_error = None
    app.state.load_done = asyncio.Event()  # set once the load has ended, either way
    if not callable(engine):  # an engine, not a loader
        app.state.tandem = _server_state(engine, config)
    app.add_middleware(UntilReady, app_state=app.state)
    app.add_middleware(NoUnhandledErrors)
    origins = config.allowed_origins
    app.add_middleware(OriginGate, origins=origins, check_host=not config.api_key)
    # Outermost, so a browser's preflight is answered before the gates or a route's key.
    app.add_middleware(CORSMiddleware, allow_origins=origins or [],
                       allow_origin_regex=LOCAL_ORIGINS,
                       allow_methods=["*"], allow_headers=["*"])
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(ollama.public)
    app.include_router(ollama.router)
    dashboard.install(app, config.dashboard)

    @app.get("/health")
    async def health() -> Response:
        engine = app.state.tandem.engine
        if engine.dead:
            return JSONResponse({"error": "the engine loop is not running"}, status_code=503)
        if isinstance(engine, ReplicaSet):  # healthy only while every replica answers
            down = [name for name, s in engine.replica_stats().items() if s is None]
            if down:
                return JSONResponse({"error": f"replicas not answering (restarting, or "
                                              f"gone): {', '.join(down)}"}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(app.state.tandem.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    install_error_handlers(app)
    return app


def _server_state(engine: EngineClient, config: ServerConfig) -> ServerState:
    info = engine.model_info
    max_queue = config.max_queue if config.max_queue is not None else info.max_num_seqs
    card = ModelCard.from_engine(engine, config.served_model_names)
    return ServerState(
        engine=engine,
        card=card,
        admission=Admission(engine, max_queue),
        metrics=ServerMetrics(engine, card.name),
        api_key=config.api_key or None,
        max_body_bytes=config.max_body_bytes,
        defaults=defaults.resolve(config.generation_config, config.override_generation_config,
                                  Path(info.model_dir), Path(card.root) if card.format == "gguf"
                                  else None),
        reasoning=reasoning_enabled(config.reasoning_parser,
                                    engine.tokenizer.chat_template if engine.tokenizer else None),
    )


async def _when_loaded(app: FastAPI, engine: EngineClient | Loader, config: ServerConfig) -> None:
    """The lifespan's task: load if needed, open the gate, then log stats forever."""
    if app.state.tandem is None:
        try:
            loaded, error = await _in_daemon_thread(engine)
            if error is not None:
                app.state.load_error = error
                return
            app.state.tandem = _server_state(loaded, config)
            _freeze_startup_heap()
        finally:  # also when the server stops mid-load: the waiting requests get their 503
            app.state.load_done.set()
    state: ServerState = app.state.tandem
    card = state.card
    logger.info("serving %s (%s weights; max_model_len %d, max_num_seqs %d, max_queue %d)%s",
                " / ".join(card.names), card.quantization_level, card.max_model_len,
                state.engine.model_info.max_num_seqs, state.admission.max_queue,
                "; every API needs the API key" if config.api_key else "")
    logger.info("sampling defaults for fields a request leaves out: %s; max_tokens: until "
                "the model stops or the context is full (chat, /api/*), %d (/v1/completions)",
                state.defaults.describe(), openai.COMPLETIONS_DEFAULT_MAX_TOKENS)
    await StatsLogger(state.engine, config.stats_interval_s).run()


def _freeze_startup_heap() -> None:
    """Move what start-up made (imports, the model's Python objects) out of the
    garbage collector's reach, as vLLM's engine does: it lives as long as the
    server, yet every full collection would walk it (~310k objects with the
    default model) holding the GIL, a 131-144 ms stall of every stream on a
    2-vCPU Zen 4; frozen, a full collection of what serving leaves took ~0 ms.
    Start-up's own garbage goes first."""
    gc.collect()
    gc.freeze()


async def _in_daemon_thread(load: Loader) -> tuple[EngineClient | None, BaseException | None]:
    """(load(), None) or (None, what it raised), without blocking the event loop.

    A daemon thread, not the loop's executor: asyncio.run waits for executor
    threads at exit, so Ctrl-C during a minutes-long load would wait for it.
    The exception is returned, not raised, so a KeyboardInterrupt in the loader
    cannot escape into the event loop.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: tuple) -> None:
        if not done.done():  # the server may have stopped waiting
            done.set_result(result)

    def run() -> None:
        try:
            result: tuple = (load(), None)
        except BaseException as e:  # handed to the loop
            result = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=run, name="tandem-load", daemon=True).start()
    return await done



# -------------------------------------------------------------------- CLI
def serve(args, load: Loader) -> int:
    """``tandem serve``: check the flags, then run_server with the model's loader."""
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not 0 < args.stats_interval < math.inf:  # nan too: it logged every ~0.1 s
        raise ValueError(f"--stats-interval must be a positive number of seconds, got "
                         f"{args.stats_interval}")
    # An empty key would leave the APIs open ("--api-key $KEY" with KEY unset).
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key (or $TANDEM_API_KEY) is empty: give a key, or leave both "
                         "out for no key")
    for origin in args.allowed_origins or ():
        parts = urlsplit(origin)
        if origin != "*" and not (parts.scheme and parts.netloc and not parts.path
                                  and not parts.query and not parts.fragment):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin (what a browser "
                             "sends: scheme://host[:port], no path), e.g. "
                             "http://192.168.1.20:3000")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise ValueError("--served-model-name: a name must not be empty")
    dashboard_config = dashboard.config_from_args(args)
    generation_config = defaults.check_mode(args.generation_config)
    override = defaults.parse_override(args.override_generation_config)

    def logged_load() -> EngineClient:
        engine = load()
        logger.info("model loaded in %.1f s", engine.model_info.load_duration_s)
        return engine

    return run_server(logged_load, ServerConfig(
        served_model_names=args.served_model_name, api_key=args.api_key,
        allowed_origins=args.allowed_origins, max_queue=args.max_queue,
        stats_interval_s=args.stats_interval,
        generation_config=generation_config, override_generation_config=override,
        reasoning_parser=args.reasoning_parser, dashboard=dashboard_config,
    ), host=args.host, port=args.port, access_log=args.access_log)


def _listen(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, bound: one for each address ``host`` names (``localhost``
    is 127.0.0.1 and ::1 where /etc/hosts says both; bound to the first only, clients
    of the other got "connection refused"), as uvicorn's own --host binds them. An
    address that is taken or not this machine's is a ValueError (one CLI line)
    before a model loads, not uvicorn's log line after it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    socks: list[socket.socket] = []
    # each address once, in order (getaddrinfo may list one per protocol)
    for family, kind, proto, addr in dict.fromkeys((f, k, p, a) for f, k, p, _, a in infos):
        sock = socket.socket(family, kind, proto)
        socks.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # beside an IPv4 socket on the same port
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            for s in socks:
                s.close()
            raise ValueError(f"cannot listen on {host} port {port}: {e.strerror}") from None
    return socks


def _drain(state: ServerState) -> None:
    """On shutdown: give the requests in flight DRAIN_S to finish, then shut the
    engine down, so each one still running ends in its API's error (an SSE
    error event and [DONE], or a 503 in shape) before uvicorn's graceful
    timeout cancels its handler. Cancelled, a stream was cut without either
    and every handler logged a traceback. In flight is what the server
    accepted (a request still being tokenized included) and what the engine
    holds."""
    engine = state.engine
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        s = engine.stats()
        if not (state.admission.in_flight or s.num_running or s.num_waiting or s.num_pending):
            break
        time.sleep(0.05)
    else:
        logger.warning("shutting down: requests still running after %.0f s end with an error",
                       DRAIN_S)
    engine.shutdown()


def uvicorn_config(app: ASGIApp, **kwargs: Any) -> Any:
    """uvicorn's Config for tandem's app (``tandem serve`` and the tests' servers):
    its HTTP protocol with a deadline for request heads, tandem's own logging."""
    import uvicorn

    from tandem.entrypoints.server.http_protocol import HeadDeadlineProtocol

    return uvicorn.Config(app, http=HeadDeadlineProtocol, log_config=None, **kwargs)


def run_server(load: Loader, config: ServerConfig, host: str, port: int,
               access_log: bool = True) -> int:
    """Listen at once, load in the background, serve until interrupted; 0 when stopped.

    A failed load stops the server and its exception is re-raised here, in the
    caller's thread, so ``tandem serve`` fails as it did when it loaded before
    listening: the CLI prints a ValueError's message (no traceback) and exits 2;
    anything else is a traceback.
    """
    import uvicorn

    socks = _listen(host, port)  # before the load: a port in use says so at once
    failure: list[BaseException] = []

    def load_or_stop() -> EngineClient:
        try:
            return load()
        except BaseException as e:
            failure.append(e)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            logger.error("the model failed to load (%s): shutting down", reason)
            server.should_exit = True
            raise

    app = build_app(load_or_stop, config)

    drains: list[threading.Thread] = []

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            """The drain starts beside uvicorn's own wait for connections to close
            (on the event loop, not in the signal handler)."""
            if app.state.tandem is not None:
                drains.append(threading.Thread(target=_drain, args=(app.state.tandem,),
                                               name="tandem-drain", daemon=True))
                drains[-1].start()
            await app.state.dashboard.close()
            await super().shutdown(sockets)

    server = Server(uvicorn_config(app, host=host, port=port, access_log=access_log,
                                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    logger.info("listening on http://%s:%d; loading the model: until it is ready, OpenAI "
                "requests get 503 \"Loading model\" and Ollama's wait",
                host if ":" not in host else f"[{host}]", port)
    interrupted = False
    try:
        server.run(sockets=socks)
    except KeyboardInterrupt:  # uvicorn re-raises a caught SIGINT once it has shut down
        interrupted = True
    finally:
        for drain in drains:  # it shuts the engine down: once, and not beside this
            drain.join(timeout=DRAIN_S + GRACEFUL_SHUTDOWN_S)
        if app.state.tandem is not None and not app.state.tandem.engine.dead:
            app.state.tandem.engine.shutdown()
    if failure:
        raise failure[0]
    if app.state.tandem is None and app.state.load_error is None:
        # Stopped while the model loads. The loader thread cannot be stopped, and
        # the interpreter's exit beside it, inside torch's threads, aborted the
        # process ("terminate called without an active exception", SIGABRT).
        logger.info("stopped while the model was loading")
        logging.shutdown()
        os._exit(130 if interrupted else 0)
    return 0 if server.started else 1
