"""``tandem doctor URL``: diagnose a running server from the command line.

Bad input, an unreachable URL or something that is not an LLM server end in
one line on stderr and exit code 2, never a traceback: the person running it
is already debugging one problem and should not get a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import httpx

from tandem.diagnosis.findings import verdict
from tandem.diagnosis.measurements import Measurements
from tandem.diagnosis.probe_rules import diagnose
from tandem.tools.bench.target import default_api_key, parse_headers
from tandem.tools.cli_errors import one_line_errors
from tandem.tools.doctor.probe import DoctorError, ProbeConfig, collect
from tandem.tools.doctor.report import format_report
from tandem.tools.plan.arithmetic import WEIGHT_DTYPES, weight_bytes
from tandem.tools.plan.cli import PlanInputError, parse_bytes
from tandem.tools.plan.devices import DEVICES, get_device
from tandem.tools.plan.presets import PRESETS
from tandem.tools.plan.readers import load_model

DESCRIPTION = (
    "Diagnose a running LLM server (tandem, vLLM, llama-server, Ollama): a few bounded probes "
    "measure TTFT against prompt length, decode speed, whether a second request waits for the "
    "first, and the server's /metrics; the report says which phase is slow (queue, KV cache, "
    "prefill, decode) and which knob to turn first, each with the number behind it."
)

# Ollama's and tandem's quantization levels -> the planner's weight dtypes.
_QUANT_LEVELS = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "Q8_0": "int8", "INT8": "int8"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (or host:port)")
    p.add_argument("--api-key", default=None,
                   help="Bearer key (default: $OPENAI_API_KEY or $TANDEM_API_KEY)")
    p.add_argument("--header", action="append", metavar="KEY=VALUE",
                   help="extra HTTP header (repeatable)")
    p.add_argument("--model-name", default=None,
                   help="the served model to probe (default: the first the server lists)")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help=f"what the server runs, for the bytes read per token: a preset "
                        f"({', '.join(PRESETS)}), a config.json, an HF directory or a GGUF "
                        "(default: the size the server reports, when it does)")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help=f"weights of --model: {', '.join(WEIGHT_DTYPES)} (default: the "
                        "server's quantization level, else the checkpoint's)")
    p.add_argument("--device", default=None,
                   help=f"the server's device, for the decode ceiling: {', '.join(DEVICES)}")
    p.add_argument("--bandwidth", default=None,
                   help="the server's memory bandwidth, e.g. 900 or 3.35TB/s (plain: GB/s)")
    p.add_argument("--short-len", type=int, default=64, help="short prompt, tokens (64)")
    p.add_argument("--long-len", type=int, default=1024,
                   help="long prompt, tokens (1024; capped by the context window)")
    p.add_argument("--output-len", type=int, default=48,
                   help="tokens of the streaming probe (48)")
    p.add_argument("--ttft-target", type=float, default=1.0,
                   help="seconds to first token that count as slow (1.0)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (120)")
    p.add_argument("--token-ids", action="store_true",
                   help="send random token ids, not text (a server without a tokenizer; "
                        "detected by itself when text is refused)")
    p.add_argument("--vocab-size", type=int, default=100,
                   help="token ids are drawn from [1, this) (100)")
    p.add_argument("--seed", type=int, default=None, help="seed for the random prompts")
    p.add_argument("--json", action="store_true",
                   help="print measurements, findings and verdict as JSON")


def register(subparsers: Any) -> None:
    """Add ``doctor`` to the main CLI's subparsers."""
    p = subparsers.add_parser(
        "doctor", help="diagnose a running server: which phase is slow, which knob to turn",
        description=DESCRIPTION)
    add_arguments(p)
    one_line_errors(p)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    for name, lo in (("short_len", 1), ("long_len", 2), ("output_len", 2), ("vocab_size", 2)):
        if getattr(args, name) < lo:
            raise DoctorError(f"--{name.replace('_', '-')} must be at least {lo}")
    if args.long_len <= args.short_len:
        raise DoctorError("--long-len must be longer than --short-len")
    for name in ("ttft_target", "timeout"):
        if not getattr(args, name) > 0:
            raise DoctorError(f"--{name.replace('_', '-')} must be positive")
    if args.device and args.bandwidth:
        raise DoctorError("give --device or --bandwidth, not both")
    if args.dtype is not None and args.model is None:
        raise DoctorError("--dtype describes --model: give --model too")


def _bandwidth(args: argparse.Namespace) -> tuple[float | None, str]:
    if args.device:
        d = get_device(args.device)
        return d.bandwidth_bytes_s, f"{d.id}"
    if args.bandwidth:
        return parse_bytes(args.bandwidth, "--bandwidth", rate=True), "--bandwidth"
    return None, ""


def _model_bytes(args: argparse.Namespace, quant_level: str | None) -> tuple[float, str]:
    """Bytes one decode step reads, from the planner's view of ``--model``."""
    spec = load_model(args.model)
    dtype = args.dtype
    if dtype is None:
        level = (quant_level or "").upper()
        dtype = _QUANT_LEVELS.get(level) or ("int4" if level.startswith("Q4") else "auto")
    w = weight_bytes(spec, dtype)
    return float(w.read_per_token), f"{spec.name} at {w.dtype}: weights read per token"


def measure(args: argparse.Namespace) -> Measurements:
    """Validate, probe the server and add the ceiling's inputs."""
    _check(args)
    bandwidth, bw_source = _bandwidth(args)
    if args.model is not None:
        load_model(args.model)  # a bad --model fails before any request is sent
    headers = parse_headers(args.header, args.api_key or default_api_key())
    cfg = ProbeConfig(
        url=args.url, headers=headers, model=args.model_name, short_len=args.short_len,
        long_len=args.long_len, stream_output=args.output_len, timeout_s=args.timeout,
        token_ids=True if args.token_ids else None, vocab_size=args.vocab_size,
        seed=args.seed, ttft_target_s=args.ttft_target,
    )
    m = collect(cfg)
    if args.model is not None:
        m.model_bytes, m.model_bytes_source = _model_bytes(args, m.quantization_level)
    m.bandwidth_bytes_s, m.bandwidth_source = bandwidth, bw_source
    return m


def _finite(x: Any) -> Any:
    """NaN and infinities as null: JSON has no such numbers."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    """Print the diagnosis; 2 and one line on stderr when it cannot be made."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe request
    try:
        m = measure(args)
    except (DoctorError, PlanInputError, ValueError, httpx.HTTPError) as e:
        print(f"tandem doctor: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a server answering in ways nobody foresaw: still one line
        print(f"tandem doctor: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    findings = diagnose(m)
    if args.json:
        print(json.dumps(_finite({
            "measurements": m.to_dict(), "findings": [asdict(f) for f in findings],
            "verdict": verdict(findings)}), indent=2))
    else:
        print(format_report(m, findings))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m tandem.tools.doctor.cli``)."""
    parser = argparse.ArgumentParser(prog="tandem doctor", description=DESCRIPTION)
    add_arguments(parser)
    one_line_errors(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
