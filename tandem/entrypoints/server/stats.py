"""The periodic stats line, like vLLM's, so a log alone shows load and saturation.

    Avg prompt throughput: 231.0 tokens/s, Avg generation throughput: 88.4 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 40.0%

Idle intervals are logged at DEBUG only, so an idle server's log stays quiet.
The prompt throughput is prompt tokens computed (chunk by chunk, not those found
in the prefix cache): a prompt counted only when its prefill completes left the
line at 0.0 for the whole of a long prefill, the time the line matters most.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tandem.engine.client import EngineClient

logger = logging.getLogger("tandem.entrypoints.server")


class StatsLogger:
    def __init__(self, engine: EngineClient, interval_s: float) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._last = self._snapshot()

    def _snapshot(self) -> tuple[float, int, int, int, int]:
        s = self.engine.stats()
        return (time.monotonic(), s.prefill_tokens_total, s.generation_tokens_total,
                s.prefix_cache_queries, s.prefix_cache_hits)

    def line(self) -> tuple[str, bool]:
        """The line for the interval since the last call, and whether anything happened."""
        now = self._snapshot()
        t0, p0, g0, q0, h0 = self._last
        t1, p1, g1, q1, h1 = now
        self._last = now
        dt = max(t1 - t0, 1e-9)
        s = self.engine.stats()
        running, waiting = s.num_running, s.num_waiting + s.num_pending
        hit = 100.0 * (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        text = (
            f"Avg prompt throughput: {(p1 - p0) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(g1 - g0) / dt:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit:.1f}%, Preemptions: {s.num_preemptions}"
        )
        if s.num_threads is not None:
            text += f", CPU threads: {s.num_threads}"
        return text, bool(p1 - p0 or g1 - g0 or running or waiting)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            text, busy = self.line()
            logger.log(logging.INFO if busy else logging.DEBUG, "%s", text)
