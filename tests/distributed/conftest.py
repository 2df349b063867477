"""A local Ray instance for the ``ray`` tests (2 CPUs: two 1-CPU replicas)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import pytest

from tandem.config import EngineConfig
from tandem.entrypoints.server.app import ServerConfig, build_app
from tests.serving import serve_app


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the ray tests need Ray: pip install 'tandem[ray]'")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def replica_config(**kw) -> EngineConfig:
    """Small pools and 32-token chunks: replicas start fast and long prompts are chunked."""
    return EngineConfig(**{"kv_cache_memory": "64MiB", "max_num_batched_tokens": 32, **kw})


class Cluster:
    """A RayEngineClient behind a real server; /metrics read per replica."""

    def __init__(self, client) -> None:
        self.client = client
        self.app = build_app(client, ServerConfig(max_queue=8))
        self.url, self._stop = serve_app(self.app)

    def close(self) -> None:
        self._stop()
        self.client.shutdown()

    def metrics(self, name: str) -> dict[str, float]:
        """replica name -> the value of ``name`` on it (the per-replica samples)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "{") and 'replica="' in line:
                replica = line.split('replica="', 1)[1].split('"', 1)[0]
                out[replica] = float(line.rsplit(" ", 1)[1])
        return out

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        """Poll check() until it holds (replica stats reach /metrics every 0.25 s)."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not reached in {timeout:g} s")
            time.sleep(0.1)

    def settled(self, name: str) -> dict[str, float]:
        """``metrics(name)`` once two reads a poll period apart agree: replica stats
        reach /metrics up to 0.25 s late, so an earlier request's count may still
        be on its way (it made the wrong replica look like this request's)."""
        last = self.metrics(name)
        while True:
            time.sleep(0.3)
            now = self.metrics(name)
            if now == last:
                return now
            last = now

    def served_by(self, send: Callable[[], dict]) -> tuple[str, dict]:
        """(the replica that prefilled the request ``send`` makes, its response)."""
        before = self.settled("vllm:prompt_tokens_total")
        body = send()
        changed: list[str] = []

        def moved() -> bool:
            now = self.metrics("vllm:prompt_tokens_total")
            changed[:] = [r for r in now if now[r] != before.get(r, 0.0)]
            return bool(changed)

        self.wait_for(moved, "a replica's prompt tokens counted", timeout=30)
        assert len(changed) == 1, changed
        return changed[0], body

    def chat(self, system: str, user: str, max_tokens: int = 8, **extra) -> dict:
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()
