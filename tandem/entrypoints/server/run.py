"""Running the server: ``tandem serve``'s checks, its sockets, uvicorn, the drain.

``run_server`` listens before the model loads (a port in use says so at once),
serves the app ``build_app`` makes over the loader, and on an exit signal gives
the requests in flight time to end in their API's error, not a cut connection.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp

from tandem.engine.client import EngineClient
from tandem.entrypoints.server import dashboard, defaults
from tandem.entrypoints.server.app import Loader, ServerConfig, build_app
from tandem.entrypoints.server.state import ServerState

logger = logging.getLogger("tandem.entrypoints.server")

# On an exit signal requests in flight get DRAIN_S to finish; the rest end in an
# error before uvicorn cancels their handlers, GRACEFUL_SHUTDOWN_S after it.
DRAIN_S = 3.0
GRACEFUL_SHUTDOWN_S = 5


def serve(args, load: Loader) -> int:
    """``tandem serve``: check the flags, then run_server with the model's loader."""
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not 0 < args.stats_interval < math.inf:  # nan too: it logged every ~0.1 s
        raise ValueError(f"--stats-interval must be a positive number of seconds, got "
                         f"{args.stats_interval}")
    # An empty key would leave the APIs open ("--api-key $KEY" with KEY unset).
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key (or $TANDEM_API_KEY) is empty: give a key, or leave both "
                         "out for no key")
    for origin in args.allowed_origins or ():
        parts = urlsplit(origin)
        if origin != "*" and not (parts.scheme and parts.netloc and not parts.path
                                  and not parts.query and not parts.fragment):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin (what a browser "
                             "sends: scheme://host[:port], no path), e.g. "
                             "http://192.168.1.20:3000")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise ValueError("--served-model-name: a name must not be empty")
    dashboard_config = dashboard.config_from_args(args)
    generation_config = defaults.check_mode(args.generation_config)
    override = defaults.parse_override(args.override_generation_config)

    def logged_load() -> EngineClient:
        engine = load()
        logger.info("model loaded in %.1f s", engine.model_info.load_duration_s)
        return engine

    return run_server(logged_load, ServerConfig(
        served_model_names=args.served_model_name, api_key=args.api_key,
        allowed_origins=args.allowed_origins, max_queue=args.max_queue,
        stats_interval_s=args.stats_interval,
        generation_config=generation_config, override_generation_config=override,
        reasoning_parser=args.reasoning_parser, dashboard=dashboard_config,
    ), host=args.host, port=args.port, access_log=args.access_log)


def _listen(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, bound: one for each address ``host`` names (``localhost``
    is 127.0.0.1 and ::1 where /etc/hosts says both; bound to the first only, clients
    of the other got "connection refused"), as uvicorn's own --host binds them. An
    address that is taken or not this machine's is a ValueError (one CLI line)
    before a model loads, not uvicorn's log line after it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    socks: list[socket.socket] = []
    # each address once, in order (getaddrinfo may list one per protocol)
    for family, kind, proto, addr in dict.fromkeys((f, k, p, a) for f, k, p, _, a in infos):
        sock = socket.socket(family, kind, proto)
        socks.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # beside an IPv4 socket on the same port
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            for s in socks:
                s.close()
            raise ValueError(f"cannot listen on {host} port {port}: {e.strerror}") from None
    return socks


def _drain(state: ServerState) -> None:
    """On shutdown: give the requests in flight DRAIN_S to finish, then shut the
    engine down, so each one still running ends in its API's error (an SSE
    error event and [DONE], or a 503 in shape) before uvicorn's graceful
    timeout cancels its handler. Cancelled, a stream was cut without either
    and every handler logged a traceback. In flight is what the server
    accepted (a request still being tokenized included) and what the engine
    holds."""
    engine = state.engine
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        s = engine.stats()
        if not (state.admission.in_flight or s.num_running or s.num_waiting or s.num_pending):
            break
        time.sleep(0.05)
    else:
        logger.warning("shutting down: requests still running after %.0f s end with an error",
                       DRAIN_S)
    engine.shutdown()


def uvicorn_config(app: ASGIApp, **kwargs: Any) -> Any:
    """uvicorn's Config for tandem's app (``tandem serve`` and the tests' servers):
    its HTTP protocol with a deadline for request heads, tandem's own logging."""
    import uvicorn

    from tandem.entrypoints.server.http_protocol import HeadDeadlineProtocol

    return uvicorn.Config(app, http=HeadDeadlineProtocol, log_config=None, **kwargs)


def run_server(load: Loader, config: ServerConfig, host: str, port: int,
               access_log: bool = True) -> int:
    """Listen at once, load in the background, serve until interrupted; 0 when stopped.

    A failed load stops the server and its exception is re-raised here, in the
    caller's thread, so ``tandem serve`` fails as it did when it loaded before
    listening: the CLI prints a ValueError's message (no traceback) and exits 2;
    anything else is a traceback.
    """
    import uvicorn

    socks = _listen(host, port)  # before the load: a port in use says so at once
    failure: list[BaseException] = []

    def load_or_stop() -> EngineClient:
        try:
            return load()
        except BaseException as e:
            failure.append(e)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            logger.error("the model failed to load (%s): shutting down", reason)
            server.should_exit = True
            raise

    app = build_app(load_or_stop, config)

    drains: list[threading.Thread] = []

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            """The drain starts beside uvicorn's own wait for connections to close
            (on the event loop, not in the signal handler)."""
            if app.state.tandem is not None:
                drains.append(threading.Thread(target=_drain, args=(app.state.tandem,),
                                               name="tandem-drain", daemon=True))
                drains[-1].start()
            await app.state.dashboard.close()
            await super().shutdown(sockets)

    server = Server(uvicorn_config(app, host=host, port=port, access_log=access_log,
                                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    logger.info("listening on http://%s:%d; loading the model: until it is ready, OpenAI "
                "requests get 503 \"Loading model\" and Ollama's wait",
                host if ":" not in host else f"[{host}]", port)
    interrupted = False
    try:
        server.run(sockets=socks)
    except KeyboardInterrupt:  # uvicorn re-raises a caught SIGINT once it has shut down
        interrupted = True
    finally:
        for drain in drains:  # it shuts the engine down: once, and not beside this
            drain.join(timeout=DRAIN_S + GRACEFUL_SHUTDOWN_S)
        if app.state.tandem is not None and not app.state.tandem.engine.dead:
            app.state.tandem.engine.shutdown()
    if failure:
        raise failure[0]
    if app.state.tandem is None and app.state.load_error is None:
        # Stopped while the model loads. The loader thread cannot be stopped, and
        # the interpreter's exit beside it, inside torch's threads, aborted the
        # process ("terminate called without an active exception", SIGABRT).
        logger.info("stopped while the model was loading")
        logging.shutdown()
        os._exit(130 if interrupted else 0)
    return 0 if server.started else 1
