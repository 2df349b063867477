"""EngineConfig: every engine knob in one validated place.

User input is checked here, at the edge, with a ValueError that names the
flag; the engine's internals may then rely on these invariants.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# Weight formats of the layer matmuls (tandem.model.linear; "auto" is
# tandem.model.loader.fuse_weights' rule for a GGUF's own formats).
QUANTIZATIONS = ("none", "int8", "int4", "auto")
# --kv-cache-dtype's choices; "auto" resolves to one of the others (or bf16 on
# CUDA) by resolve_kv_cache_dtype, the one rule for engine, planner and checks.
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8")
# The float dtypes: --dtype's names (torch's own) -> the short names the KV
# cache and the planner use. One policy for engine, cache and planner.
DTYPE_SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def resolve_dtype(dtype: str, device_type: str) -> str:
    """The engine's compute dtype ("float32", "bfloat16" or "float16") for --dtype
    on a device: auto is float32 on CPU (bf16 matmuls are far slower than fp32 on
    CPUs without AMX), bfloat16 on CUDA."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_type == "cuda" else "float32"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty elsewhere):
    what tandem's ``-march=native`` kernels are built for."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024  # the file says kB, it means KiB
    except OSError:
        pass
    return out


def _cgroup_memory(root: Path = Path("/sys/fs/cgroup"),
                   self_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int, int] | None:
    """(limit, usage) bytes of the tightest memory cap on this process's cgroup
    and its ancestors (a container's, or a systemd unit's MemoryMax=, which sits
    below the hierarchy's root), which beats the host's RAM size; usage without
    the inactive page cache the kernel reclaims first (docker's figure). None
    without a cap."""
    best: tuple[int, int] | None = None
    for d, v2 in _cgroup_dirs("memory", root, self_cgroup):
        files, inactive = ((("memory.max", "memory.current"), "inactive_file") if v2 else
                           (("memory.limit_in_bytes", "memory.usage_in_bytes"),
                            "total_inactive_file"))
        try:
            limit, usage = ((d / f).read_text().strip() for f in files)
        except OSError:
            continue
        if not (limit.isdigit() and int(limit) < 1 << 60 and usage.isdigit()):
            continue  # "max" or a huge sentinel: no cap
        if best is not None and int(limit) >= best[0]:
            continue
        try:
            stat = dict(line.split()[:2] for line in (d / "memory.stat").read_text().splitlines())
        except (OSError, ValueError):
            stat = {}
        best = int(limit), int(usage) - int(stat.get(inactive, 0))
    return best


def host_memory() -> tuple[int, int | None]:
    """(total, available) bytes of host memory; under a cgroup's cap, the cap and
    what is left under it."""
    info = _meminfo()
    total = info.get("MemTotal")
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = info.get("MemAvailable")
    cgroup = _cgroup_memory()
    if cgroup is not None and cgroup[0] < total:
        total, left = cgroup[0], max(cgroup[0] - cgroup[1], 0)
        available = min(available, left) if available is not None else left
    return total, available


