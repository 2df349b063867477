"""Servers for the doctor tests: real tandem servers (tiny model, three configurations) and a
fake Ollama whose NUM_PARALLEL is a semaphore.

The tiny random model steps in microseconds; ``slow_down`` makes each step take 20 ms, a
small model on a slow machine, so that "the second request waits for the first" and "the
stream is still running when the long prompt arrives" hold on any machine.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tandem.entrypoints.server.app import ServerConfig
from tests.server.conftest import RunningServer, real_server, slow_down, start_server, tiny_engine
from tests.serving import app_servers

# the session fixtures (one real-model server for the whole suite), re-exported here
__all__ = ["real_server", "start_server"]

STEP_S = 0.02


@pytest.fixture(scope="session")
def healthy_server(start_server, tiny_config_path) -> RunningServer:
    """Batches of 8 and a 2 MiB pool (16,384 tokens): nothing queues, nothing preempts."""
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=8), STEP_S)
    return start_server(engine, ServerConfig(max_queue=8, served_model_names=["tiny"]))


@pytest.fixture(scope="session")
def one_seq_server(start_server, tiny_config_path) -> RunningServer:
    """--max-num-seqs 1: a second request waits for the whole first reply."""
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=1), STEP_S)
    return start_server(engine, ServerConfig(max_queue=8, served_model_names=["tiny"]))


@pytest.fixture(scope="session")
def small_pool_server(start_server, tiny_config_path) -> RunningServer:
    """A 32 KiB pool: 256 tokens of 128 B (fp16; one full-context conversation), so two
    overlap badly."""
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=8, kv_cache_memory="32KiB"),
                       STEP_S)
    return start_server(engine, ServerConfig(max_queue=8, served_model_names=["tiny"]))


# ------------------------------------------------------------------ fake Ollama
PREFILL_S_PER_TOKEN = 0.0003
TOKEN_S = 0.02
MODEL_SIZE = 2_000_000_000


def fake_ollama_app(num_parallel: int) -> Starlette:
    """Ollama's endpoints as the doctor sees them; at most ``num_parallel`` generate at once.

    Counters are measured, not invented: prompt_eval_duration is the time slept for the
    prompt, eval_duration first to last token, total_duration arrival to the end (so the
    wait for a free slot shows as total - prompt_eval - eval).
    """
    slots = asyncio.Semaphore(num_parallel)
    name = "llama3.2:latest"

    async def root(request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def version(request: Request) -> Response:
        return JSONResponse({"version": "0.6.2"})

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": [{
            "name": name, "model": name, "size": MODEL_SIZE,
            "details": {"format": "gguf", "family": "llama", "parameter_size": "3.2B",
                        "quantization_level": "Q4_K_M"}}]})

    async def ps(request: Request) -> Response:
        return JSONResponse({"models": [{"name": name, "model": name, "size": 3 * 10**9,
                                         "size_vram": 3 * 10**9, "context_length": 4096}]})

    async def models(request: Request) -> Response:  # Ollama has an OpenAI shim too
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def generate(request: Request) -> Response:
        arrival = time.monotonic()
        body = await request.json()
        n_prompt = len(body["prompt"].split())
        n_out = int(body.get("options", {}).get("num_predict", 8))

        async def lines():
            async with slots:
                t0 = time.monotonic()
                await asyncio.sleep(n_prompt * PREFILL_S_PER_TOKEN)
                t1 = time.monotonic()
                for k in range(n_out):
                    if k:
                        await asyncio.sleep(TOKEN_S)
                    if k < n_out - 1:
                        yield (json.dumps({"model": name, "response": f" w{k}",
                                           "done": False}) + "\n").encode()
                t2 = time.monotonic()
            yield (json.dumps({
                "model": name, "response": f" w{n_out - 1}", "done": True,
                "done_reason": "length", "total_duration": int((t2 - arrival) * 1e9),
                "load_duration": 0, "prompt_eval_count": n_prompt,
                "prompt_eval_duration": int((t1 - t0) * 1e9), "eval_count": n_out,
                "eval_duration": int((t2 - t1) * 1e9)}) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return Starlette(routes=[
        Route("/", root), Route("/api/version", version), Route("/api/tags", tags),
        Route("/api/ps", ps), Route("/v1/models", models),
        Route("/api/generate", generate, methods=["POST"]),
    ])


@pytest.fixture
def fake_ollama():
    """fake_ollama(num_parallel) -> url; stopped after the test."""
    with app_servers(fake_ollama_app) as start:
        yield start
