"""Capacity arithmetic: back-of-the-envelope serving calculations, as pure functions.

Everything here is arithmetic on a model's shape and a device's two numbers
(bytes held, bytes read per second), so every result can be shown as a formula
with the numbers filled in and checked by hand. Stated assumptions:

* Weights. fp32 = 4 B, bf16/fp16 = 2 B per parameter. int8 stores each matmul
  weight in 1 B plus one fp32 scale per output channel; int4 packs two weights
  per byte plus an fp16 scale and an fp16 zero point per group of 32 inputs
  (5 bits per weight, like GGUF Q4_1). Quantization covers the matmuls (q, k,
  v, o, gate, up, down and the LM head); norms and biases stay 16-bit. An
  untied input embedding stays 16-bit: decode gathers one row of it per token,
  so quantizing it saves memory but no bandwidth. A tied embedding is the LM
  head and is quantized with it (one copy). ``file`` (GGUF only) uses the
  tensors' bytes as stored.
* Bytes read per decode step = all weights except an untied input embedding
  (a row lookup, not a full read), plus the KV cache of the context so far.
* KV per token = 2 x layers x kv_heads x head_dim x bytes per element. 16-bit
  is 2 B; fp8 is 1 B (one scale per tensor, negligible); int8 is tandem's
  layout (``Int8KVCache``): 1 B plus one fp32 scale per token and head, i.e.
  1 + 4 / head_dim B (1.0625 B at head_dim 64, 1.03125 B at 128); q8_0 is
  llama.cpp's: 1 B plus an fp16 scale per 32 elements = 1.0625 B. ``auto``
  is tandem's own cache on the device (``resolve_kv_dtype``): fp32 and
  quantized weights give 16 bits on CPU (bf16 where the planning machine's CPU
  has AVX512_BF16, else fp16: the same bytes), fp32 weights fp32 on a GPU,
  anything else 16-bit.
* Memory for the cache = memory x utilization - reserve - weights - the
  activation peak of one step (what the engine's warm-up would measure).
  GPUs default to utilization 0.92 and no reserve (vLLM's default); CPUs to
  all of memory minus a 2 GiB reserve for the OS, Python, torch and the server.
* Cache is allocated in blocks of 16 tokens (tandem's default), and a
  full-context conversation holds ceil(context / 16) blocks. A model that
  mixes full-attention and sliding-window layers (Gemma 2/3) splits them into
  the engine's KV cache groups (tandem.core.kv_cache_utils.group_layers): a
  block is 16 tokens of one group's layers, and a windowed group holds only
  its window and one step's chunk (``KVCacheGroups.blocks_for``), as
  tandem's, vLLM's and llama.cpp's caches do.
* A decode step reads the weights once for the whole batch and each
  sequence's KV; it takes max(bytes / bandwidth, FLOPs / (50% of peak)). KV
  reads are counted at the full context (the end of a conversation: the
  conservative case), a windowed layer's at its window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.config import DTYPE_SHORT_NAMES, EngineConfig, resolve_kv_cache_dtype
from tandem.config import resolve_dtype as resolve_engine_dtype
from tandem.core.kv_cache_utils import KVCacheGroups, group_layers
from tandem.tools.plan.devices import GiB
from tandem.tools.plan.model_spec import ModelSpec

WEIGHT_DTYPES = ("auto", "fp32", "bf16", "fp16", "int8", "int4", "file")
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "16bit", "fp8", "int8", "8bit", "q8_0")
INT4_GROUP = 32
KV8_GROUP = 32
KV8_DTYPES = ("int8", "fp8", "q8_0")
# The engine's float dtype names (tandem.config's --dtype) in the planner's.
PLANNER_DTYPES = DTYPE_SHORT_NAMES
# ... and the planner's float dtypes as the engine's --dtype names them.
ENGINE_DTYPES = {v: k for k, v in PLANNER_DTYPES.items()}
BLOCK_SIZE = EngineConfig.block_size
DEFAULT_GPU_UTILIZATION = EngineConfig.gpu_memory_utilization
DEFAULT_CPU_RESERVE = 2 * GiB
COMPUTE_EFFICIENCY = 0.5  # fraction of peak FLOPs a real step reaches
PREFILL_BUDGET = {"gpu": 2048, "cpu": 512}  # without a compute peak to size it by
CHUNK_STALL_S = 0.25  # a prefill chunk may hold running streams back this long


@dataclass(frozen=True)
class WeightBytes:
    total: int  # resident in memory
    read_per_token: int  # read by each decode step
    embedding: int  # untied input embedding (resident, not read per step); 0 if tied
    dtype: str


def dense_bytes(dtype: str) -> int:
    """Bytes per element of what is not quantized (norms, biases, embeddings)."""
    return 4 if dtype == "fp32" else 2


def linear_bytes(n_in: int, n_out: int, dtype: str) -> int:
    """Bytes of one n_in x n_out matmul weight, quantization scales included."""
    n = n_in * n_out
    if dtype == "fp32":
        return 4 * n
    if dtype in ("bf16", "fp16"):
        return 2 * n
    if dtype == "int8":
        return n + 4 * n_out  # fp32 scale per output channel
    if dtype == "int4":
        groups = math.ceil(n_in / INT4_GROUP) * n_out
        return math.ceil(n / 2) + 4 * groups  # fp16 scale + fp16 zero per group
    raise ValueError(f"unknown weight dtype {dtype!r}")


def resolve_dtype(spec: ModelSpec, dtype: str) -> str:
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}; choose from {', '.join(WEIGHT_DTYPES)}")
    if dtype == "auto":
        return spec.default_dtype
    if dtype == "file" and spec.file_weight_bytes is None:
        raise ValueError("--dtype file needs a GGUF model (it counts the tensors as stored)")
    return dtype


def weight_bytes(spec: ModelSpec, dtype: str) -> WeightBytes:
    """Resident weight bytes and the bytes one decode step reads."""
    dtype = resolve_dtype(spec, dtype)
    if dtype == "file":
        assert spec.file_weight_bytes is not None
        emb = 0 if spec.tie_word_embeddings else (spec.file_embedding_bytes or 0)
        return WeightBytes(spec.file_weight_bytes, spec.file_weight_bytes - emb, emb, dtype)
    small = sum(spec.small_params().values()) * dense_bytes(dtype)
    matmuls = sum(linear_bytes(x.n_in, x.n_out, dtype) * x.count for x in spec.linears())
    emb = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size * dense_bytes(dtype)
    total = matmuls + small + emb
    return WeightBytes(total, total - emb, emb, dtype)


def engine_compute_dtype(device_kind: str) -> str:
    """What tandem's engine computes in with --dtype auto on a ``device_kind``
    ("gpu" or "cpu") device, in the planner's names (tandem.config.resolve_dtype)."""
    return PLANNER_DTYPES[resolve_engine_dtype("auto", "cpu" if device_kind == "cpu" else "cuda")]


