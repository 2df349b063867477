"""``tandem plan``: the capacity plan from the command line.

Every value is taken as a string and validated here, so bad input ends in one
line on stderr and exit code 2 (argparse's own usage dump is two lines and
would not say which rule was broken), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from tandem.config import parse_bytes as engine_bytes
from tandem.tools.cli_errors import one_line_errors
from tandem.tools.plan.arithmetic import KV_DTYPES, WEIGHT_DTYPES
from tandem.tools.plan.capacity import plan
from tandem.tools.plan.devices import DEVICES, Device, get_device, measure_host
from tandem.tools.plan.presets import PRESETS
from tandem.tools.plan.readers import load_model
from tandem.tools.plan.report import format_report

_UNITS = {
    "": 1e9, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
    "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?b?)\s*(/\s*s)?\s*$", re.I)


class PlanInputError(ValueError):
    """Input the user can fix; printed as one line, exit code 2."""


def parse_bytes(text: str, what: str, *, rate: bool = False) -> float:
    """ "80GB", "24GiB", "512 MiB", "3.35TB/s"; a plain number means GB (or GB/s)."""
    m = _SIZE.match(text)
    if not m or (m.group(3) and not rate):
        unit = "GB/s" if rate else "GB"
        raise PlanInputError(
            f"{what}: cannot read {text!r} (examples: 80GB, 24GiB, or a plain number in {unit})"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise PlanInputError(f"{what} must be positive, got {text!r}")
    return value


def _number(text: str | None, what: str, *, integer: bool = False, zero: bool = False) -> Any:
    if text is None:
        return None
    try:
        v: float = int(text) if integer else float(text)
    except ValueError:
        kind = "a whole number" if integer else "a number"
        raise PlanInputError(f"{what} must be {kind}, got {text!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise PlanInputError(f"{what} must be positive, got {text!r}")
    return v


DESCRIPTION = (
    "Capacity plan for serving a model on a device: weight and KV bytes, cache tokens, "
    "conversations that fit, the decode ceiling, the concurrency in flight and the settings "
    "for tandem, vLLM, llama-server and Ollama."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?",
        help=f"a preset ({', '.join(PRESETS)}), an HF config.json, a model directory, or a GGUF",
    )
    p.add_argument("--model", dest="model_opt", metavar="MODEL", help="same as the positional")
    p.add_argument(
        "--dtype", default="auto", metavar="DTYPE",
        help=f"weights: {', '.join(WEIGHT_DTYPES)} (auto: the checkpoint's, fp32 for a 16-bit one "
        "on a CPU device, as tandem holds it there; file: GGUF as stored)",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", metavar="DTYPE",
        help=f"KV cache: {', '.join(KV_DTYPES)} (auto: tandem's: 16 bits on CPU, bf16 with "
        "AVX512_BF16 else fp16; on a GPU the "
        "weights' 16 bits, bf16 for quantized weights, fp32 with fp32 weights)",
    )
    p.add_argument("--device", help=f"a device preset: {', '.join(DEVICES)}")
    p.add_argument("--memory", help="device memory, e.g. 80GB, 24GiB (a plain number: GB)")
    p.add_argument("--bandwidth", help="memory read bandwidth, e.g. 900, 3.35TB/s (plain: GB/s)")
    p.add_argument(
        "--kind", default=None, metavar="{gpu,cpu}",
        help="what --memory/--bandwidth describe (default gpu; cpu: no utilization fraction)",
    )
    p.add_argument("--tflops", help="dense compute peak in TFLOP/s (for the batching roof)")
    p.add_argument(
        "--measure", action="store_true",
        help="probe this machine: memory size and read bandwidth (the GPU if torch sees one)",
    )
    p.add_argument("--context", help="tokens per conversation (default: min(8192, the model's))")
    p.add_argument(
        "--gpu-memory-utilization",
        help="fraction of device memory to use (default 0.92 on GPU, 1.0 on CPU)",
    )
    p.add_argument("--reserve", help="memory held back for everything else (default: CPU 2GiB)")
    p.add_argument("--users", help="chat users (with idle time between turns)")
    p.add_argument("--gen-seconds", help="seconds one reply takes to generate (default 12)")
    p.add_argument("--turn-seconds", help="seconds between a user's turns (default 90)")
    p.add_argument("--streams", help="streams that never idle (agents, batch jobs)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    g = p.add_argument_group("engine check")
    g.add_argument(
        "--engine-check", action="store_true",
        help="start tandem's engine on the model (a GGUF file, an HF directory, a config.json "
        "with random weights, or none for the default model) and compare the planned KV "
        "bytes per token and cache tokens with the pool it allocates; exit 1 if they differ "
        "by more than 5%%. With a device, the full plan (in the engine's dtypes) comes first",
    )
    g.add_argument(
        "--kv-cache-memory", metavar="BYTES",
        help="the KV budget both sides use, e.g. 256MiB (default: tandem's, 2 GiB on CPU; "
        "on CUDA --gpu-memory-utilization)",
    )


def register(subparsers: Any) -> None:
    """Add ``plan`` to the main CLI's subparsers."""
    p = subparsers.add_parser(
        "plan",
        help="capacity plan: memory, KV cache, decode ceiling, concurrency, settings",
        description=DESCRIPTION,
    )
    add_arguments(p)
    one_line_errors(p)
    p.set_defaults(func=run)