def resolve_kv_cache_dtype(kv_cache_dtype: str, device_type: str, compute_dtype: str, *,
                           cpu_bf16: bool | None = None) -> str:
    """The KV cache's element type ("fp32", "bf16", "fp16" or "int8") for
    --kv-cache-dtype on a device whose engine computes in ``compute_dtype``
    ("fp32", "bf16" or "fp16").

    auto is the engine's own dtype (vLLM's rule), except fp32 on CPU, which
    stores 16-bit floats: half the bytes, so twice the tokens fit in the pool
    and decode attention reads half, at no measured quality cost (the eval
    text's NLL equal to 3 decimals, fp32 weights) and faster even at short
    contexts. bf16 where the CPU multiplies it (AVX512_BF16): its prefill and
    decode attention are faster than the fp16 cache's; fp16 (llama.cpp's and
    Ollama's default cache) elsewhere.

    ``cpu_bf16``: whether the CPU kernels in use multiply bf16, which the
    engine knows once it has loaded them (a g++ that does not know the
    instructions builds them without); None takes the CPU's own flag, the
    planner's estimate for a machine like this one.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if device_type == "cpu" and compute_dtype == "fp32":
        if cpu_bf16 is None:
            cpu_bf16 = "avx512_bf16" in cpu_flags()
        return "bf16" if cpu_bf16 else "fp16"
    return compute_dtype

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MB', '1.5g', '1e9' or a plain number of bytes -> bytes (at least 1)."""
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = _SIZE_RE.match(value)
        unit = (m.group(2) or "").lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot parse memory size {value!r} (examples: 2GiB, 512MB, 1e9)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:  # 0.5 is positive but no whole byte
        raise ValueError(f"memory size must be at least 1 byte, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """A size as people read it: '1.35 GiB', '512 MiB', '16 KiB', '100 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 else \
                f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def available_cpus() -> int:
    """CPUs this process can actually use: its affinity mask (taskset, cpusets),
    capped by a cgroup CPU quota (docker --cpus, Kubernetes limits).

    OpenMP and torch count the affinity mask only. A quota is rounded down: 2
    threads under a 1.5-CPU quota are throttled for part of every period, which
    stalls every stream, while 1 thread never is.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return cpus


def default_threads() -> int:
    """The model's CPU threads when not given: torch's count (the physical cores of
    the affinity mask, or what the caller set with torch.set_num_threads) capped
    by available_cpus, which alone sees a cgroup quota."""
    import torch

    return max(1, min(torch.get_num_threads(), available_cpus()))


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"),
                     self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its ancestors,
    v2 (cpu.max) or v1 (cpu.cfs_quota_us / cpu.cfs_period_us); None if unlimited."""
    quotas = [q for d, v2 in _cgroup_dirs("cpu", root, self_cgroup)
              if (q := _read_quota(d, ("cpu.max",) if v2 else
                                   ("cpu.cfs_quota_us", "cpu.cfs_period_us"))) is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(controller: str, root: Path, self_cgroup: Path) -> Iterator[tuple[Path, bool]]:
    """(directory, is v2) of this process's cgroup and each ancestor up to the
    hierarchy's root, in each hierarchy that holds ``controller``: the unified v2
    one (under unified/ on hybrid hosts) and a v1 one mounted by its name. In a
    container the root is the container's own cgroup; a path that the mount does
    not show (v1 without a cgroup namespace) is skipped up to it."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
        elif controller in controllers.split(","):
            base = next((root / d for d in (controllers, controller, f"{controller},cpuacct")
                         if (root / d).is_dir()), None)
            if base is None:
                continue
        else:
            continue
        d = base / path.lstrip("/")
        while True:
            yield d, controllers == ""
            if d == base or base not in d.parents:
                break
            d = d.parent


def _read_quota(d: Path, files: tuple[str, ...]) -> float | None:
    try:
        if len(files) == 1:  # "max 100000" or "150000 100000"
            quota, period = (d / files[0]).read_text().split()[:2]
        else:
            quota, period = ((d / f).read_text().strip() for f in files)
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return int(quota) / int(period)


def _flag(default: Any, help: str, *, choices: tuple | None = None, type: type | None = None,
          minimum: int | None = None, flags: tuple[str, ...] | None = None) -> Any:
    """A field that is also a command-line flag: the CLI is generated from these
    (entrypoints/cli.py), and ``EngineConfig`` checks choices and minimums, so
    a default, a help text or a valid range is written once."""
    return field(default=default, metadata={
        "help": help, "choices": choices, "type": type, "minimum": minimum, "flags": flags})


def flag_names(f: Any) -> tuple[str, ...]:
    """The command-line spellings of a config field (vLLM's: --max-num-seqs)."""
    return f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)


def cli_fields(cls: type) -> list[Any]:
    """The dataclass fields that are command-line flags."""
    return [f for f in fields(cls) if "help" in f.metadata]


@dataclass
class EngineConfig:
    """Model, cache and scheduler settings (vLLM's flag names, snake_cased).

    model: a GGUF file, an HF model directory (config.json + *.safetensors),
        or None for the embedded default (SmolLM2-135M-Instruct).
    kv_cache_memory: CPU KV pool budget in bytes (or '2GiB'); on CUDA the pool
        is sized from gpu_memory_utilization unless this is given.
    max_num_batched_tokens: the per-step token budget. Small protects
        inter-token latency (a prefill chunk delays every stream by its cost),
        large protects time to first token. None picks a device default.
    num_threads: CPU threads for the model's parallel ops; None =
        default_threads(), and adaptive_threads: the serving engine uses fewer
        while other processes take CPUs.
    """

    model: str | None = _flag(
        None, "GGUF file or HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    load_format: str = _flag(
        "auto", "dummy = random weights for the model's config.json (benchmarking)",
        choices=("auto", "gguf", "hf", "dummy"))
    dtype: str = _flag(
        "auto", "auto = float32 on CPU (bf16 matmuls are very slow there), bfloat16 on CUDA",
        choices=("auto", *DTYPE_SHORT_NAMES))
    device: str = _flag("auto", "where the model runs", choices=("auto", "cpu", "cuda"))
    quantization: str = _flag(
        "auto", "weight quantization of the layer matmuls: fewer bytes read per decode step "
        "(int8: per-channel weights, activations in groups of 32; int4: groups of 32; auto: "
        "a GGUF's own formats, Q8_0 as int8, Q4_0/Q4_1/Q4_K as int4, other block formats as "
        "int8 groups; float weights stay float)",
        choices=QUANTIZATIONS, flags=("--quantization", "-q"))
    seed: int = _flag(0, "seed of dummy weights and of the draws of requests without a seed "
                      "of their own (vLLM's): the same requests in the same order sample "
                      "the same tokens in every run")
    max_model_len: int | None = _flag(
        None, "context window (prompt + output); longer requests get an error, never a "
        "silently truncated prompt", type=int, minimum=2)
    block_size: int = _flag(16, "tokens per KV cache block",
                            choices=(1, 2, 4, 8, 16, 32, 64, 128))
    kv_cache_memory: int | str | None = _flag(
        None, "KV pool size, e.g. 2GiB (CPU default 2GiB; on CUDA the default comes from "
        "--gpu-memory-utilization)", type=str)
    kv_cache_dtype: str = _flag(
        "auto", "auto: on CPU bf16 where it multiplies bf16 natively (AVX512_BF16), else fp16 "
        "(llama.cpp's default f16 cache); either holds half fp32's bytes, so 2x the tokens in "
        "the same memory; the engine's dtype on CUDA; fp32: exact K/V on CPU; "
        "int8: K/V int8 with a scale per token and head, ~1.9x fp16's tokens",
        choices=KV_CACHE_DTYPES)
    gpu_memory_utilization: float = _flag(
        0.92, "fraction of GPU memory for weights + KV cache")
    max_num_seqs: int = _flag(64, "most requests in one batch", minimum=1)
    max_num_batched_tokens: int | None = _flag(
        None, "per-step token budget (default: measured from the model's cost on CPU, 8192 "
        "on CUDA): small protects inter-token latency, large protects TTFT", type=int,
        minimum=1)
    enable_chunked_prefill: bool = _flag(
        True, "split long prompts over steps (off: each prompt in one step, which needs a "
        "budget >= max-model-len)")
    enable_prefix_caching: bool = _flag(True, "reuse the KV of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = _flag(
        False, "hold every layer's KV for a request's whole context; by default a model that "
        "mixes sliding-window and full-attention layers (Gemma 2 and 3) releases its windowed "
        "layers' blocks as they slide out of the window (disaggregated replicas set this "
        "flag: their KV hand-off needs it)")
    num_threads: int | None = _flag(
        None, "CPU threads for the model (default: the cores this process may use, from its "
        "affinity mask and cgroup CPU quota; `tandem serve` then uses fewer while other "
        "processes keep CPUs busy; a number fixes it)", type=int, minimum=1,
        flags=("--threads", "--num-threads"))
    # None: when num_threads is not given (AsyncEngine's ThreadTuner)
    adaptive_threads: bool | None = None
    skip_tokenizer_init: bool = False  # a server flag (token-id prompts only)

    def __post_init__(self) -> None:
        for f in cli_fields(type(self)):
            value, meta, flag = getattr(self, f.name), f.metadata, flag_names(f)[0]
            if meta["choices"] is not None and value not in meta["choices"]:
                raise ValueError(f"{flag} must be one of "
                                 f"{', '.join(map(str, meta['choices']))}, got {value!r}")
            if meta["minimum"] is not None and value is not None:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{flag} must be an integer, got {value!r}")
                if value < meta["minimum"]:
                    raise ValueError(f"{flag} must be >= {meta['minimum']}, got {value}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        # torch's generators take a signed 64-bit seed (more: an error after the load)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or \
                not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"--seed must be a 64-bit integer, got {self.seed!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.adaptive_threads is None:
            self.adaptive_threads = self.num_threads is None
        if self.num_threads is None:
            self.num_threads = default_threads()
        elif self.num_threads > available_cpus():
            # Kept (an operator may know better), but said: threads past the CPUs
            # wait on each other, which makes every step many times slower.
            logging.getLogger(__name__).warning(
                "--threads %d exceeds the %d CPUs this process may use: threads will "
                "wait on each other's cores every step", self.num_threads, available_cpus())
