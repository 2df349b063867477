"""GET /dashboard: a live page over the server's own numbers; GET /dashboard/events: its feed.

One sampler per app, started by the first viewer: once a second it reads the
Prometheus registry (the histograms and counters /metrics renders) and the
engine's ``stats()`` snapshot, keeps ``HISTORY_S`` of them, and builds one
frame that every viewer receives as the same bytes. So a viewer costs a
write per second, and the engine thread nothing: the request table comes from
``EngineClient.request_states()``, which the engine thread takes between two
steps and only while someone watches. Latency quantiles are Prometheus'
``histogram_quantile`` over the window's bucket increments, the figure a
Grafana panel on /metrics shows.

Viewers of the feed are capped (429 beyond). Behind --api-key the page and the
feed take the key as ``Authorization: Bearer`` (``tandem top``) or as a
cookie that the page's login form sets: an EventSource cannot send headers,
and a key in the URL would end up in access logs and browser history. The
cookie holds an HMAC of the key, not the key, and opens only /dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import html
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import State

from tandem.diagnosis.findings import verdict
from tandem.diagnosis.live_rules import LiveFigures, diagnose_live
from tandem.engine.client import EngineStats, RequestState
from tandem.entrypoints.server.auth import require_api_key
from tandem.entrypoints.server.errors import APIError
from tandem.entrypoints.server.protocol import read_bytes
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.streaming import ClosingStreamingResponse

logger = logging.getLogger("tandem.entrypoints.server")

STATIC = Path(__file__).parent / "static"
INTERVAL_S = 1.0  # one frame a second
WINDOW_S = 60.0  # latency quantiles, preemptions, hit rate: over the last minute
HISTORY_S = 300.0  # the charts' span
MAX_ROWS = 100  # request table rows (the rest are counted)
STATES_TIMEOUT_S = 2.0  # a wedged engine thread leaves the table empty, not the feed stuck
COOKIE = "tandem_dashboard"
QUANTILES = (0.5, 0.95, 0.99)
# /metrics histograms shown as latencies: panel key -> metric name.
LATENCIES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
}
SUCCESS = "vllm:request_success"
REJECTIONS = "tandem:queue_rejections"
# A page that can reach nothing but this server.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "connect-src 'self'; img-src 'self' data:; form-action 'self'; base-uri 'none'")


@dataclass
class DashboardConfig:
    """SLO lines (seconds; None: none drawn) and the viewer cap."""

    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    max_viewers: int = 8


def config_from_args(args) -> DashboardConfig:
    """``tandem serve``'s --slo-ttft-ms, --slo-itl-ms, --dashboard-max-viewers, checked."""
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-itl-ms", args.slo_itl_ms)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a positive number of milliseconds, got {value}")
    if args.dashboard_max_viewers < 0:
        raise ValueError(f"--dashboard-max-viewers must be >= 0, got "
                         f"{args.dashboard_max_viewers}")
    return DashboardConfig(
        slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
        slo_itl_s=None if args.slo_itl_ms is None else args.slo_itl_ms / 1e3,
        max_viewers=args.dashboard_max_viewers)


@dataclass
class Sample:
    """The counters at one tick: the engine's snapshot and the registry's series."""

    t: float  # monotonic
    wall: float  # for the charts' time axis
    stats: EngineStats
    buckets: dict[str, list[float]]  # LATENCIES' metric -> cumulative bucket counts
    requests: float  # vllm:request_success_total, all reasons
    rejections: float