def _device(args: argparse.Namespace) -> Device:
    custom = args.memory is not None or args.bandwidth is not None
    chosen = sum(bool(x) for x in (args.device, custom, args.measure))
    if chosen > 1:
        raise PlanInputError("give one of --device, --memory with --bandwidth, or --measure")
    if chosen == 0:
        raise PlanInputError(
            f"no device: give --device ({', '.join(DEVICES)}), or --memory and --bandwidth, "
            "or --measure"
        )
    if args.kind is not None and (args.kind not in ("gpu", "cpu") or not custom):
        raise PlanInputError("--kind is gpu or cpu, and only describes --memory/--bandwidth")
    tflops = _number(args.tflops, "--tflops")
    if args.device:
        dev = get_device(args.device)
    elif args.measure:
        dev = measure_host()
    else:
        if args.memory is None or args.bandwidth is None:
            raise PlanInputError("--memory and --bandwidth go together")
        dev = Device(
            id="custom",
            name="custom device",
            kind=args.kind or "gpu",
            memory_bytes=int(parse_bytes(args.memory, "--memory")),
            bandwidth_bytes_s=parse_bytes(args.bandwidth, "--bandwidth", rate=True),
        )
    if tflops is not None:
        dev = dataclasses.replace(dev, peak_flops=tflops * 1e12)
    return dev


def build_plan(args: argparse.Namespace) -> Any:
    """Validate the arguments and compute the plan (PlanInputError/ValueError on bad input)."""
    if args.model and args.model_opt and args.model != args.model_opt:
        raise PlanInputError("give the model once (positional or --model)")
    ref = args.model or args.model_opt
    if not ref:
        raise PlanInputError(f"no model: give a preset ({', '.join(PRESETS)}) or a path")
    if args.dtype not in WEIGHT_DTYPES:
        raise PlanInputError(f"--dtype {args.dtype!r}: choose from {', '.join(WEIGHT_DTYPES)}")
    if args.kv_cache_dtype.lower() not in KV_DTYPES:
        raise PlanInputError(
            f"--kv-cache-dtype {args.kv_cache_dtype!r}: choose from {', '.join(KV_DTYPES)}"
        )
    context = _number(args.context, "--context", integer=True)
    util = _number(args.gpu_memory_utilization, "--gpu-memory-utilization")
    reserve = None
    if args.reserve is not None:
        reserve = 0.0 if args.reserve.strip() in ("0", "0.0") else parse_bytes(
            args.reserve, "--reserve"
        )
    users = _number(args.users, "--users")
    gen = _number(args.gen_seconds, "--gen-seconds")
    turn = _number(args.turn_seconds, "--turn-seconds")
    streams = _number(args.streams, "--streams", integer=True)
    spec = load_model(ref)  # first: a mistyped model is the error to report, before any probe
    device = _device(args)
    return plan(
        spec, device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, context=context,
        gpu_memory_utilization=util, reserve_bytes=reserve, users=users, gen_seconds=gen,
        turn_seconds=turn, streams=streams,
    )


def _has_device(args: argparse.Namespace) -> bool:
    return bool(args.device or args.measure or args.memory is not None
                or args.bandwidth is not None)


def run_engine_check(args: argparse.Namespace) -> int:
    """Start the engine, compare, and (given a device) print the plan in its dtypes."""
    from tandem.tools.plan.engine_check import check_engine, format_check

    if args.model and args.model_opt and args.model != args.model_opt:
        raise PlanInputError("give the model once (positional or --model)")
    ref = args.model or args.model_opt
    memory = None
    if args.kv_cache_memory is not None:  # the engine's flag, read as serve reads it
        try:
            memory = engine_bytes(args.kv_cache_memory)
        except ValueError as e:
            raise PlanInputError(f"--kv-cache-memory: {e}") from None
    context = _number(args.context, "--context", integer=True)
    util = _number(args.gpu_memory_utilization, "--gpu-memory-utilization")
    if util is not None and not 0 < util <= 1:
        raise PlanInputError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if _has_device(args):
        _device(args)  # bad device flags fail before the model loads
    chk = check_engine(
        ref, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=memory,
        context=context, gpu_memory_utilization=util or 0.92,
    )
    p = None
    if _has_device(args):
        from tandem.tools.plan.engine_check import resolve_engine_model

        args.model, args.model_opt = resolve_engine_model(ref)[2], None
        args.dtype, args.kv_cache_dtype = chk.weight_dtype, chk.kv_cache_dtype
        args.context = str(context or chk.max_model_len)
        p = build_plan(args)
    if args.json:
        out: dict[str, Any] = {"engine_check": chk.to_dict()}
        if p is not None:
            out["plan"] = p.to_dict()
        print(json.dumps(out, indent=2))
    else:
        if p is not None:
            print(format_report(p) + "\n")
        print(format_check(chk))
    return 0 if chk.ok else 1


def run(args: argparse.Namespace) -> int:
    """Print the plan (text or JSON); 2 and one line on stderr for bad input."""
    if getattr(args, "engine_check", False):
        try:
            return run_engine_check(args)
        except ValueError as e:
            print(f"tandem plan: error: {e}", file=sys.stderr)
            return 2
    if getattr(args, "kv_cache_memory", None) is not None:
        print("tandem plan: error: --kv-cache-memory goes with --engine-check (the plan "
              "itself sizes the cache from --memory or --device)", file=sys.stderr)
        return 2
    try:
        p = build_plan(args)
    except ValueError as e:  # PlanInputError and the library's validation
        print(f"tandem plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p.to_dict(), indent=2))
    else:
        print(format_report(p))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m tandem.tools.plan.cli``)."""
    parser = argparse.ArgumentParser(prog="tandem plan", description=DESCRIPTION)
    add_arguments(parser)
    one_line_errors(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or an unknown flag (2)
        return int(e.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
