"""The server listens while the model loads: 503 "Loading model" until it is ready
(Ollama's routes wait for the load instead, as Ollama answers a first request).

Loaders here block on a threading.Event (a multi-GB model, simulated) and then
build the tiny model; a failing loader stands for a bad --model.
"""

from __future__ import annotations

import concurrent.futures
import gc
import socket
import threading
import time

import httpx
import pytest

from tandem.entrypoints.cli import main
from tandem.entrypoints.server.app import ServerConfig, build_app
from tandem.entrypoints.server.run import run_server
from tests.server.conftest import tiny_engine
from tests.serving import free_port, serve_app

LOADING_OPENAI = {"error": {"message": "Loading model", "type": "unavailable_error",
                            "param": None, "code": 503}}


def _wait_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _unfreeze_heap():
    """A loaded server freezes its process's start-up heap; in a test process, undo it."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.fixture
def gated_server(tiny_config_path):
    """A server whose loader waits for ``release``, then builds the tiny model."""
    release = threading.Event()
    loaded: list = []

    def load():
        assert release.wait(timeout=60), "the test never released the loader"
        loaded.append(tiny_engine(tiny_config_path))
        return loaded[0]

    url, stop = serve_app(build_app(load, ServerConfig(served_model_names=["tiny"])))
    yield url, release
    release.set()
    stop()
    for engine in loaded:
        engine.shutdown()


def test_routes_answer_503_while_loading_then_serve(gated_server):
    url, release = gated_server
    r = httpx.get(f"{url}/health")
    assert r.status_code == 503 and r.json() == LOADING_OPENAI
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat)
    assert r.status_code == 503 and r.json() == LOADING_OPENAI
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 503, path
    # These need no model; clients probe them to see whether a server is there.
    assert httpx.get(f"{url}/version").status_code == 200
    assert httpx.get(f"{url}/api/version").status_code == 200
    assert httpx.get(f"{url}/").text == "Ollama is running"
    # Ollama's routes wait for the model, then answer (the chat: the next test).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(httpx.get, f"{url}/api/tags", timeout=60),
                   pool.submit(httpx.post, f"{url}/api/show", json={"model": "tiny"},
                               timeout=60)]
        time.sleep(0.5)
        assert not any(f.done() for f in waiting)
        assert gc.get_freeze_count() == 0
        release.set()
        tags, show = (f.result() for f in waiting)
    assert [m["name"] for m in tags.json()["models"]] == ["tiny:latest"]
    assert show.status_code == 200 and show.json()["details"], show.text
    _wait_healthy(url)
    # Ready means start-up's heap is frozen out of the collector's full passes.
    assert gc.get_freeze_count() > 0
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert [m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]] == ["tiny:latest"]
    assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics").text


def test_chat_on_both_apis_once_the_default_model_is_in(real_server):
    """Text requests through a gated app, on the session's default model."""
    release = threading.Event()

    def load():
        assert release.wait(timeout=60)
        return real_server.engine  # loaded once per session; the wait is the "load"

    url, stop = serve_app(build_app(load, ServerConfig(served_model_names=["smollm2"])))
    try:
        messages = [{"role": "user", "content": "Say hi"}]
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "smollm2",
                                                             "messages": messages})
        assert r.status_code == 503 and r.json() == LOADING_OPENAI
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{url}/api/chat", timeout=60, json={
                "model": "smollm2", "messages": messages, "stream": False,
                "options": {"num_predict": 3}})
            time.sleep(0.5)
            assert not waiting.done()
            release.set()
            r = waiting.result()
        assert r.status_code == 200 and r.json()["eval_count"] == 3, r.text
        _wait_healthy(url)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": messages, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        release.set()
        stop()  # the engine is real_server's: it shuts it down


def test_a_failed_load_is_reported_on_every_route():
    def load():
        raise ValueError("no such model")

    app = build_app(load)
    url, stop = serve_app(app)
    try:
        deadline = time.monotonic() + 10
        while app.state.load_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "The model failed to load"
        r = httpx.post(f"{url}/api/generate", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json() == {"error": "the model failed to load"}
    finally:
        stop()


def test_run_server_stops_and_reraises_a_failed_load():
    started = threading.Event()

    def load():
        started.set()
        time.sleep(0.2)  # the server is listening by now
        raise ValueError("model path 'x' does not exist")

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="does not exist"):
        run_server(load, ServerConfig(), "127.0.0.1", free_port(), access_log=False)
    assert started.is_set() and time.monotonic() - t0 < 15


def test_serve_with_a_bad_model_exits_2_with_the_message(capsys):
    rc = main(["serve", "--model", "/nonexistent/model.gguf", "--port", str(free_port()),
               "--no-access-log"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "tandem serve: error: model path '/nonexistent/model.gguf' does not exist" in err
    assert "Traceback" not in err


def test_a_host_name_is_listened_on_at_every_address(monkeypatch):
    """``--host localhost`` where it names 127.0.0.1 and ::1: both are bound (bound to
    the first only, clients of the other were refused)."""
    from tandem.entrypoints.server import run as server_run

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port()
    both = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
    monkeypatch.setattr(server_run.socket, "getaddrinfo", lambda *a, **k: both)
    socks = server_run._listen("localhost", port)
    try:
        assert sorted(s.getsockname()[0] for s in socks) == ["127.0.0.1", "::1"]
    finally:
        for s in socks:
            s.close()
