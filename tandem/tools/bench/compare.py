"""``tandem bench compare A.json B.json ...``: saved results side by side, with ratios.

Reads ``bench serve`` results and ``vllm bench serve`` results alike (same
keys), so one engine can be compared with another, or a setting with its
change, on the same workload; a ``--sweep`` file contributes one column per
point. Each further result gets a ratio against the first; rows say which
direction is better.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# (key, label, higher_is_better); None: a setting or a count, not better or worse.
CONFIG_ROWS: list[tuple[str, str, bool | None]] = [
    ("base_url", "Target", None),
    ("model_id", "Model", None),
    ("dataset_name", "Dataset", None),
    ("num_prompts", "Prompts", None),
    ("request_rate", "Request rate (req/s)", None),
    ("max_concurrency", "Max concurrency", None),
]
ROWS: list[tuple[str, str, bool | None]] = [
    ("completed", "Successful requests", None),
    ("failed", "Failed requests", False),
    ("duration", "Benchmark duration (s)", None),
    ("total_input_tokens", "Total input tokens", None),
    ("total_output_tokens", "Total generated tokens", None),
    ("request_throughput", "Request throughput (req/s)", True),
    ("request_goodput", "Request goodput (req/s)", True),
    ("output_throughput", "Output token throughput (tok/s)", True),
    ("max_output_tokens_per_s", "Peak output token throughput (tok/s)", True),
    ("total_token_throughput", "Total token throughput (tok/s)", True),
    ("max_concurrent_requests", "Peak concurrent requests", None),
]
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
SERVER_ROWS: list[tuple[str, str, bool | None]] = [
    ("mean_ttft_ms", "Server mean TTFT (ms)", False),
    ("mean_itl_ms", "Server mean ITL (ms)", False),
    ("num_preemptions", "Server preemptions", False),
    ("prefix_cache_hit_rate", "Server prefix cache hit rate", True),
    ("peak_kv_cache_usage", "Server peak KV cache usage", None),
]


def load_results(path: str) -> list[tuple[str | None, dict[str, Any]]]:
    """A result file's runs: one for ``bench serve``, one per point for a ``--sweep`` file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("results"), list) and "sweep" in data:
        runs = [(f"{data['sweep']}={v:g}", r) for v, r in zip(data["values"], data["results"])]
    else:
        runs = [(None, data)]
    for _, r in runs:
        if not isinstance(r, dict) or "completed" not in r or "duration" not in r:
            raise ValueError(f"{path}: not a `bench serve` (or `vllm bench serve`) result")
    return runs


def _label(name: str | None, data: dict[str, Any], path: str, taken: set[str]) -> str:
    base = name or data.get("label") or f"{data.get('backend', '?')}:{data.get('model_id', '?')}"
    label = base if base not in taken else Path(path).stem
    while label in taken:
        label += "'"
    taken.add(label)
    return label


def _latency_rows(results: list[dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    rows = []
    for name, short in LATENCIES:
        for stat in ("mean", "median"):
            rows.append((f"{stat}_{name}_ms", f"{stat.capitalize()} {short} (ms)", False))
        pcts = sorted({k[: -len(f"_{name}_ms")] for r in results for k in r
                       if k.startswith("p") and k.endswith(f"_{name}_ms")},
                      key=lambda p: float(p[1:]))
        rows += [(f"{p}_{name}_ms", f"{p.upper()} {short} (ms)", False) for p in pcts]
    return rows


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)


def ratio_text(a: Any, b: Any, higher_is_better: bool | None) -> str:
    """``b / a`` with a verdict: "1.85x better", "0.50x worse", "1.00x" (within 2%)."""
    if higher_is_better is None and not (isinstance(a, (int, float))
                                         and isinstance(b, (int, float))):
        return ""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return "n/a"
    if a == 0:
        return "n/a" if b != 0 else "1.00x"
    r = b / a
    if abs(r - 1) < 0.02 or higher_is_better is None:
        return f"{r:.2f}x"
    better = (r > 1) == higher_is_better
    return f"{r:.2f}x {'better' if better else 'worse'}"


def compare_table(paths: list[str]) -> str:
    runs = [(name, r, p) for p in paths for name, r in load_results(p)]
    if len(runs) < 2:
        raise ValueError("give at least two results to compare (files, or one --sweep file)")
    taken: set[str] = set()
    labels = [_label(name, r, p, taken) for name, r, p in runs]
    results = [r for _, r, _ in runs]
    rows = [(None, *row) for row in CONFIG_ROWS + ROWS + _latency_rows(results)]
    if any(r.get("server_metrics") for r in results):
        rows += [("server_metrics", *row) for row in SERVER_ROWS]
    table = []
    for section, key, label, higher in rows:
        values = [(r.get(section) or {}).get(key) if section else r.get(key) for r in results]
        if any(v is not None for v in values):
            table.append((label, values, [ratio_text(values[0], v, higher) for v in values[1:]]))
    width = max(12, *(len(x) for x in labels), *(len(_fmt(v)) for _, vs, _ in table for v in vs))
    ratio_w = [max(14, len(x) + len(labels[0]) + 1) for x in labels[1:]]
    header = f"{'metric':<38}" + "".join(f" {x:>{width}}" for x in labels) + "".join(
        f" {x + '/' + labels[0]:>{w}}" for x, w in zip(labels[1:], ratio_w))
    lines = [header, "-" * len(header)]
    for label, values, ratios in table:
        lines.append((f"{label:<38}" + "".join(f" {_fmt(v):>{width}}" for v in values)
                      + "".join(f" {r:>{w}}" for r, w in zip(ratios, ratio_w))).rstrip())
    return "\n".join(lines)


def run_compare(paths: list[str]) -> int:
    print(compare_table(paths))
    return 0
