"""``tandem top URL``: the server's /dashboard in a terminal, for a server reached over SSH.

It reads the same feed as the page, ``GET /dashboard/events`` (one frame a
second, built by the server from its /metrics registry and engine snapshot),
and draws the same panels with rich: the doctor's verdict, now, throughput,
latency against the SLOs, the scheduler, and the requests in the engine.
Nothing is computed here that the page does not show.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tandem.tools.bench.target import default_api_key, parse_headers
from tandem.tools.cli_errors import one_line_errors
from tandem.tools.doctor.probe import DoctorError, normalize_url

DESCRIPTION = (
    "Watch a running tandem server: the panels of its /dashboard page (the doctor's verdict, "
    "running/waiting requests, KV blocks, throughput, TTFT/ITL/E2E/queue quantiles against the "
    "--slo-* lines, step composition, and every request in the engine), live in the terminal."
)
SPARK = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 40
REFUSED = {
    401: "the server wants its API key: --api-key KEY (or $TANDEM_API_KEY)",
    404: "no /dashboard/events here: is it a tandem server?",
    429: "the server's dashboard viewer cap is reached (--dashboard-max-viewers); try later",
}


def refused(status: int, body: str, sent_key: bool) -> str:
    """Why the server refused the feed, in words."""
    if status == 401 and sent_key:
        return "the server answered 401: the API key sent is not its --api-key"
    if status == 503 and "Loading model" in body:
        return "the server is still loading its model: try again once /health answers 200"
    return REFUSED.get(status, f"HTTP {status}: {body[:200]}")


class TopError(Exception):
    """Why the feed cannot be watched, in one line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (or host:port)")
    p.add_argument("--api-key", default=None,
                   help="the server's --api-key (default: $OPENAI_API_KEY or $TANDEM_API_KEY)")
    p.add_argument("--once", action="store_true",
                   help="print one frame and exit (scripts; not on a terminal every frame is "
                        "printed as it comes)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the server and between frames (10)")


def register(subparsers: Any) -> None:
    """Add ``top`` to the main CLI's subparsers."""
    p = subparsers.add_parser("top", help="watch a running server's dashboard in the terminal",
                              description=DESCRIPTION)
    add_arguments(p)
    one_line_errors(p)
    p.set_defaults(func=run)


