"""One layer's paged KV cache: floats (fp32, bf16 or fp16), or int8 with a scale
per token and head.

Slots are ``block_id * block_size + offset``; dim 1 holds K (0) and V (1). A
step writes all its new K/V with one indexed copy (``write``) and attention
reads a sequence's context back through its slots (``gather``).

The fp16 cache (llama.cpp's default f16, and tandem's on CPUs without
AVX512_BF16) holds half an fp32 cache's bytes per token: on CPU, where the
engine computes in fp32, twice the tokens fit in the same memory and decode
attention reads half the bytes; attention converts what it reads to fp32 (the
kernels with F16C, a load and one instruction per 16 values). The bf16 cache
(tandem's on CPUs with AVX512_BF16) holds as many; attention rounds queries
to bf16, as a bf16 model's are, and the kernels multiply bf16 pairs there.

The int8 cache (like llama-server's ``--cache-type-k q8_0``) stores each
token's K and V per head as int8 plus one fp32 scale (absmax / 127): 2 x heads
x (head_dim + 4) bytes per token and layer instead of 2 x heads x head_dim x 4
(fp32) or x 2 (16-bit), so the same memory holds ~3.8x (vs fp32) or ~1.9x
(vs 16-bit) the tokens. Attention dequantizes what it gathers.
"""

from __future__ import annotations

import torch

from tandem.config import DTYPE_SHORT_NAMES, resolve_kv_cache_dtype
from tandem.kernels import custom_ops
from tandem.model.hugepages import Allocator, HugePageArena


def kv_zeros(device: torch.device) -> Allocator:
    """Allocator of a pool's zeroed tensors: on CPU in huge pages (fresh anonymous
    memory is zero), where decode attention, which reads a sequence's blocks
    from all over the pool, runs faster. Their pages are committed as
    they are first written, or ahead of that by ``LLMEngine.commit_kv_pool``."""
    if device.type == "cpu":
        return HugePageArena().empty
    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


class DenseKVCache:
    """K/V as floats of ``STORED`` (a subclass per dtype); attention reads them
    back in the engine's dtype (``dtype``)."""

    STORED: torch.dtype

    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 zeros: Allocator | None = None) -> None:
        zeros = zeros or kv_zeros(device)
        self.dtype = dtype
        self.data = zeros((num_slots, 2, num_kv_heads, head_dim), self.STORED)

    @classmethod
    def bytes_per_token_layer(cls, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_kv_heads * head_dim * cls.STORED.itemsize

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """kv: [T, 2, Hkv, D] -> the slots."""
        self.data.index_copy_(0, slots, kv.to(self.data.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] slots -> [N, 2, Hkv, D] in the engine's dtype (index_select: far
        cheaper per call than [])."""
        return self.data.index_select(0, slots).to(self.dtype)

    @property
    def kernel_args(self) -> tuple[torch.Tensor, None]:
        """(cache, scales) as tandem's fused kernels take them."""
        return self.data, None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the pool, each indexed by slot in dim 0."""
        return [self.data]


class Fp32KVCache(DenseKVCache):
    STORED = torch.float32


class Bf16KVCache(DenseKVCache):
    STORED = torch.bfloat16


class Fp16KVCache(DenseKVCache):
    STORED = torch.float16


class Int8KVCache:
    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 zeros: Allocator | None = None) -> None:
        zeros = zeros or kv_zeros(device)
        self.q = zeros((num_slots, 2, num_kv_heads, head_dim), torch.int8)
        self.scale = zeros((num_slots, 2, num_kv_heads, 1), torch.float32)
        self.dtype = dtype

    @staticmethod
    def bytes_per_token_layer(num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_kv_heads * (head_dim + 4)

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        kv = kv.float()
        scale = kv.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127.0
        self.q.index_copy_(0, slots, torch.round(kv / scale).to(torch.int8))
        self.scale.index_copy_(0, slots, scale)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        q = self.q.index_select(0, slots)
        return (q.to(torch.float32) * self.scale.index_select(0, slots)).to(self.dtype)

    @property
    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scale

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the pool, each indexed by slot in dim 0 (values, scales)."""
        return [self.q, self.scale]


KVCache = DenseKVCache | Int8KVCache
# One per element type tandem.config.resolve_kv_cache_dtype names.
_CLASSES = {"fp32": Fp32KVCache, "bf16": Bf16KVCache, "fp16": Fp16KVCache, "int8": Int8KVCache}


def kv_cache_dtype_name(kv_cache_dtype: str, device: torch.device, dtype: torch.dtype) -> str:
    """--kv-cache-dtype resolved for an engine computing in ``dtype`` on ``device``:
    on CPU, bf16 only where the kernels as built multiply it."""
    cpu_bf16 = "avx512_bf16" in custom_ops.simd_features() if device.type == "cpu" else None
    compute = DTYPE_SHORT_NAMES[str(dtype).removeprefix("torch.")]
    return resolve_kv_cache_dtype(kv_cache_dtype, device.type, compute, cpu_bf16=cpu_bf16)


def kv_cache_class(name: str) -> type[DenseKVCache] | type[Int8KVCache]:
    """The cache class of a resolved element type (``kv_cache_dtype_name``)."""
    return _CLASSES[name]