def resolve_kv_dtype(kv_cache_dtype: str, weight_dtype: str, device_kind: str) -> str:
    """Normalise the KV dtype name; ``auto`` is what tandem's engine holds with
    these weights on a ``device_kind`` device: the dtype it computes in (float
    weights' own, quantized ones' engine_compute_dtype), with 16 bits in place
    of fp32 on CPU (tandem.config.resolve_kv_cache_dtype: bf16 or fp16 by this
    machine's CPU, 2 bytes either way)."""
    kv = kv_cache_dtype.lower()
    if kv not in KV_DTYPES:
        raise ValueError(
            f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose from {', '.join(KV_DTYPES)}"
        )
    if kv == "auto":
        compute = weight_dtype if weight_dtype in PLANNER_DTYPES.values() else (
            engine_compute_dtype(device_kind))
        return resolve_kv_cache_dtype("auto", "cpu" if device_kind == "cpu" else "cuda", compute)
    return {"16bit": "bf16", "8bit": "int8"}.get(kv, kv)


def kv_element_bytes(kv_dtype: str, head_dim: int) -> float:
    """Bytes per cached K or V element, scales included.

    int8 is tandem's own cache (an fp32 scale per token and head, so the
    overhead depends on head_dim); q8_0 is llama.cpp's (fp16 per 32 elements).
    """
    return {
        "fp32": 4.0,
        "bf16": 2.0,
        "fp16": 2.0,
        "fp8": 1.0,
        "int8": 1.0 + 4.0 / head_dim,
        "q8_0": 1.0 + 2.0 / KV8_GROUP,
    }[kv_dtype]


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: float
) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes


def activation_bytes(spec: ModelSpec, batched_tokens: int, act_bytes: int, logit_rows: int) -> int:
    """Peak activation memory of one step of ``batched_tokens`` tokens.

    The widest live set inside a layer (residual, normed input, q/k/v, gate and
    up, their product) plus fp32 logits for the rows that are sampled. Small
    next to the weights, but it is what the engine's warm-up subtracts.
    """
    h, i = spec.hidden_size, spec.intermediate_size
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_token = 2 * h + qkv + 3 * i
    return batched_tokens * per_token * act_bytes + logit_rows * spec.vocab_size * 4