# -------------------------------------------------------------------- feed
def events(url: str, headers: dict[str, str], timeout_s: float
           ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) from the server-sent events of /dashboard/events."""
    with httpx.stream("GET", f"{url}/dashboard/events", headers=headers,
                      timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            raise TopError(refused(r.status_code, r.text, "Authorization" in headers))
        name, data = "message", ""
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
            elif not line and data:
                yield name, json.loads(data)
                name, data = "message", ""


# ----------------------------------------------------------------- numbers
def num(v: float | None, digits: int = 0) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def dur(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1e3:,.0f} ms" if s < 1 else f"{s:,.2f} s"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def sparkline(values: Sequence[float | None]) -> str:
    """One character per value, scaled to the largest (blank: no value)."""
    top = max((v for v in values if v is not None), default=0.0)
    if top <= 0:
        return "".join(" " if v is None else SPARK[0] for v in values)
    return "".join(" " if v is None else SPARK[min(len(SPARK) - 1, int(v / top * len(SPARK)))]
                   for v in values)


# ------------------------------------------------------------------- panels
class View:
    """The latest frame and the charts' history, drawn as rich panels."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.points: deque[dict] = deque(maxlen=SPARK_POINTS)
        self.frame: dict[str, Any] | None = None

    def update(self, name: str, data: dict[str, Any]) -> None:
        if name == "history":
            self.points.clear()
            self.points.extend(data["history"])
        else:
            self.frame = data
            self.points.append(data["point"])

    def render(self, max_rows: int = 20) -> RenderableType:
        f = self.frame
        if f is None:
            return Text(f"waiting for {self.url} ...")
        when = datetime.fromtimestamp(f["point"]["t"]).strftime("%H:%M:%S")
        head = Text.assemble(("tandem top ", "bold"), f"{f['model']} at {self.url}  ",
                             (when, "green"))
        return Group(head, self._doctor(f), self._summary(f), self._latency(f),
                     self._requests(f, max_rows))

    def _doctor(self, f: dict) -> Panel:
        doc = f["doctor"]
        problem = any(x["severity"] == "problem" for x in doc["findings"])
        lines = [Text(doc["verdict"], style="bold red" if problem else "bold green")]
        for x in doc["findings"]:
            lines.append(Text.assemble((f"{x['phase']}: ", "bold"), x["evidence"],
                                       (f" -> {x['knob']}" if x["knob"] else "", "dim")))
        return Panel(Group(*lines), title="doctor", title_align="left")

    def _summary(self, f: dict) -> Table:
        n, t, s, p = f["now"], f["totals"], f["scheduler"], f["point"]
        win = f"last {f['window_s']:.0f} s"
        grid = Table.grid(padding=(0, 3))
        for _ in range(3):
            grid.add_column()
        now = Table(title="now", show_header=False, box=None, title_justify="left")
        now.add_row("running", num(n["running"]))
        now.add_row("waiting", num(n["waiting"]))
        now.add_row("preempted", num(n["preempted"]))
        now.add_row("KV blocks", f"{num(n['kv_blocks_used'])} / {num(n['kv_blocks_total'])}")
        now.add_row(f"prefix hits ({win})", pct(n["prefix_cache_hit_rate"]))
        now.add_row("CPU threads", num(n["cpu_threads"]))
        tp = Table(title="throughput, tok/s", show_header=False, box=None,
                   title_justify="left")
        tp.add_row("prompt", num(p["prompt_tok_s"], 1),
                   Text(sparkline([q["prompt_tok_s"] for q in self.points]), "yellow"))
        tp.add_row("generation", num(p["generation_tok_s"], 1),
                   Text(sparkline([q["generation_tok_s"] for q in self.points]), "blue"))
        tp.add_row("prompt tokens", num(t["prompt_tokens"]), "")
        tp.add_row("generated tokens", num(t["generation_tokens"]), "")
        tp.add_row("requests finished", num(t["requests"]), "")
        tp.add_row("rejected (503)", num(t["rejections"]), "")
        sched = Table(title="scheduler", show_header=False, box=None, title_justify="left")
        sched.add_row("steps/s", num(s["steps_per_s"], 1))
        sched.add_row("tokens per step", num(s["tokens_per_step"], 1))
        sched.add_row("prefill share", pct(s["prefill_share"]))
        sched.add_row(f"preemptions ({win})", num(s["preemptions"]))
        sched.add_row("preemptions, total", num(t["preemptions"]))
        grid.add_row(now, tp, sched)
        return grid

    def _latency(self, f: dict) -> Table:
        slo = f["slo"]
        table = Table(title=f"latency (last {f['window_s']:.0f} s)", title_justify="left")
        for col in ("", "p50", "p95", "p99", "requests", "SLO"):
            table.add_column(col, justify="left" if not col else "right")
        limits = {"ttft": slo["ttft_s"], "itl": slo["itl_s"]}
        for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"), ("queue", "queue")):
            lat, limit = f["latency"][key], limits.get(key)
            cells = [Text(dur(lat[q]), "bold red" if limit is not None and lat[q] is not None
                          and lat[q] > limit else "") for q in ("p50", "p95", "p99")]
            table.add_row(label, *cells, num(lat["count"]), dur(limit) if limit else "")
        return table

    def _requests(self, f: dict, max_rows: int) -> Table:
        rows = f["requests"]
        hidden = len(rows) - max_rows + f["requests_not_shown"]
        table = Table(title=f"requests ({len(rows) + f['requests_not_shown']} in the engine"
                            + (f", {hidden} not shown)" if hidden > 0 else ")"),
                      title_justify="left")
        for col in ("request", "state", "prompt", "cached", "output", "tok/s", "preempted",
                    "age"):
            table.add_column(col, justify="left" if col in ("request", "state") else "right")
        colors = {"decode": "blue", "prefill": "yellow", "queued": "red", "preempted": "red"}
        for r in rows[:max_rows]:
            state = r["state"]
            if state == "prefill":
                total = max(r["num_prompt_tokens"] + r["num_output_tokens"], 1)
                state = f"prefill {100 * r['num_computed_tokens'] / total:.0f}%"
            table.add_row(r["request_id"], Text(state, colors[r["state"]]),
                          num(r["num_prompt_tokens"]), num(r["num_cached_tokens"]),
                          num(r["num_output_tokens"]), num(r["output_tokens_per_s"], 1),
                          num(r["num_preemptions"]), dur(r["age_s"]))
        return table


# --------------------------------------------------------------------- run
def watch(url: str, headers: dict[str, str], timeout_s: float, once: bool,
          console: Console) -> None:
    view = View(url)
    feed = events(url, headers, timeout_s)
    if once or not console.is_terminal:  # not a terminal (a pipe, a log): frame after frame
        printed = None
        for name, data in feed:
            view.update(name, data)
            if view.frame is not None and view.frame is not printed:
                console.print(view.render())
                printed = view.frame
                if once:
                    return
        raise TopError("the feed ended before the first frame" if printed is None else
                       "the server closed the feed")
    with Live(view.render(), console=console, screen=True, auto_refresh=False) as live:
        for name, data in feed:
            view.update(name, data)
            live.update(view.render(max(3, console.height - 28)), refresh=True)
    raise TopError("the server closed the feed")


def run(args: argparse.Namespace) -> int:
    """Watch until Ctrl-C (0); 2 and one line on stderr when the feed cannot be read."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per connection
    try:
        if not args.timeout > 0:
            raise TopError("--timeout must be positive")
        url = normalize_url(args.url)
        headers = parse_headers(None, args.api_key or default_api_key())
        watch(url, headers, args.timeout, args.once, Console())
    except KeyboardInterrupt:
        return 0
    except httpx.TransportError as e:  # nothing answered: say where it looked
        print(f"tandem top: error: cannot reach {args.url}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    except (TopError, DoctorError, httpx.HTTPError, ValueError) as e:
        print(f"tandem top: error: {e}", file=sys.stderr)
        return 2
    return 0
