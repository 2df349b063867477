"""EngineConfig: every engine knob in one validated place.

User input is checked here, at the edge, with a ValueError that names the
flag; the engine's internals may then rely on these invariants.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

# Weight formats of the layer matmuls (tandem.model.linear; "auto" is
# tandem.model.loader.fuse_weights' rule for a GGUF's own formats).
QUANTIZATIONS = ("none", "int8", "int4", "auto")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MB', '1.5g' or a plain number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value}")
        return int(value)
    m = _SIZE_RE.match(value)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r} (examples: 2GiB, 512MB, 1e9)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return n


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
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy (under unified/ on hybrid hosts)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            files = ("cpu.max",)
        elif "cpu" in controllers.split(","):
            base = next((root / d for d in (controllers, "cpu", "cpu,cpuacct")
                         if (root / d).is_dir()), None)
            if base is None:
                continue
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        d = base / path.lstrip("/")
        while True:
            quota = _read_quota(d, files)
            if quota is not None:
                quotas.append(quota)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(quotas) if quotas else None


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

    model: str | None = None
    load_format: str = "auto"  # auto | gguf | hf | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    # none | int8 | int4 (every layer matmul) | auto (a GGUF's own block formats;
    # float weights stay float).
    quantization: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 (~2x the tokens of 16-bit)
    gpu_memory_utilization: float = 0.92
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    # None: when num_threads is not given (AsyncEngine's ThreadTuner)
    adaptive_threads: bool | None = None
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "gguf", "hf", "dummy"):
            raise ValueError(
                f"--load-format must be auto, gguf, hf or dummy, got {self.load_format!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(
                f"--kv-cache-dtype must be auto or int8, got {self.kv_cache_dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be a power of two <= 128, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.adaptive_threads is None:
            self.adaptive_threads = self.num_threads is None
        if self.num_threads is None:
            self.num_threads = default_threads()
        elif self.num_threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.num_threads}")
