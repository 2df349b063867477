"""uvicorn's HTTP protocol with a deadline for every request's head.

uvicorn closes an idle keep-alive connection after a few seconds, but it arms
no timer on a new connection, and any byte received cancels the keep-alive
one: a client that opened connections and sent each request line and header a
byte at a time (slowloris), or nothing at all, held every connection and its
file descriptor for as long as it liked, until the server could accept no
more. Here a request's head (request line and headers) must be complete
within HEADER_READ_TIMEOUT_S of the connection opening, or of the previous
response on a keep-alive connection; otherwise the connection is closed, as
nginx's client_header_timeout (60 s by default) does. A body that stops
arriving has its own timeout (protocol.BODY_READ_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("tandem.entrypoints.server")

HEADER_READ_TIMEOUT_S = 60.0


class HeadDeadlineProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools' or h11's, whichever it picks) whose
    connections close when a request's head is overdue.

    Both of uvicorn's protocols start a request cycle (``self.cycle``) once a head
    is parsed and call ``on_response_complete`` when its response is sent: the
    deadline is armed at the connection's start and after each response, and
    closes the connection only if the cycle it saw is still the latest and
    answered (no head completed since). One timer a connection, re-armed in place.
    """

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(HEADER_READ_TIMEOUT_S, self._head_overdue,
                                                self.cycle)

    def _head_overdue(self, cycle: Any) -> None:
        waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if waiting and not self.transport.is_closing():
            logger.debug("closed a connection whose request head took over %.0f s",
                         HEADER_READ_TIMEOUT_S)
            self.transport.close()
