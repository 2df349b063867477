"""``tandem bench serve | phases | compare``: the command line (vLLM's flag names).

Importable without torch: a benchmark client machine needs no model.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from tandem.tools.bench.client import BACKENDS
from tandem.tools.bench.datasets import DATASETS
from tandem.tools.bench.target import default_api_key

SERVE_HELP = """\
Load an OpenAI- or Ollama-compatible server (tandem, vLLM, llama-server, Ollama)
like `vllm bench serve`, and report what its users get:
  TTFT  time to first token: queue + prefill (the prompt is read in one pass)
  TPOT  time per output token after the first: decode speed as a user sees it
  ITL   inter-token latency: gaps between streamed tokens (p99 = stutter)
  E2EL  end-to-end latency of a request
plus throughput, peak output tok/s, peak concurrency and goodput (requests/s
meeting every --goodput SLO). When the server exposes /metrics with vLLM's
names, its own TTFT/ITL, preemptions, prefix-cache hit rate and peak KV usage
are reported next to the client's numbers.
"""

PHASES_HELP = """\
The prefill-vs-decode experiment: prompts of ~200 and ~2,000 tokens (--input-lens),
the same output length, one request at a time. TTFT should grow with the prompt
(prefill is compute bound); the decode speed should barely move (it is bound by
reading the weights once per token). Prints both per length and the conclusion.
"""


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None,
                   help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--backend", default="openai", choices=BACKENDS,
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions; "
                        "ollama: /api/generate or /api/chat (default openai)")
    g.add_argument("--endpoint", default=None,
                   help="API path (default: the backend's, e.g. /v1/completions)")
    g.add_argument("--model", default=None,
                   help="model name (default: the first of /v1/models, or Ollama's /api/tags)")
    g.add_argument("--api-key", default=default_api_key(),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, "
                        "else $TANDEM_API_KEY)")
    g.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra request headers")
    g.add_argument("--tokenizer", default=None,
                   help="count prompt tokens with this HF directory or GGUF (default: the "
                        "server's /tokenize, else tandem's default model's tokenizer)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="send random token-id prompts (for servers without a tokenizer, "
                        "e.g. tandem serve --load-format dummy --skip-tokenizer-init)")
    g.add_argument("--vocab-size", type=int, default=100,
                   help="token ids are drawn below this with --skip-tokenizer-init")
    g.add_argument("--seed", type=int, default=None,
                   help="seed for prompts and arrivals (default: a fresh one each run, "
                        "printed: a rerun with the same seed re-sends the same prompts, "
                        "which a prefix-caching server then answers from its cache)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before one request counts as failed (default 600)")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random: given lengths; shared-prefix: one long system prompt + "
                        "short questions (prefix caching); chat: multi-turn, ShareGPT-like "
                        "lengths (synthetic); file: --dataset-path JSONL")
    g.add_argument("--dataset-path", default=None,
                   help='JSONL for --dataset-name file: {"prompt": ...} or {"messages": ...} '
                        'or {"input_len": N}, optional "output_len"')
    g.add_argument("--input-len", type=int, default=None, help="= --random-input-len")
    g.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request, for every dataset")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one common prefix before every random prompt")
    g.add_argument("--shared-prefix-len", type=int, default=1024,
                   help="tokens of the shared system prompt")
    g.add_argument("--shared-prefix-question-len", type=int, default=32)
    g.add_argument("--shared-prefix-num-prefixes", type=int, default=1,
                   help="distinct system prompts, used round robin")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=200, help="requests to send (default 200)")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (default inf: all at once); arrivals are "
                        "Gamma-distributed, see --burstiness")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="1 = Poisson arrivals; < 1 burstier; > 1 more even")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (others wait in the client)")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent (and not measured) before the run")
    g.add_argument("--sweep", default=None, metavar="PARAM=V1,V2,...",
                   help="run once per value: concurrency=1,2,4,8 or rate=0.5,1,2; "
                        "plots throughput vs p99 ITL and TTFT (the capacity knee)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate the full output length (always on for random and "
                        "shared-prefix on OpenAI backends, as in vLLM)")
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g.add_argument("--request-id-prefix", default=None, help="x-request-id prefix")
    s = p.add_argument_group("sampling (sent only when given)")
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)


def _add_report_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics with percentiles (default ttft,tpot,itl,e2el)")
    g.add_argument("--metric-percentiles", default="50,95,99",
                   help="percentiles to report (default 50,95,99)")
    g.add_argument("--save-result", action="store_true",
                   help="save the JSON (vLLM's keys), PNG plots and an HTML report")
    g.add_argument("--save-detailed", action="store_true",
                   help="keep per-request lists (ttfts, itls, errors, ...) in the JSON")
    g.add_argument("--result-dir", default=None, help="directory for saved files")
    g.add_argument("--result-filename", default=None,
                   help="JSON file name (default: {label}-{rate}qps[-concurrencyN]-{model}-"
                        "{date}.json)")
    g.add_argument("--label", default=None, help="name of this run (default: the backend)")
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE",
                   help="extra KEY=VALUE pairs stored in the JSON")
    g.add_argument("--no-plots", action="store_true", help="save the JSON only")
    g.add_argument("--metrics-interval", type=float, default=0.5,
                   help="seconds between /metrics polls for peaks (0: before/after only)")
    g.add_argument("--no-server-metrics", action="store_true", help="do not scrape /metrics")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _quiet_libraries() -> None:
    """One INFO line per HTTP request (httpx) would bury the report."""
    for name in ("httpx", "matplotlib"):
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))


def _writable_result_dir(a: argparse.Namespace) -> None:
    """Where results will be saved, made and checked before the run: a run of many
    minutes that cannot save at its end lost its results."""
    if not (a.save_result or a.result_filename or a.result_dir):
        return
    where = Path(a.result_dir or ".")
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--result-dir {where}: {e.strerror}") from None
    if not os.access(where, os.W_OK):
        raise ValueError(f"--result-dir {where}: not writable")


def _serve(a: argparse.Namespace) -> int:
    from tandem.tools.bench.serve import run_serve

    _writable_result_dir(a)
    _quiet_libraries()
    return run_serve(a)


def _phases(a: argparse.Namespace) -> int:
    from tandem.tools.bench.phases import run_phases

    _writable_result_dir(a)
    _quiet_libraries()
    return run_phases(a)


def _compare(a: argparse.Namespace) -> int:
    from tandem.tools.bench.compare import run_compare

    return run_compare(a.results)


def register(subparsers: Any) -> None:
    """Add ``bench`` (serve | phases | compare) to the main CLI's subparsers."""
    bench = subparsers.add_parser(
        "bench", help="benchmark a running server: load test, prefill/decode phases, compare")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("serve", help="load test any OpenAI/Ollama-compatible server",
                       description=SERVE_HELP, formatter_class=raw)
    _add_target_args(p)
    _add_dataset_args(p)
    _add_load_args(p)
    _add_report_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("phases", help="TTFT and decode speed at short vs long prompts",
                       description=PHASES_HELP, formatter_class=raw)
    _add_target_args(p)
    p.add_argument("--input-lens", default="200,2000",
                   help="prompt lengths in tokens, comma separated (default 200,2000)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--repetitions", type=int, default=3, help="requests per length")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--save-result", action="store_true", help="save the rows as JSON")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.set_defaults(func=_phases)

    p = sub.add_parser("compare", help="saved results side by side, with ratios",
                       description="Compare `tandem bench serve` (or `vllm bench serve`) JSON "
                                   "results: each file against the first.")
    p.add_argument("results", nargs="+", help="result JSON files (the first is the baseline)")
    p.set_defaults(func=_compare)