def histogram_quantile(q: float, bounds: list[float], counts: list[float],
                       lower: bool = False) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in;
    in the +Inf bucket, the highest finite bound. None without observations.

    ``lower``: the bucket's lower bound instead, a value the quantile is known to
    reach. The doctor's rules take that one: interpolation within vLLM's first
    queue bucket (0 to 0.3 s) puts a p95 at 0.285 s whatever the waits were.
    """
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    for i, c in enumerate(counts):
        if c >= rank:
            lo, below = (bounds[i - 1], counts[i - 1]) if i > 0 else (0.0, 0.0)
            if lower or math.isinf(bounds[i]):
                return lo
            return lo + (bounds[i] - lo) * (rank - below) / (c - below)
    return None


def read_registry(state: ServerState) -> tuple[dict[str, list[float]], dict[str, list[float]],
                                                float, float]:
    """(bounds, cumulative bucket counts) of each latency histogram, requests finished,
    queue rejections: one pass over the registry /metrics renders."""
    bounds: dict[str, list[float]] = {}
    counts: dict[str, list[float]] = {}
    requests = rejections = 0.0
    names = set(LATENCIES.values())
    for family in state.metrics.registry.collect():
        if family.name in names:
            rows = [(float(s.labels["le"]), s.value) for s in family.samples
                    if s.name.endswith("_bucket")]
            bounds[family.name] = [b for b, _ in rows]
            counts[family.name] = [c for _, c in rows]
        elif family.name == SUCCESS:
            requests = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == REJECTIONS:
            rejections = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return bounds, counts, requests, rejections


class Dashboard:
    """The sampler and its viewers (one per app)."""

    def __init__(self, app_state: State, config: DashboardConfig) -> None:
        self.app_state = app_state
        self.config = config
        self.samples: deque[Sample] = deque()
        self.points: deque[dict] = deque()  # the charts' history, one point per sample
        self.bounds: dict[str, list[float]] = {}
        self.viewers = 0
        self.frame = b""  # the latest frame, as sent
        self.ticks = 0
        self.closed = False  # the server is shutting down: feeds end
        self._tick = asyncio.Condition()
        self._task: asyncio.Task | None = None

    async def close(self) -> None:
        """End every viewer's feed (on shutdown: an open feed held the exit for
        uvicorn's whole graceful timeout, then was cancelled)."""
        async with self._tick:
            self.closed = True
            self._tick.notify_all()

    @property
    def state(self) -> ServerState:
        return self.app_state.tandem

    # ------------------------------------------------------------ sampling
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a bad tick must not end the feed for every viewer
                logger.exception("dashboard sample failed")
            await asyncio.sleep(INTERVAL_S)

    async def tick(self) -> dict:
        """Take a sample, build the frame, wake the viewers; the frame as a dict."""
        bounds, buckets, requests, rejections = read_registry(self.state)
        self.bounds = bounds
        s = Sample(time.monotonic(), time.time(), self.state.engine.stats(), buckets,
                   requests, rejections)
        states: list[RequestState] = []
        if self.viewers:
            with contextlib.suppress(asyncio.TimeoutError):
                states = await asyncio.wait_for(self.state.engine.request_states(),
                                                STATES_TIMEOUT_S)
        prev = self.samples[-1] if self.samples else s
        self.samples.append(s)
        while self.samples[0].t < s.t - HISTORY_S:
            self.samples.popleft()
        base = next(x for x in self.samples if x.t >= s.t - WINDOW_S - INTERVAL_S / 2)
        frame = self.build(s, prev, base, states)
        self.points.append(frame["point"])
        while len(self.points) > len(self.samples):
            self.points.popleft()
        async with self._tick:
            self.frame = _sse(frame)
            self.ticks += 1
            self._tick.notify_all()
        return frame

    def _latency(self, s: Sample, base: Sample) -> tuple[dict, dict]:
        """Each latency's quantiles over the window (as shown), and the lower bounds
        of their buckets (what the doctor's rules take)."""
        latency, reached = {}, {}
        for key, name in LATENCIES.items():
            now, then = s.buckets.get(name, []), base.buckets.get(name, [])
            delta = [c - (then[i] if i < len(then) else 0.0) for i, c in enumerate(now)]
            bounds = self.bounds.get(name, [])
            qs = [histogram_quantile(q, bounds, delta) for q in QUANTILES]
            latency[key] = {"p50": qs[0], "p95": qs[1], "p99": qs[2],
                            "count": int(delta[-1]) if delta else 0}
            reached[key] = [histogram_quantile(q, bounds, delta, lower=True) for q in QUANTILES]
        return latency, reached

    def build(self, s: Sample, prev: Sample, base: Sample, states: list[RequestState]) -> dict:
        """One frame: now, totals, throughput, latency, scheduler, requests, doctor."""
        st, p, b = s.stats, prev.stats, base.stats
        dt = max(s.t - prev.t, 1e-9)
        window_s = s.t - base.t
        latency, reached = self._latency(s, base)
        steps = st.num_steps - p.num_steps
        scheduled = st.scheduled_tokens_total - p.scheduled_tokens_total
        prefill = st.prefill_tokens_total - p.prefill_tokens_total
        queries = st.prefix_cache_queries - b.prefix_cache_queries
        hits = st.prefix_cache_hits - b.prefix_cache_hits
        waiting = st.num_waiting + st.num_pending
        oldest_wait = max((r.age_s for r in states if r.state in ("queued", "preempted")),
                          default=0.0)
        point = {
            "t": round(s.wall, 3),
            "prompt_tok_s": prefill / dt,  # computed chunk by chunk, as the stats line
            "generation_tok_s": (st.generation_tokens_total - p.generation_tokens_total) / dt,
            "tokens_per_step": scheduled / steps if steps else None,
            "prefill_share": prefill / scheduled if scheduled else None,
            "running": st.num_running, "waiting": waiting,
            **{f"{k}_{q}": v[q] for k, v in latency.items() if k in ("ttft", "itl")
               for q in ("p50", "p95", "p99")},
        }
        slo = {"ttft_s": self.config.slo_ttft_s, "itl_s": self.config.slo_itl_s}
        peak_running = max([q["running"] for q in self.points if q["t"] >= s.wall - window_s]
                           + [st.num_running])
        figures = LiveFigures(
            window_s=round(window_s), waiting=waiting, peak_running=peak_running,
            max_num_seqs=self.state.engine.model_info.max_num_seqs, oldest_wait_s=oldest_wait,
            kv_usage=st.kv_cache_usage, preemptions=st.num_preemptions - b.num_preemptions,
            rejections=int(s.rejections - base.rejections),
            prefill_tokens=st.prefill_tokens_total - b.prefill_tokens_total,
            queue_p95_s=reached["queue"][1], ttft_p95_s=reached["ttft"][1],
            itl_p50_s=reached["itl"][0], itl_p99_s=reached["itl"][2],
            ttft_target_s=self.config.slo_ttft_s, itl_target_s=self.config.slo_itl_s,
            quantization_level=self.state.card.quantization_level,
        )
        findings = diagnose_live(figures)
        order = {"prefill": 0, "decode": 1, "preempted": 2, "queued": 3}
        rows = sorted(states, key=lambda r: (order[r.state], -r.age_s))
        return {
            "model": self.state.card.name,
            "interval_s": INTERVAL_S,
            "window_s": window_s,
            "now": {
                "running": st.num_running, "waiting": waiting,
                "preempted": sum(r.state == "preempted" for r in states),
                "kv_blocks_used": round(st.kv_cache_usage * st.num_kv_blocks),
                "kv_blocks_total": st.num_kv_blocks, "kv_usage": st.kv_cache_usage,
                "prefix_cache_hit_rate": hits / queries if queries else None,
                "cpu_threads": st.num_threads,
            },
            "totals": {
                "prompt_tokens": st.prompt_tokens_total,
                "generation_tokens": st.generation_tokens_total,
                "requests": int(s.requests), "preemptions": st.num_preemptions,
                "rejections": int(s.rejections), "prefix_cache_queries": st.prefix_cache_queries,
                "prefix_cache_hits": st.prefix_cache_hits,
            },
            "latency": latency,
            "slo": slo,
            "scheduler": {
                "steps_per_s": steps / dt, "tokens_per_step": point["tokens_per_step"],
                "prefill_share": point["prefill_share"],
                "preemptions": figures.preemptions,
            },
            "requests": [asdict(r) for r in rows[:MAX_ROWS]],
            "requests_not_shown": max(0, len(rows) - MAX_ROWS),
            "doctor": {
                "verdict": verdict(findings),
                "findings": [{"phase": f.phase, "severity": f.severity, "title": f.title,
                              "evidence": f.evidence, "knob": f.knobs[0] if f.knobs else ""}
                             for f in findings],
            },
            "point": point,
        }

    # ------------------------------------------------------------- viewers
    async def stream(self) -> AsyncIterator[bytes]:
        """History, then every frame from the next tick on (the first with this
        viewer counted, so with the request table; a sampler just started gives
        its second, so rates cover a second and not nothing)."""
        self._start()
        seen = await self._next(self.ticks)
        if len(self.samples) < 2:
            seen = await self._next(seen)
        if self.closed:
            return
        yield _sse({"history": list(self.points)[:-1]}, event="history")
        while not self.closed:
            yield self.frame
            seen = await self._next(seen)

    async def _next(self, seen: int) -> int:
        async with self._tick:
            await self._tick.wait_for(lambda: self.ticks != seen or self.closed)
            return self.ticks


