"""PNG plots of a run (and of a sweep), drawn with matplotlib's object API.

* latency CDFs: TTFT (prefill + queue: what "the first token takes four
  seconds" looks like) and ITL (decode smoothness: p99 grows with batching);
* timeline: output tokens per second and requests in flight over the run,
  with the server's running/waiting/KV usage when /metrics was scraped;
* sweep: output throughput against p99 ITL and p99 TTFT, one point per
  concurrency or rate — where the curve turns up is the capacity knee.

``matplotlib.figure.Figure`` needs no pyplot state or GUI backend, so this
works headless and in threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _figure(w: float, h: float, rows: int = 1, cols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _cdf(ax, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    x = np.sort(np.asarray(values_ms))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(x, y, where="post")
    for p, style in ((50, ":"), (99, "--")):
        v = float(np.percentile(x, p))
        ax.axvline(v, color="gray", linestyle=style, linewidth=1)
        ax.annotate(f"p{p} {v:.0f}", (v, p / 100), xytext=(4, -12), textcoords="offset points",
                    fontsize=8)


def plot_latency_cdfs(result: dict[str, Any], path: Path) -> Path:
    ok = [e == "" for e in result["errors"]]
    ttfts = [t * 1000 for t, good in zip(result["ttfts"], ok) if good]
    itls = [x * 1000 for itl, good in zip(result["itls"], ok) if good for x in itl]
    fig, axes = _figure(10, 4, 1, 2)
    _cdf(axes[0][0], ttfts, f"Time to first token ({len(ttfts)} requests)")
    _cdf(axes[0][1], itls, f"Inter-token latency ({len(itls)} gaps)")
    fig.suptitle(_title(result))
    fig.savefig(path)
    return path


def plot_timeline(result: dict[str, Any], per_second: np.ndarray,
                  in_flight: tuple[np.ndarray, np.ndarray], path: Path) -> Path:
    server = (result.get("server_metrics") or {}).get("timeline") or {}
    rows = 3 if len(server.get("t", [])) > 1 else 2
    fig, axes = _figure(10, 2.6 * rows, rows, 1)
    ax = axes[0][0]
    ax.bar(np.arange(len(per_second)) + 0.5, per_second, width=1.0, alpha=0.7)
    ax.set_ylabel("output tok/s")
    ax.set_title("Output tokens per second (1 s buckets)")
    ax.grid(alpha=0.3)
    ax = axes[1][0]
    t, n = in_flight
    if len(t):
        ax.step(np.concatenate([[0.0], t]), np.concatenate([[0], n]), where="post")
    if result.get("max_concurrency"):
        ax.axhline(result["max_concurrency"], color="red", linestyle="--", linewidth=1,
                   label="--max-concurrency")
        ax.legend(loc="upper right")
    ax.set_ylabel("requests")
    ax.set_title("Requests in flight (client side)")
    ax.grid(alpha=0.3)
    if rows == 3:
        ax = axes[2][0]
        st = np.asarray(server["t"])
        for key, label in (("running", "running"), ("waiting", "waiting")):
            if key in server:
                ax.step(st, _floats(server[key]), where="post", label=label)
        ax.set_ylabel("requests")
        if "kv_cache_usage" in server:
            kv = ax.twinx()
            kv.plot(st, _floats(server["kv_cache_usage"]) * 100, color="purple", alpha=0.6,
                    label="KV cache %")
            kv.set_ylabel("KV cache usage %")
            kv.set_ylim(0, 100)
            kv.legend(loc="upper right")
        ax.legend(loc="upper left")
        ax.set_title("Server (/metrics): batch, queue and KV cache")
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds since start")
    fig.suptitle(_title(result))
    fig.savefig(path)
    return path


def _floats(values: list[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def plot_sweep(param: str, points: list[tuple[float, dict[str, Any]]], path: Path) -> Path:
    """Output tok/s vs p99 ITL and p99 TTFT, one labelled point per sweep value."""
    fig, axes = _figure(10, 4, 1, 2)
    x = [r["output_throughput"] for _, r in points]
    for ax, key, title in ((axes[0][0], "p99_itl_ms", "p99 inter-token latency"),
                           (axes[0][1], "p99_ttft_ms", "p99 time to first token")):
        y = [r.get(key, np.nan) for _, r in points]
        ax.plot(x, y, marker="o")
        for (value, _), xi, yi in zip(points, x, y):
            ax.annotate(f"{value:g}", (xi, yi), xytext=(5, 3), textcoords="offset points",
                        fontsize=9)
        ax.margins(x=0.12, y=0.12)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} vs throughput")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Sweep over {param} (points labelled with it): where latency turns up is "
                 "the capacity knee")
    fig.savefig(path)
    return path


def _title(result: dict[str, Any]) -> str:
    conc = result.get("max_concurrency")
    return (f"{result.get('model_id')} | {result.get('backend')} | rate "
            f"{result.get('request_rate')} req/s"
            + (f" | max concurrency {conc}" if conc else "")
            + f" | {result.get('completed')} ok, {result.get('failed')} failed")
