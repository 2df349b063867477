"""Overload and disconnect: the bounded queue answers 503 at once; gone clients free the pool."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from tandem.entrypoints.server.admission import OLLAMA_BUSY, Admission
from tandem.entrypoints.server.app import ServerConfig
from tandem.entrypoints.server.errors import APIError
from tests.server.conftest import slow_down, tiny_engine


@pytest.fixture(scope="module")
def overload_server(start_server, tiny_config_path):
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=4), 0.02)
    return start_server(engine, ServerConfig(max_queue=2))


@pytest.fixture(scope="module")
def disconnect_server(start_server, tiny_config_path):
    engine = slow_down(tiny_engine(tiny_config_path, max_num_seqs=8), 0.01)
    return start_server(engine, ServerConfig(max_queue=32))


def _completion(max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def test_burst_past_the_queue_gets_503_at_once(overload_server):
    s = overload_server
    url = f"{s.url}/v1/completions"

    async def one(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = await client.post(url, json=_completion(100))
        return r, time.monotonic() - t0

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            burst = [asyncio.create_task(one(client)) for _ in range(20)]
            # While the accepted ones run (>= 100 steps x 20 ms), 6 more cannot all fit
            # (at most 4 running + 2 waiting): an Ollama client gets Ollama's own wording.
            while sum(t.done() for t in burst) < 14:
                await asyncio.sleep(0.01)
            ollama = await asyncio.gather(*(client.post(f"{s.url}/api/generate", json={
                "model": s.model, "context": [1, 2, 3], "stream": False,
                "options": {"num_predict": 1}}) for _ in range(6)))
            return await asyncio.gather(*burst), ollama

    results, ollama = asyncio.run(main())
    accepted = [(r, t) for r, t in results if r.status_code == 200]
    rejected = [(r, t) for r, t in results if r.status_code != 200]
    # 4 running + 2 waiting at most (fewer while the engine is still admitting).
    assert 2 <= len(accepted) <= 6 and len(rejected) == 20 - len(accepted)
    for r, _ in rejected:
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert "overloaded" in r.json()["error"]["message"]
    # "At once": every rejection came back before any accepted request finished.
    assert max(t for _, t in rejected) < min(t for _, t in accepted)
    for r, _ in accepted:  # and every accepted request completed
        assert r.json()["usage"]["completion_tokens"] == 100
        assert r.json()["choices"][0]["finish_reason"] == "length"
    busy = [r for r in ollama if r.status_code != 200]
    assert busy and all(r.status_code == 503 and r.json() == {"error": OLLAMA_BUSY}
                        for r in busy)
    assert s.metric("tandem:queue_rejections_total") == len(rejected) + len(busy)


def test_cancelled_streams_free_the_engine(disconnect_server):
    s = disconnect_server
    kv = s.engine.engine.kv_manager
    idle_usage = s.metric("vllm:kv_cache_usage_perc")
    aborts_before = s.metric("tandem:request_aborts_total")

    async def main():
        client = httpx.AsyncClient(timeout=60)
        streams = []
        for _ in range(20):
            req = client.build_request("POST", f"{s.url}/v1/completions",
                                       json=_completion(200, stream=True))
            streams.append(await client.send(req, stream=True))
        # 8 run (max_num_seqs), 12 wait: read a little from the running ones.
        deadline = time.monotonic() + 30
        while s.metric("vllm:num_requests_running") < 8 or \
                s.metric("vllm:num_requests_waiting") < 12:
            assert time.monotonic() < deadline, "the 20 streams never filled the engine"
            await asyncio.sleep(0.05)
        assert s.metric("vllm:kv_cache_usage_perc") > idle_usage
        for r in streams:
            await r.aclose()  # mid-stream for 8, still queued for 12
        await client.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 20
    while s.metric("vllm:num_requests_running") or s.metric("vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "aborted requests are still in the engine"
        time.sleep(0.05)
    assert s.metric("vllm:kv_cache_usage_perc") == idle_usage
    assert kv.num_free_blocks == kv.num_blocks
    assert s.metric("tandem:request_aborts_total") - aborts_before == 20


def test_non_streaming_client_that_leaves_is_aborted(disconnect_server):
    s = disconnect_server
    aborts_before = s.metric("tandem:request_aborts_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{s.url}/v1/completions", json=_completion(200), timeout=0.5)
    deadline = time.monotonic() + 20
    while s.metric("tandem:request_aborts_total") == aborts_before or \
            s.metric("vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert s.engine.engine.kv_manager.usage == 0


def test_engine_failure_mid_stream_is_an_error_event(start_server, tiny_config_path):
    engine = tiny_engine(tiny_config_path)
    step, calls = engine.engine.step_core, []

    def failing_step():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected fault")
        return step()

    engine.engine.step_core = failing_step
    s = start_server(engine)
    with httpx.stream("POST", f"{s.url}/v1/completions", timeout=30,
                      json=_completion(50, stream=True)) as r:
        assert r.status_code == 200  # the stream had begun
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected fault" in error["message"] and error["code"] == "engine_unavailable"
    assert 1 <= len(events) - 2 < 50  # some tokens came before the failure
    # The engine keeps serving; an Ollama stream ends the same way on failure.
    calls.clear()
    with httpx.stream("POST", f"{s.url}/api/generate", timeout=30, json={
            "model": s.model, "context": [1, 2, 3],
            "options": {"num_predict": 50, "temperature": 0}}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "injected fault" in lines[-1]["error"]
    r = httpx.post(f"{s.url}/v1/completions", json=_completion(5), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


class _FakeEngine:
    """Just what Admission reads of the engine client: max_num_seqs and the
    running / waiting for the KV pool counts of stats()."""

    def __init__(self, max_num_seqs: int) -> None:
        self.model_info = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.counts = (0, 0)

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_running=self.counts[0], num_waiting_for_kv=self.counts[1])


def test_admission_bound_follows_the_engine_limit():
    eng = _FakeEngine(max_num_seqs=4)
    adm = Admission(eng, max_queue=2)
    for _ in range(6):  # 4 slots + 2 waiting
        adm.acquire(1)
    with pytest.raises(APIError) as e:
        adm.acquire(1)
    assert e.value.status == 503 and int(e.value.headers["Retry-After"]) >= 1
    adm.release(1)
    adm.acquire(1)
    # The KV pool, not max_num_seqs, is the limit: 2 run, the engine holds the rest back.
    adm.release(6)
    eng.counts = (2, 1)  # running, waiting for KV blocks
    adm.acquire(3)  # 2 running + 1 waiting
    adm.acquire(1)  # 2 waiting
    with pytest.raises(APIError):
        adm.acquire(1)
    # Requests the engine holds back for its token budget alone (long prompts, a
    # chunk a step) have their slots: 2 running, the rest of the 4 prefill soon.
    eng.counts = (2, 0)
    adm.acquire(2)  # 4 slots + 2 waiting
    with pytest.raises(APIError):
        adm.acquire(1)
    # An idle server takes any request, even one with n above every bound.
    adm.release(6)
    eng.counts = (0, 0)
    adm.acquire(10)
    assert adm.in_flight == 10
