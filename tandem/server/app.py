"""The FastAPI app: both APIs, /metrics, /health, error shapes, the stats logger.

``build_app(engine, ServerConfig(...))`` wires an already-loaded AsyncEngine
(the model is loaded once, before the server listens); ``serve`` is
``tandem serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem import __version__
from tandem.engine.async_engine import AsyncEngine
from tandem.server import ollama, openai
from tandem.server.admission import Admission
from tandem.server.errors import APIError
from tandem.server.metrics import ServerMetrics
from tandem.server.model_card import ModelCard
from tandem.server.state import ServerState
from tandem.server.stats import StatsLogger

logger = logging.getLogger("tandem.server")


@dataclass
class ServerConfig:
    """Server-side settings (the engine's are in EngineConfig).

    max_queue: requests allowed to wait beyond the running batch before new
        ones get 503 + Retry-After; None = max_num_seqs (one batch's worth:
        a waiting request starts within about one reply's time).
    """

    served_model_names: list[str] | None = None
    api_key: str | None = None
    max_queue: int | None = None
    max_body_bytes: int = 16 * 2**20
    stats_interval_s: float = 10.0


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    llm = engine.engine
    max_queue = config.max_queue if config.max_queue is not None else llm.config.max_num_seqs
    card = ModelCard.from_engine(llm, config.served_model_names)
    state = ServerState(
        engine=engine,
        card=card,
        admission=Admission(engine, max_queue),
        metrics=ServerMetrics(engine, card.name),
        api_key=config.api_key or None,
        max_body_bytes=config.max_body_bytes,
    )
    stats = StatsLogger(engine, config.stats_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(stats.run())
        logger.info("serving %s (max_model_len %d, max_num_seqs %d, max_queue %d)",
                    card.name, card.max_model_len, llm.config.max_num_seqs, max_queue)
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="tandem", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tandem = state
    app.include_router(openai.router)
    app.include_router(ollama.public)
    app.include_router(ollama.router)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead:
            return JSONResponse({"error": "the engine loop is not running"}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    _install_error_handlers(app, state)
    return app


def _render(request: Request, err: APIError) -> Response:
    ollama_style = request.url.path.startswith("/api/")
    body = err.ollama_body() if ollama_style else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        if err.code == "server_overloaded":
            state.metrics.rejections.inc()
        return _render(request, err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> Response:
        return _render(request, APIError(400, f"invalid request: {err.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        return _render(request, APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _render(request, APIError(500, f"internal server error ({type(err).__name__})",
                                         code="internal_error"))


# -------------------------------------------------------------------- CLI
def serve(args, engine_config) -> int:
    """Load the model, then serve until interrupted (``tandem serve``)."""
    import uvicorn

    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.stats_interval <= 0:
        raise ValueError(f"--stats-interval must be positive, got {args.stats_interval}")
    engine = AsyncEngine(engine_config)
    logger.info("model loaded in %.1f s", engine.engine.load_duration_s)
    app = build_app(engine, ServerConfig(
        served_model_names=args.served_model_name, api_key=args.api_key,
        max_queue=args.max_queue, stats_interval_s=args.stats_interval,
    ))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_config=None,
                    access_log=args.access_log, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0
