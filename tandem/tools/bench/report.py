"""The result: a JSON dict with vLLM's keys, and the table in vLLM's layout.

Keys and layout follow ``vllm bench serve`` so its tooling (and people used
to its output) read ours unchanged; tandem's additions are extra keys
(``server_metrics``, ``dataset_name``, ``base_url``, ``goodput_config``)
and an extra table section for the server's own numbers.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.tools.bench.client import RequestResult
from tandem.tools.bench.metrics import METRIC_TITLES, BenchmarkMetrics, percentile_key

# Per-request lists: kept only with --save-detailed (as vLLM does), but always used for plots.
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                 "queue_times", "generated_texts", "errors", "server_phases")


def build_result(*, config: dict[str, Any], results: list[RequestResult], duration: float,
                 origin: float, metrics: BenchmarkMetrics, output_lens: list[int],
                 percentile_metrics: list[str], goodput: dict[str, float],
                 server: dict | None) -> dict[str, Any]:
    """One run's JSON: the configuration, then vLLM's result keys, then tandem's extras."""
    rate = config.get("request_rate", math.inf)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": config["backend"],
        "backend": config["backend"],
        "label": config.get("label"),
        "model_id": config["model_id"],
        "tokenizer_id": config.get("tokenizer_id"),
        "num_prompts": config["num_prompts"],
        **config.get("metadata", {}),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": config.get("burstiness", 1.0),
        "max_concurrency": config.get("max_concurrency"),
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time - origin for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "server_phases": [r.server for r in results],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for name in percentile_metrics:
        for stat, value in metrics.stats[name].items():
            result[f"{stat}_{name}_ms"] = value
    result.update({
        "dataset_name": config.get("dataset_name"),
        "seed": config.get("seed"),
        "base_url": config.get("base_url"),
        "endpoint": config.get("endpoint"),
        "goodput_config": goodput or None,
        "server_metrics": server,
    })
    return result


def strip_detailed(result: dict[str, Any]) -> dict[str, Any]:
    """The result without per-request lists (vLLM's default unless --save-detailed)."""
    return {k: v for k, v in result.items() if k not in DETAILED_KEYS}


def _row(label: str, value: Any, fmt: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{label:<40} {'n/a':<10}"
    return f"{label:<40} {value:<10{fmt}}"


def format_table(result: dict[str, Any], percentile_metrics: list[str],
                 percentiles: list[float]) -> str:
    """vLLM's "Serving Benchmark Result" block, plus p95 and the server's own numbers."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") != "inf":
        lines.append(_row("Request rate configured (RPS):", result["request_rate"], ".2f"))
    lines += [
        _row("Benchmark duration (s):", result["duration"], ".2f"),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", result["request_throughput"], ".2f"),
    ]
    if result.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"], ".2f"))
    lines += [
        _row("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
        _row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f"),
        _row("Peak concurrent requests:", float(result["max_concurrent_requests"]), ".2f"),
        _row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f"),
    ]
    for name in percentile_metrics:
        short, title = METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f"))
        lines.append(_row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f"))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_row(f"{key.upper()} {short} (ms):", result[f"{key}_{name}_ms"], ".2f"))
    server = result.get("server_metrics")
    if server:
        lines += _server_rows(server, percentiles)
    lines.append("=" * 50)
    return "\n".join(lines)


def _server_rows(s: dict, percentiles: list[float]) -> list[str]:
    lines = ["{s:{c}^{n}}".format(s="Server-side (/metrics)", n=50, c="-")]
    for key, short in (("ttft", "TTFT"), ("itl", "ITL")):
        if f"mean_{key}_ms" in s:
            lines.append(_row(f"Server mean {short} (ms):", s[f"mean_{key}_ms"], ".2f"))
            for p in percentiles:
                k = percentile_key(p)
                lines.append(_row(f"Server {k.upper()} {short} (ms, buckets):",
                                  s.get(f"{k}_{key}_ms"), ".2f"))
    for key, label in (("queue_time", "queue"), ("prefill_time", "prefill"),
                       ("decode_time", "decode")):
        if f"mean_{key}_ms" in s:
            lines.append(_row(f"Server mean {label} time (ms):", s[f"mean_{key}_ms"], ".2f"))
    lines.append(_row("Preemptions:", s.get("num_preemptions")))
    rate = s.get("prefix_cache_hit_rate")
    lines.append(_row("Prefix cache hit rate (%):", None if rate is None else rate * 100, ".2f"))
    kv = s.get("peak_kv_cache_usage")
    lines.append(_row("Peak KV cache usage (%):", None if kv is None else kv * 100, ".2f"))
    lines.append(_row("Peak running requests:", s.get("peak_num_requests_running"), ".0f"))
    lines.append(_row("Peak waiting requests:", s.get("peak_num_requests_waiting"), ".0f"))
    if s.get("queue_rejections"):
        lines.append(_row("Rejected (503, queue full):", s["queue_rejections"]))
    return lines


def error_summary(results: list[RequestResult], limit: int = 5) -> list[str]:
    """The distinct errors of failed requests, most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            first = (r.error or "unknown error").splitlines()[0][:200]
            counts[first] = counts.get(first, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [f"{n} x {err}" for err, n in top]


def result_filename(label: str, request_rate: float, max_concurrency: int | None, model: str,
                    date: str) -> str:
    """vLLM's ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base_model = re.sub(r"[^A-Za-z0-9._-]+", "_", model.split("/")[-1])
    return f"{label}-{request_rate}qps{conc}-{base_model}-{date}.json"


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
