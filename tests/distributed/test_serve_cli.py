"""Replicas and P/D through `tandem serve` as a user starts them: a subprocess with
the CLI's defaults (it starts its own local Ray, from the thread that loads the
model), requests through the openai SDK, greedy text equal to one engine's on
the fp32 path, and a replica killed and restarted under the server."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.entrypoints.llm import LLM
from tandem.sampling_params import SamplingParams
from tests.serving import serve_cli

pytestmark = pytest.mark.ray
pytest.importorskip("ray", reason="the ray tests need Ray: pip install 'tandem[ray]'")

FP32 = ["--quantization", "none", "--kv-cache-dtype", "fp32"]
PROMPTS = [
    "Hello there",  # under one block: the decode replica recomputes all of it
    "Once upon a time, in a kingdom by the sea, there lived a princess who " * 12,
]
MAX_TOKENS = 12


class Served:
    def __init__(self, flags: list[str]) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        self.proc, self.url = serve_cli(flags, timeout=300, output=self.log)

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.output()

    def completions(self) -> list[str]:
        from openai import OpenAI

        client = OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=120, max_retries=0)
        return [client.completions.create(
            model="smollm2", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]


def _serve(flags: list[str]) -> Iterator[Served]:
    s = Served(flags)
    yield s
    out = s.stop()
    assert s.proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """One engine in this process on the same fp32 path."""
    llm = LLM(quantization="none", kv_cache_dtype="fp32", kv_cache_memory="64MiB",
              num_threads=1)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def pd() -> Iterator[Served]:
    yield from _serve(["--prefill-replicas", "1", "--decode-replicas", "1", *FP32])


def test_pd_through_the_cli_answers_with_one_engines_text(pd, expected):
    """Failed on every request before: the raylet, started from the loader thread,
    was killed when that thread ended, and the prefill replica with it."""
    assert pd.completions() == expected
    from openai import OpenAI

    client = OpenAI(base_url=f"{pd.url}/v1", api_key="none", timeout=120, max_retries=0)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    metrics = httpx.get(f"{pd.url}/metrics", timeout=10).text
    transferred = [line for line in metrics.splitlines()
                   if line.startswith("tandem:kv_transfer_bytes_total")]
    assert transferred and float(transferred[0].rsplit(" ", 1)[1]) > 0, transferred


def test_a_killed_replica_is_logged_with_its_reason_and_restarted(pd, expected):
    victim = _replica_pids(pd.proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    _wait_health(pd.url, 503, timeout=30)  # not every replica answers
    _wait_health(pd.url, 200, timeout=180)  # Ray restarted it (--max-restarts 3)
    log = pd.output()
    assert "replica prefill-0 is down" in log or "replica decode-0 is down" in log, log[-3000:]
    assert "was restarted: routing to it again" in log, log[-3000:]
    # Ray's own reason beside it (its raylet's line, forwarded to the server's log)
    assert f"Worker PID: {victim} Worker exit type: SYSTEM_ERROR" in log, log[-3000:]
    assert pd.completions() == expected


def test_replicas_through_the_cli_answer_with_one_engines_text(expected):
    for served in _serve(["--replicas", "2", *FP32]):
        assert served.completions() == expected
        assert served.completions() == expected  # again: the prefix-cache hit path


def _replica_pids(root: int) -> list[int]:
    """The replica actors' processes under the server process ``root`` (its raylet's
    workers), by their Ray process title."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == root:
                return True
        return False

    pids = []
    for pid in parent:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::EngineReplica") and under(pid):
            pids.append(pid)
    assert pids, "no replica process found under the server"
    return sorted(pids)


def _wait_health(url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == status:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"/health never said {status}"
        time.sleep(0.1)
