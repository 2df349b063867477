"""Real servers for the HTTP tests: uvicorn in a thread on 127.0.0.1, a free port each.

``real_server`` serves the default model (SmolLM2-135M, loaded once per
session) for the SDK tests; ``start_server`` builds a server on any engine
(the tiny random model for load, overload and disconnect tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from tandem.config import EngineConfig
from tandem.engine.async_engine import AsyncEngine
from tandem.entrypoints.server.app import ServerConfig, build_app
from tests.serving import serve_app

API_KEY = "test-key"


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    model: str
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metric(self, name: str) -> float:
        """One sample of /metrics (the unlabelled-by-reason series of ``name``)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@pytest.fixture(scope="session")
def start_server():
    """start_server(engine, ServerConfig) -> RunningServer; all stopped at session end."""
    running: list[tuple[Callable[[], None], AsyncEngine]] = []

    def start(engine: AsyncEngine, config: ServerConfig | None = None) -> RunningServer:
        app = build_app(engine, config or ServerConfig())
        url, stop = serve_app(app)
        running.append((stop, engine))
        state = app.state.tandem
        return RunningServer(url, engine, state.card.name, state.api_key)

    yield start
    for stop, engine in running:
        stop()
        engine.shutdown()


@pytest.fixture(scope="session")
def real_server(start_server) -> Iterator[RunningServer]:
    """The default model behind an API key (every SDK test sends it; 401 tests omit it)."""
    engine = AsyncEngine(EngineConfig(kv_cache_memory="256MiB", max_model_len=1024))
    yield start_server(engine, ServerConfig(api_key=API_KEY, served_model_names=["smollm2"]))


def tiny_engine(config_path: str, **kwargs) -> AsyncEngine:
    """The tiny random model (no tokenizer): token-id prompts only, steps of a few ms."""
    base = dict(model=config_path, load_format="dummy", skip_tokenizer_init=True,
                block_size=4, kv_cache_memory="2MiB", max_model_len=256)
    base.update(kwargs)
    return AsyncEngine(EngineConfig(**base))


def slow_down(engine: AsyncEngine, step_delay_s: float) -> AsyncEngine:
    """Make every engine step take at least ``step_delay_s`` (a bigger model, simulated).

    The tiny model steps in well under a millisecond when the machine is quiet
    and 50x slower when it is not; a fixed sleep in the engine thread makes
    "requests are still running while the burst arrives" true on any machine,
    without burning the CPU the HTTP side needs.
    """
    step = engine.engine.step_core

    def slow_step():
        time.sleep(step_delay_s)
        return step()

    engine.engine.step_core = slow_step
    return engine
