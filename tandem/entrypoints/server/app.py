"""The FastAPI app: both APIs, /metrics, /health, the stats logger, the model's load.

``build_app(engine, ServerConfig(...))`` wires an EngineClient, or a loader
that makes one in a background thread while the gates in middleware.py answer
503 "Loading model" (as llama-server does); run.py serves it (``tandem serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

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
    caller's decision: see run.run_server.
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
    server, yet every full collection would walk it holding the GIL, stalling
    every stream. Start-up's own garbage goes first."""
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
