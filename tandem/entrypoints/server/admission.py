"""The bounded waiting queue in front of the engine (like OLLAMA_MAX_QUEUE).

A request that cannot start waits; past ``max_queue`` waiting requests the
server answers 503 with Retry-After at once. An immediate, retryable error
beats a spinner: a client (or a load balancer) can back off or go elsewhere,
while a deep queue only turns into time-to-first-token nobody sees the cause
of.

"Waiting" is counted in the event loop, synchronously with acceptance, so a
burst cannot slip past the bound between two engine steps:

    waiting = in_flight - capacity

``in_flight`` is every engine request this server has accepted and not seen
finish. ``capacity`` is ``max_num_seqs``, except when the KV pool could not
take the engine's waiting requests while fewer than ``max_num_seqs`` run: then
the pool is the limit and the capacity is what runs now. Requests the engine
holds back only for the step's token budget (long prompts prefill a chunk a
step) have their slots: counting them as queued turned clients away with 4 of
8 slots and queue places in use.
"""

from __future__ import annotations

import math

from tandem.engine.client import EngineClient
from tandem.entrypoints.server.errors import APIError

OLLAMA_BUSY = "server busy, please try again.  maximum pending requests exceeded"


class Admission:
    def __init__(self, engine: EngineClient, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_num_seqs = engine.model_info.max_num_seqs
        self.in_flight = 0
        self.rejected = 0
        self._e2e_ewma = 0.0  # seconds, for Retry-After

    @property
    def capacity(self) -> int:
        stats = self.engine.stats()
        if stats.num_waiting_for_kv > 0 and stats.num_running < self.max_num_seqs:
            return stats.num_running
        return self.max_num_seqs

    @property
    def waiting(self) -> int:
        return max(0, self.in_flight - self.capacity)

    def acquire(self, n: int) -> None:
        """Accept ``n`` engine requests (one API request) or raise a 503 at once.

        An idle server accepts any request, so n > capacity + max_queue still runs.
        """
        if self.in_flight and self.in_flight + n - self.capacity > self.max_queue:
            self.rejected += 1
            raise APIError(
                503,
                f"server overloaded: {self.waiting} requests are already waiting "
                f"(--max-queue {self.max_queue}); retry after {self.retry_after_s} s",
                code="server_overloaded",
                headers={"Retry-After": str(self.retry_after_s)},
                ollama_message=OLLAMA_BUSY,
            )
        self.in_flight += n

    def release(self, n: int = 1) -> None:
        self.in_flight = max(0, self.in_flight - n)

    def observe_latency(self, e2e_s: float) -> None:
        self._e2e_ewma = e2e_s if self._e2e_ewma == 0 else 0.8 * self._e2e_ewma + 0.2 * e2e_s

    @property
    def retry_after_s(self) -> int:
        """About when a slot frees: a reply's length spread over the running requests."""
        running = max(1, min(self.in_flight, self.max_num_seqs))
        return int(min(60, max(1, math.ceil(self._e2e_ewma / running))))
