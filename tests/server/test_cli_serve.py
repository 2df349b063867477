"""`tandem serve` as a user runs it: a subprocess that loads, listens, serves and exits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tandem.entrypoints.cli import main
from tests.conftest import TINY_CONFIG
from tests.serving import free_port, serve_cli


def test_serve_subprocess_end_to_end(tiny_config_path):
    proc, url = serve_cli(
        ["--model", tiny_config_path, "--load-format", "dummy", "--kv-cache-memory", "1MiB",
         "--max-model-len", "128", "--served-model-name", "tiny", "tiny-alias",
         "--max-queue", "3", "--no-access-log", "--skip-tokenizer-init"], timeout=60)
    try:
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


def test_ctrl_c_while_the_model_loads_exits_cleanly(tmp_path):
    """SIGINT during a load of several seconds: exit 130 at once, not the SIGABRT the
    interpreter's exit beside the loader thread (inside torch) gave."""
    config = {**TINY_CONFIG, "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 2048}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--port", str(port),
         "--model", str(path), "--load-format", "dummy", "--skip-tokenizer-init",
         "--quantization", "int8", "--kv-cache-memory", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TANDEM_API_KEY": ""})
    try:
        deadline = time.monotonic() + 60
        while True:  # listening, and still loading
            assert proc.poll() is None and time.monotonic() < deadline
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 503:
                    break
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "stopped while the model was loading" in out and "terminate called" not in out


def test_serve_rejects_bad_flags_before_loading(capsys):
    for flags, words in ((["--max-queue", "-1"], "--max-queue must be >= 0"),
                         (["--generation-config", "greedy"], "--generation-config must be"),
                         (["--override-generation-config", '{"top_p": 2}'], "top_p must be"),
                         (["--threads", "0"], "--threads must be >= 1"),
                         (["--api-key", ""], "--api-key (or $TANDEM_API_KEY) is empty"),
                         (["--allowed-origins", "http://192.168.1.20:3000/"], "not an origin"),
                         (["--allowed-origins", "192.168.1.21"], "not an origin"),
                         (["--stats-interval", "nan"], "--stats-interval must be"),
                         (["--stats-interval", "inf"], "--stats-interval must be"),
                         (["--served-model-name", "a", " "], "must not be empty")):
        assert main(["serve", *flags]) == 2
        assert words in capsys.readouterr().err
    with socket.socket() as taken:  # a port in use: said at once, not after the load
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        t0 = time.monotonic()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
        assert time.monotonic() - t0 < 5
        assert "cannot listen on 127.0.0.1 port" in capsys.readouterr().err


def test_an_exit_signal_ends_running_requests_in_their_api_error(tmp_path):
    """SIGTERM with replies still generating (the default model, ~1,500 tokens
    each: longer than the drain): each stream ends with an error event and
    [DONE], a waiting non-streaming call gets a 503 in OpenAI's shape, and the
    server exits cleanly, without tracebacks, before uvicorn's graceful timeout
    would cancel the handlers (which cut the streams with neither)."""
    import json
    import threading

    proc, url = serve_cli(["--kv-cache-memory", "64MiB", "--max-model-len", "2048",
                        "--no-access-log"], timeout=120)
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 1500,
            "ignore_eos": True, "temperature": 0}
    events: list[list[str]] = [[], []]
    started = threading.Event()
    plain: list[httpx.Response] = []

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:])
                    started.set()

    def watch() -> None:  # a dashboard viewer: its feed ends with the server
        with httpx.stream("GET", f"{url}/dashboard/events", timeout=60) as r:
            for _ in r.iter_lines():
                pass

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads.append(threading.Thread(target=lambda: plain.append(httpx.post(
            f"{url}/v1/chat/completions", json=body, timeout=60))))
        threads.append(threading.Thread(target=watch))
        for t in threads:
            t.start()
        assert started.wait(60)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        exited = time.monotonic() - t0
        for t in threads:
            t.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # uvicorn re-raises the caught SIGTERM once it has shut down (systemd counts that clean).
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in out, out
    assert exited < 5, out  # within uvicorn's graceful timeout: nothing was cancelled
    assert "graceful shutdown exceeded" not in out, out
    for ev in events:
        assert ev[-1] == "[DONE]", ev[-3:]
        assert "engine" in json.loads(ev[-2])["error"]["message"], ev[-2]
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"], plain[0].text
