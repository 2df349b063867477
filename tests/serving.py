"""Servers for tests: an ASGI app in a thread (uvicorn), or ``tandem serve`` as a
user starts it (a subprocess), each on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

import httpx
import uvicorn

from tandem.entrypoints.server.run import uvicorn_config


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cli(flags: list[str], timeout: float, output: IO | int = subprocess.PIPE
              ) -> tuple[subprocess.Popen, str]:
    """`tandem serve` with ``flags`` on a free port, once its /health answers 200.
    ``output`` takes its stdout and stderr: a file for a chatty server (Ray's
    workers log through it), so a full pipe never blocks it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--port", str(port), *flags],
        stdout=output, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TANDEM_API_KEY": ""},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tandem serve did not come up"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        raise
