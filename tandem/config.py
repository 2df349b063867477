"""EngineConfig: every engine knob in one validated place.

User input is checked here, at the edge, with a ValueError that names the
flag; the engine's internals may then rely on these invariants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
