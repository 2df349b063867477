"""Run an ASGI app for a test: uvicorn in a thread on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn

from tandem.entrypoints.server.app import uvicorn_config


def serve_app(app, start_timeout: float = 30.0) -> tuple[str, Callable[[], None]]:
    """Start app on 127.0.0.1; returns (url, stop)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


@contextmanager
def app_servers(make_app: Callable) -> Iterator[Callable[..., str]]:
    """start(*args) -> url of a new server running make_app(*args); all stopped on exit."""
    stops: list[Callable[[], None]] = []

    def start(*args) -> str:
        url, stop = serve_app(make_app(*args))
        stops.append(stop)
        return url

    try:
        yield start
    finally:
        for stop in stops:
            stop()