def _sse(obj: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


# ------------------------------------------------------------------ access
def _cookie_value(key: str) -> str:
    """What the cookie holds: proof of the key that opens nothing but /dashboard."""
    return hmac.new(key.encode(), b"tandem dashboard", hashlib.sha256).hexdigest()


async def _authorized(request: Request) -> bool:
    key = request.app.state.tandem.api_key
    if not key:
        return True
    if hmac.compare_digest(request.cookies.get(COOKIE, "").encode(),
                           _cookie_value(key).encode()):
        return True
    try:
        await require_api_key(request)
    except APIError:
        return False
    return True


def _login_page(message: str, status: int) -> HTMLResponse:
    body = (STATIC / "login.html").read_text().replace("{message}", html.escape(message))
    return HTMLResponse(body, status_code=status, headers={"Content-Security-Policy": CSP})


router = APIRouter()


@router.get("/dashboard")
async def page(request: Request) -> Response:
    if not await _authorized(request):
        return _login_page("This server needs its API key (--api-key).", 401)
    return HTMLResponse((STATIC / "dashboard.html").read_text(),
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"})


@router.post("/dashboard")
async def login(request: Request) -> Response:
    """The login form: the key in a POST body (never a URL), answered with the cookie."""
    key = request.app.state.tandem.api_key
    try:
        body = await read_bytes(request, 4096)  # refused unread when it says it is larger
    except APIError:
        return _login_page("The form was too large.", 413)
    given = parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0]
    if not key:
        return RedirectResponse("/dashboard", status_code=303)
    if not hmac.compare_digest(given.encode(), key.encode()):
        return _login_page("Wrong key.", 401)
    resp = RedirectResponse("/dashboard", status_code=303)
    resp.set_cookie(COOKIE, _cookie_value(key), httponly=True, samesite="strict",
                    path="/dashboard", secure=request.url.scheme == "https")
    return resp


@router.get("/dashboard/events")
async def events(request: Request) -> Response:
    if not await _authorized(request):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>', "
                       "or log in at /dashboard", code="invalid_api_key")
    dash: Dashboard = request.app.state.dashboard
    cap = dash.config.max_viewers
    if dash.viewers >= cap:
        raise APIError(429, f"{dash.viewers} dashboard viewers already watch this server "
                       f"(--dashboard-max-viewers {cap})" if cap else
                       "the dashboard feed is off (--dashboard-max-viewers 0)",
                       code="too_many_viewers", headers={"Retry-After": "10"})
    dash.viewers += 1

    def leave() -> None:
        dash.viewers -= 1

    return ClosingStreamingResponse(dash.stream(), leave, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})


def install(app: FastAPI, config: DashboardConfig) -> None:
    """The page, its feed and its static files on ``app``."""
    app.state.dashboard = Dashboard(app.state, config)
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
