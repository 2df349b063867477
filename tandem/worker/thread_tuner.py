"""ThreadTuner: the engine's CPU thread count, adapted while other processes take CPUs.

Every parallel op of a step (one OpenMP team per matmul, attention, norm) ends
in a barrier. When another process runs on one of the team's cores, the thread
there is descheduled for a time slice at a time, and every barrier waits for
it: beside a CPU-bound neighbour a decode step takes many times as long with
libgomp's default spinning (a spinning thread has used up its share when the
work arrives). Fewer threads than cores then run faster than all of them.

No static choice is right for both a quiet and a shared machine, so the engine
thread measures. The kernel says how long this process's threads waited,
runnable, for a CPU (/proc/self/task/*/schedstat): a small share of the CPU
time they got on a quiet machine, most of it beside a neighbour. Only
when that wait is high does the tuner try fewer threads, so a quiet machine
pays nothing; below the maximum it tries more now and then, to climb back.
A try runs a few steps at the other count, alternating with the current one so
both see the same batch, and moves when the other is clearly faster; it ends
early when the other is plainly no better. A try that does not move makes the
next one wait twice as long (up to a minute), so a settled engine spends few
steps on the worse setting and a neighbour that leaves is noticed within one.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


def cpu_times() -> tuple[float, float] | None:
    """(seconds run, seconds waiting runnable for a CPU), summed over this process's
    threads since they started; None where the kernel does not say."""
    run = wait = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except OSError:  # the thread has exited
            continue
        run += int(fields[0])
        wait += int(fields[1])
    return (run / 1e9, wait / 1e9) if run else None


class ThreadTuner:
    """Wraps each engine step: ``tuner.step(engine.step)`` in the engine thread."""

    PAIRS = 4  # steps at each of the two counts per try
    MARGIN = 0.9  # move only if the other count's median step is 10% faster
    GIVE_UP = 1.3  # a step this much slower at the other count ends the try at once
    CONTENDED = 0.25  # seconds waiting for a CPU per second run: try fewer threads
    MIN_INTERVAL_S = 2.0
    MAX_INTERVAL_S = 60.0

    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 clock: Callable[[], float] = time.perf_counter,
                 times: Callable[[], tuple[float, float] | None] = cpu_times) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._set = set_threads
        self._clock = clock
        self._times = times
        self._last_times = times()
        self._interval = self.MIN_INTERVAL_S
        self._next_check: float | None = None  # set by the first busy step
        self._up = False  # without a wait signal: the direction of the next try
        self._probe: tuple[int, list[float], list[float]] | None = None  # (other, here, there)

    def step(self, run: Callable[[], T]) -> T:
        """run() (one engine step), timed; between steps, the thread count may change.

        Steps that did nothing (run() returned an empty list) are not measured.
        """
        if self.max_threads < 2:
            return run()
        probe = self._probe
        other_turn = probe is not None and len(probe[2]) < len(probe[1])
        if other_turn:
            self._set(probe[0])
        t0 = self._clock()
        try:
            out = run()
        finally:
            if other_turn:
                self._set(self.threads)
        elapsed = self._clock() - t0
        if out:
            self._observe(elapsed, other_turn, t0)
        return out

    def _observe(self, elapsed: float, other_turn: bool, now: float) -> None:
        if self._probe is None:
            if self._next_check is None:
                self._next_check = now + self._interval
            elif now >= self._next_check:
                other = self._candidate()
                if other is None:
                    self._next_check = now + self._interval
                else:
                    self._probe = (other, [elapsed], [])
            return
        other, here, there = self._probe
        (there if other_turn else here).append(elapsed)
        if not there or len(here) > len(there):
            return
        fast, slow = statistics.median(there), statistics.median(here)
        # Done after PAIRS pairs, or as soon as the other count is plainly no better.
        worse = elapsed > self.GIVE_UP * slow or (len(there) >= 2 and fast >= slow)
        if len(there) < self.PAIRS and not worse:
            return
        self._probe = None
        if not worse and fast < self.MARGIN * slow:
            logger.info("CPU threads %d -> %d: a step took %.1f ms, %.1f ms with %d (other "
                        "processes may be using CPUs)", self.threads, other, slow * 1e3,
                        fast * 1e3, other)
            self.threads = other
            self._set(other)
            self._interval = self.MIN_INTERVAL_S
        else:
            self._interval = min(2 * self._interval, self.MAX_INTERVAL_S)
        self._next_check = now + self._interval

    def _candidate(self) -> int | None:
        """The count to try now: fewer while threads wait for CPUs, else more if below
        the maximum; None: nothing worth a try."""
        down = self.threads - 1 if self.threads > 1 else None
        up = self.threads + 1 if self.threads < self.max_threads else None
        waited = self._waited()
        if waited is None:  # no signal: alternately fewer and more
            self._up = not self._up
            return (up if self._up else down) or up or down
        return down if waited > self.CONTENDED else up

    def _waited(self) -> float | None:
        """Seconds this process's threads waited for a CPU per second they ran, since
        the last call; None if unknown."""
        now, last = self._times(), self._last_times
        self._last_times = now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return max(0.0, now[1] - last[1]) / (now[0] - last[0])