def kv_groups(spec: ModelSpec, context: int, hybrid: bool = True) -> KVCacheGroups:
    """The engine's KV cache groups for this model at this longest context (one
    of every layer unless it mixes full-attention layers with windowed ones
    whose window hides keys of such a context)."""
    return group_layers(spec.layer_windows or (0,) * spec.num_layers, hybrid, context)


def cache_blocks(
    cache_bytes: float, kv_per_token: float, block_size: int = BLOCK_SIZE,
    groups: KVCacheGroups | None = None, num_layers: int = 1,
) -> tuple[int, int]:
    """(whole blocks, tokens of every layer) that fit in ``cache_bytes`` (0 if
    negative). With ``groups``, a block holds one group's ``group_size`` of the
    ``num_layers`` layers, as the engine's pool does."""
    size, layers = (1, 1) if groups is None else (groups.group_size, num_layers)
    if cache_bytes <= 0:
        return 0, 0
    blocks = int(cache_bytes // (kv_per_token * size / layers * block_size))
    return blocks, blocks * block_size * size // layers


def decode_ceiling(bandwidth_bytes_s: float, bytes_per_token: float) -> float:
    """Single-stream tokens/s when every step must read ``bytes_per_token``."""
    return bandwidth_bytes_s / bytes_per_token


def in_flight(users: float, gen_seconds: float, turn_seconds: float) -> float:
    """Streams generating at once: users x share of their time spent generating."""
    return users * gen_seconds / turn_seconds


def recommend_max_num_seqs(
    load: float, fits: int, *, bursty: bool, users: float | None = None
) -> tuple[int, int]:
    """(wanted, recommended) sequence cap.

    Chat users arrive at random, so the number in flight is roughly Poisson
    around its mean: mean + 2 standard deviations (~98% of moments) is
    "slightly above" and still small. Agents and batch jobs never idle, so
    they need exactly their stream count. The cache caps it: past what fits at
    full context the engine would preempt instead of serve.
    """
    if bursty:
        wanted = max(1, math.ceil(load + 2 * math.sqrt(load)))
        if users is not None:
            wanted = min(wanted, max(1, math.ceil(users)))
    else:
        wanted = max(1, math.ceil(load))
    return wanted, min(wanted, fits)


def decode_flops_per_token(spec: ModelSpec, context: int) -> float:
    """2 x matmul weights + attention over ``context`` keys (QK and PV; a
    windowed layer's over its window)."""
    matmul = sum(x.params for x in spec.linears())
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * spec.attended_keys(context)
    return 2 * matmul + attention


def prefill_flops(spec: ModelSpec, prompt_tokens: int) -> float:
    """A prompt's prefill: matmuls for every token plus causal attention (~C^2)."""
    matmul = sum(x.params for x in spec.linears())
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * spec.causal_pairs(
        prompt_tokens)
    return 2 * matmul * prompt_tokens + attention


def decode_step(
    batch: int,
    weights_read: float,
    kv_per_token: float,
    kv_tokens: float,
    bandwidth: float,
    flops_per_token: float,
    peak_flops: float | None,
) -> tuple[float, str]:
    """(seconds, "memory"|"compute") for one decode step of ``batch`` sequences,
    each reading ``kv_tokens`` tokens of KV (ModelSpec.attended_keys)."""
    mem = (weights_read + batch * kv_per_token * kv_tokens) / bandwidth
    if peak_flops is None:
        return mem, "memory"
    comp = batch * flops_per_token / (COMPUTE_EFFICIENCY * peak_flops)
    return (mem, "memory") if mem >= comp else (comp, "compute")


def choose_batched_tokens(
    eff_flops: float | None, flops_per_token: float, decode_step_s: float, kind: str
) -> int:
    """The per-step token budget (--max-num-batched-tokens).

    A prefill chunk of B tokens holds every running stream back for about
    B x FLOPs/token / effective FLOP/s. Pick the largest power of two whose
    chunk costs at most max(0.25 s, 2 decode steps): a brief hiccup in the
    stream rather than a stall, while prefill still runs in large, efficient
    matmuls. Clamped to [64, 8192]; without a compute peak, 2048 on GPU (vLLM's
    long-standing default) and 512 on CPU.
    """
    if not eff_flops:
        return PREFILL_BUDGET["gpu" if kind == "gpu" else "cpu"]
    target = max(CHUNK_STALL_S, 2 * decode_step_s)
    tokens = target * eff_flops / flops_per_token
    budget = 64
    while budget * 2 <= min(tokens, 8192):
        budget *= 2
    return budget
