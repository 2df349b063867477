"""``tandem bench serve``: load a server the way users will, and report what they get.

One run: sample the workload, optionally warm up, scrape ``/metrics``, send
the requests on the arrival schedule (at most ``--max-concurrency`` at once),
scrape again, then print the table and save the JSON, plots and HTML report.
``--sweep`` repeats the run over several concurrencies or rates (fresh
prompts each time, so one point's prefix cache does not flatter the next)
and plots throughput against p99 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tandem.tools.bench.client import REQUEST_FUNCS, RequestInput
from tandem.tools.bench.datasets import DatasetArgs, SampleRequest, sample_requests
from tandem.tools.bench.metrics import (
    calculate_metrics,
    in_flight_timeline,
    output_tokens_per_second,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
)
from tandem.tools.bench.report import (
    build_result,
    error_summary,
    format_table,
    result_filename,
    strip_detailed,
    write_json,
)
from tandem.tools.bench.runner import arrival_times, check_load, make_client, run_requests
from tandem.tools.bench.server_metrics import MetricsWatcher
from tandem.tools.bench.target import Target, parse_headers, resolve_seed, resolve_target
from tandem.tools.bench.tokens import PromptBuilder, TextTokenizer, choose_tokenizer

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                  "presence_penalty", "repetition_penalty")
SWEEP_PARAMS = {"concurrency": "max_concurrency", "max-concurrency": "max_concurrency",
                "rate": "request_rate", "request-rate": "request_rate"}


@dataclass
class Settings:
    """Validated run settings (everything that is not the target or the dataset)."""

    percentiles: list[float]
    percentile_metrics: list[str]
    goodput: dict[str, float]
    sampling: dict[str, Any]
    extra_body: dict[str, Any]
    id_prefix: str


def settings_from_args(a: argparse.Namespace) -> Settings:
    extra: dict[str, Any] = {}
    if a.extra_body:
        try:
            extra = json.loads(a.extra_body)
        except ValueError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    if a.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {a.num_warmups}")
    if a.request_timeout is not None and a.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be positive, got {a.request_timeout}")
    check_load(a.request_rate, a.burstiness, a.max_concurrency)
    return Settings(
        percentiles=parse_percentiles(a.metric_percentiles),
        percentile_metrics=parse_percentile_metrics(a.percentile_metrics),
        goodput=parse_goodput(a.goodput),
        sampling={k: getattr(a, k) for k in SAMPLING_FLAGS if getattr(a, k) is not None},
        extra_body=extra,
        id_prefix=a.request_id_prefix or f"bench-{uuid.uuid4().hex[:8]}-",
    )


def dataset_args(a: argparse.Namespace, max_model_len: int | None) -> DatasetArgs:
    return DatasetArgs(
        name=a.dataset_name, path=a.dataset_path,
        random_input_len=a.input_len or a.random_input_len,
        random_output_len=a.random_output_len, random_range_ratio=a.random_range_ratio,
        random_prefix_len=a.random_prefix_len, shared_prefix_len=a.shared_prefix_len,
        shared_prefix_num_prefixes=a.shared_prefix_num_prefixes,
        shared_prefix_question_len=a.shared_prefix_question_len, output_len=a.output_len,
        max_model_len=max_model_len,
    )


def _inputs(target: Target, samples: list[SampleRequest], s: Settings, ignore_eos: bool,
            tag: str) -> list[RequestInput]:
    return [RequestInput(url=target.url, model=target.model, sample=x,
                         request_id=f"{s.id_prefix}{tag}{i}", ignore_eos=ignore_eos,
                         sampling=s.sampling, extra_body=s.extra_body)
            for i, x in enumerate(samples)]


async def benchmark(target: Target, a: argparse.Namespace, s: Settings,
                    samples: list[SampleRequest], warmups: list[SampleRequest],
                    ignore_eos: bool, config: dict[str, Any]) -> tuple[dict, dict]:
    """Run once; returns (the full result with per-request lists, plot data)."""
    func = REQUEST_FUNCS[target.backend]
    rng = np.random.default_rng([a.seed, 1])
    async with make_client(a.max_concurrency, target.headers) as client:
        if warmups:
            print(f"Warming up with {len(warmups)} requests...")
            await run_requests(client, func, _inputs(target, warmups, s, ignore_eos, "warmup-"),
                               np.zeros(len(warmups)), a.max_concurrency, a.request_timeout,
                               "warm-up", a.disable_tqdm)
        watcher = MetricsWatcher(target.base_url, target.headers, a.metrics_interval)
        if not a.no_server_metrics:
            await watcher.start()
        times = arrival_times(len(samples), a.request_rate, a.burstiness, rng)
        run = await run_requests(client, func, _inputs(target, samples, s, ignore_eos, ""),
                                 times, a.max_concurrency, a.request_timeout, "requests",
                                 a.disable_tqdm)
        server = await watcher.stop(run.start, s.percentiles)  # None without vLLM names
    metrics, output_lens = calculate_metrics(run.results, run.duration, s.percentiles,
                                             s.goodput)
    result = build_result(config=config, results=run.results, duration=run.duration,
                          origin=run.start, metrics=metrics, output_lens=output_lens,
                          percentile_metrics=s.percentile_metrics, goodput=s.goodput,
                          server=server)
    plot_data = {"per_second": output_tokens_per_second(run.results, run.start),
                 "in_flight": in_flight_timeline(run.results, run.start),
                 "errors": error_summary(run.results)}
    return result, plot_data


def _config(a: argparse.Namespace, target: Target, tokenizer: TextTokenizer | None,
            num_prompts: int) -> dict[str, Any]:
    metadata = {}
    for item in a.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: use KEY=VALUE")
        metadata[key.strip()] = value.strip()
    return {"backend": target.backend, "label": a.label, "model_id": target.model,
            "tokenizer_id": tokenizer.source if tokenizer else None, "num_prompts": num_prompts,
            "metadata": metadata, "request_rate": a.request_rate, "burstiness": a.burstiness,
            "max_concurrency": a.max_concurrency, "dataset_name": a.dataset_name,
            "seed": a.seed,
            "base_url": target.base_url, "endpoint": target.endpoint}


def _print_header(a: argparse.Namespace, target: Target) -> None:
    dist = "Poisson process" if a.burstiness == 1.0 else "Gamma distribution"
    print(f"Target: {target.url} (model {target.model}, backend {target.backend}), "
          f"dataset {a.dataset_name}, seed {a.seed}")
    print(f"Traffic request rate: {a.request_rate}")
    print(f"Burstiness factor: {a.burstiness} ({dist})")
    print(f"Maximum request concurrency: {a.max_concurrency}")


def _save(a: argparse.Namespace, result: dict, plot_data: dict, table: str, label: str
          ) -> list[Path]:
    name = a.result_filename or result_filename(label, a.request_rate, a.max_concurrency,
                                                 result["model_id"], result["date"])
    path = Path(a.result_dir or ".") / name
    write_json(path, result if a.save_detailed else strip_detailed(result))
    saved = [path]
    if not a.no_plots:
        from tandem.tools.bench.html import write_html
        from tandem.tools.bench.plots import plot_latency_cdfs, plot_timeline

        stem = path.with_suffix("")
        pngs = [plot_latency_cdfs(result, Path(f"{stem}-latency.png")),
                plot_timeline(result, plot_data["per_second"], plot_data["in_flight"],
                              Path(f"{stem}-timeline.png"))]
        saved += pngs
        saved.append(write_html(Path(f"{stem}.html"), f"tandem bench serve: {label}", result,
                                table, pngs, plot_data["errors"]))
    return saved


def run_serve(a: argparse.Namespace) -> int:
    """``tandem bench serve``: 0 when any request succeeded, 1 when all failed."""
    s = settings_from_args(a)
    a.seed = resolve_seed(a.seed)
    headers = parse_headers(a.header, a.api_key)
    with httpx.Client(headers=headers, timeout=60.0) as sync:
        target = resolve_target(a.base_url, a.host, a.port, a.backend, a.endpoint, a.model,
                                headers, sync)
        tokenizer = choose_tokenizer(sync, target.base_url, target.model, a.tokenizer,
                                     a.skip_tokenizer_init)
        if tokenizer is None and target.backend != "openai":
            raise ValueError("--skip-tokenizer-init sends token ids: use --backend openai")
        if a.sweep:
            from tandem.tools.bench.sweep import run_sweep

            return run_sweep(a, s, target, tokenizer)
        result, plot_data = run_once(a, s, target, tokenizer)
    return finish(a, s, result, plot_data)


def run_once(a: argparse.Namespace, s: Settings, target: Target,
             tokenizer: TextTokenizer | None) -> tuple[dict, dict]:
    """Sample (num_prompts + num_warmups, so warm-ups never pre-cache a measured prompt), run."""
    builder = PromptBuilder(tokenizer, np.random.default_rng(a.seed), a.vocab_size)
    samples = sample_requests(dataset_args(a, target.max_model_len), builder,
                              a.num_prompts + a.num_warmups)
    warmups, samples = samples[a.num_prompts:], samples[:a.num_prompts]
    # vLLM's rule: synthetic prompts run to their requested length.
    ignore_eos = a.ignore_eos or (a.dataset_name in ("random", "shared-prefix")
                                  and target.backend != "ollama")
    _print_header(a, target)
    config = _config(a, target, tokenizer, a.num_prompts)
    return asyncio.run(benchmark(target, a, s, samples, warmups, ignore_eos, config))


def finish(a: argparse.Namespace, s: Settings, result: dict, plot_data: dict) -> int:
    """Print the errors and the table; save when asked; the exit code."""
    for line in plot_data["errors"]:
        print(f"failed: {line}", file=sys.stderr)
    table = format_table(result, s.percentile_metrics, s.percentiles)
    print(table)
    if a.save_result or a.result_filename or a.result_dir:
        for path in _save(a, result, plot_data, table, a.label or result["backend"]):
            print(f"saved {path}")
    if result["completed"] == 0:
        print("All requests failed: check the errors above (URL, --model, --api-key, "
              "--endpoint).", file=sys.stderr)
        return 1
    return 0


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``concurrency=1,2,4`` or ``rate=1,2,inf`` -> ("max_concurrency", [1, 2, 4])."""
    name, sep, values = text.partition("=")
    if not sep or name.strip() not in SWEEP_PARAMS:
        raise ValueError(f"--sweep {text!r}: use concurrency=1,2,4,8 or rate=0.5,1,2,inf")
    attr = SWEEP_PARAMS[name.strip()]
    try:
        vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: values must be numbers") from None
    if not vals or any(not v > 0 for v in vals) or (
            attr == "max_concurrency" and any(math.isinf(v) or v != int(v) for v in vals)):
        raise ValueError(f"--sweep {text!r}: values must be positive "
                         "(concurrencies whole numbers)")
    return attr, vals
