"""When requests are sent: the arrival schedule, the concurrency cap, the progress bar.

Arrivals follow vLLM: at ``--request-rate`` r with ``--burstiness`` b the gaps
are Gamma(shape=b, scale=1/(r*b)) — mean 1/r, coefficient of variation
1/sqrt(b); b = 1 is a Poisson process, b < 1 burstier, b > 1 more even —
and the cumulative times are rescaled so the last one lands exactly at
n / r (vLLM does this so that throughput does not wobble with the seed).
``inf`` sends everything at t = 0.

``--max-concurrency`` is a semaphore around the request itself: the
schedule still says when a request *arrives*; one that finds every slot busy
waits in the client (its wait is ``client_queue_time``, not part of TTFT),
like users behind a gateway that allows only so many at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np

from tandem.tools.bench.client import RequestFunc, RequestInput, RequestResult, send


def check_load(request_rate: float = math.inf, burstiness: float = 1.0,
               max_concurrency: int | None = None) -> None:
    """ValueError unless the load's settings are positive (inf allowed for the first two):
    checked before a run prints anything, and by each function that takes them."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be positive, got {max_concurrency}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")


def arrival_times(n: int, request_rate: float, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests is sent."""
    check_load(request_rate, burstiness)
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times


@dataclass
class RunOutput:
    results: list[RequestResult]
    duration: float  # seconds from the first scheduled send to the last response
    start: float  # perf_counter at the start of the schedule


def _progress(total: int, desc: str, disable: bool):
    if disable or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)


async def run_requests(client: httpx.AsyncClient, func: RequestFunc,
                       inputs: list[RequestInput], times: np.ndarray,
                       max_concurrency: int | None, timeout: float | None,
                       desc: str = "requests", disable_progress: bool = False) -> RunOutput:
    """Send ``inputs[i]`` at ``times[i]``, at most ``max_concurrency`` in flight."""
    check_load(max_concurrency=max_concurrency)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _progress(len(inputs), desc, disable_progress)

    async def one(inp: RequestInput, arrived: float) -> RequestResult:
        async with slots or contextlib.nullcontext():
            out = await send(func, client, inp, timeout)
        out.client_queue_time = max(0.0, out.start_time - arrived)
        if bar is not None:
            bar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for inp, at in zip(inputs, times):
        delay = start + float(at) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(inp, time.perf_counter())))
    try:
        results = list(await asyncio.gather(*tasks))
    finally:
        if bar is not None:
            bar.close()
    return RunOutput(results, time.perf_counter() - start, start)


def make_client(max_concurrency: int | None, headers: dict[str, str]) -> httpx.AsyncClient:
    """A pool with no connection cap of its own: only ``--max-concurrency`` limits requests.

    (httpx's default pool of 100 connections would otherwise queue requests in
    the client, invisibly, and count that wait as the server's TTFT.)
    """
    limits = httpx.Limits(max_connections=max_concurrency,
                          max_keepalive_connections=max_concurrency or 256)
    timeout = httpx.Timeout(None, connect=30.0)
    return httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers)
