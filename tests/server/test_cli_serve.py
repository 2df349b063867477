"""`tandem serve` as a user runs it: a subprocess that loads, listens, serves and exits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tandem.entrypoints.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess_end_to_end(tiny_config_path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--model", tiny_config_path,
         "--load-format", "dummy", "--kv-cache-memory", "1MiB", "--max-model-len", "128",
         "--port", str(port), "--served-model-name", "tiny", "tiny-alias", "--max-queue", "3",
         "--no-access-log", "--skip-tokenizer-init"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TANDEM_API_KEY": ""},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tandem serve did not come up"
            time.sleep(0.2)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-alias"]
        r = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny-alias", "prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "max_queue 3" in out and "finished (length)" in out  # startup and per-request logs


def test_serve_rejects_bad_flags_before_loading(capsys):
    for flags, words in ((["--max-queue", "-1"], "--max-queue must be >= 0"),
                         (["--generation-config", "greedy"], "--generation-config must be"),
                         (["--override-generation-config", '{"top_p": 2}'], "top_p must be"),
                         (["--threads", "0"], "--threads must be >= 1")):
        assert main(["serve", *flags]) == 2
        assert words in capsys.readouterr().err
