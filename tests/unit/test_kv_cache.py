"""KV cache layouts and paged attention: int8 against fp32, paged against dense."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem import config
from tandem.config import KV_CACHE_DTYPES
from tandem.kernels import custom_ops
from tandem.model.attention import AttentionMetadata, build_group, paged_attention
from tandem.model.hugepages import populate
from tandem.model.kv_cache import (
    Bf16KVCache,
    Fp16KVCache,
    Fp32KVCache,
    Int8KVCache,
    kv_cache_class,
    kv_cache_dtype_name,
)

H, HKV, D, BS = 6, 2, 16, 4
CPU = torch.device("cpu")


def padded_block_table(block_tables: list[list[int]], num_blocks: int) -> torch.Tensor:
    """[B, num_blocks] block ids, each row padded with block 0 (past its context)."""
    return torch.tensor([bt + [0] * (num_blocks - len(bt)) for bt in block_tables])


def test_int8_roundtrip_and_size():
    torch.manual_seed(0)
    dense = Fp32KVCache(64, HKV, D, torch.float32, CPU)
    q8 = Int8KVCache(64, HKV, D, torch.float32, CPU)
    kv = torch.randn(10, 2, HKV, D)
    slots = torch.tensor([3, 7, 8, 9, 20, 21, 40, 41, 42, 63])
    dense.write(slots, kv)
    q8.write(slots, kv)
    torch.testing.assert_close(dense.gather(slots), kv)
    err = (q8.gather(slots) - kv).abs()
    assert (err <= kv.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()  # half a step
    # head_dim 64 (SmolLM2): 68 bytes per head and token vs 256 (fp32) or 128 (bf16).
    q8_bytes = Int8KVCache.bytes_per_token_layer(3, 64)
    assert q8_bytes == 2 * 3 * 68
    assert Fp32KVCache.bytes_per_token_layer(3, 64) / q8_bytes > 3.7
    assert Bf16KVCache.bytes_per_token_layer(3, 64) / q8_bytes > 1.8


def resident_fraction(t: torch.Tensor) -> float:
    """The share of the 4 KiB pages under CPU tensor ``t`` in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    n = t.data_ptr() + t.numel() * t.element_size() - start
    vec = ctypes.create_string_buffer(-(-n // page))
    assert libc.mincore(start, n, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw) / len(vec.raw)


needs_populate = pytest.mark.skipif(sys.platform != "linux" or tuple(
    int(x) for x in re.findall(r"\d+", platform.release())[:2]) < (5, 14),
    reason="MADV_POPULATE_WRITE needs Linux >= 5.14")


@needs_populate
@pytest.mark.parametrize("cache_cls", [Fp16KVCache, Int8KVCache])
def test_populate_commits_a_pool_and_keeps_what_it_holds(cache_cls):
    """A CPU pool's pages fault in as blocks are first written; ``populate``
    (LLMEngine.commit_kv_pool) commits them all ahead of that, contents kept."""
    slots = (64 << 20) // cache_cls.bytes_per_token_layer(8, 64)  # a 64 MiB pool
    cache = cache_cls(slots, 8, 64, torch.float32, CPU)
    kv = torch.randn(3, 2, 8, 64)
    where = torch.tensor([0, 1000, slots - 1])
    cache.write(where, kv)
    held = cache.gather(where)
    tensors = cache.tensors
    assert resident_fraction(tensors[0]) < 0.5
    asked = []
    assert not populate(tensors, lambda left: asked.append(left) or False)
    assert len(asked) == 1 and asked[0] >= sum(t.numel() * t.element_size() for t in tensors)
    assert resident_fraction(tensors[0]) < 0.5
    assert populate(tensors)
    assert all(resident_fraction(t) == 1.0 for t in tensors)
    assert torch.equal(cache.gather(where), held) and held.abs().sum() > 0
    assert cache.gather(torch.tensor([1, 999, slots - 2])).abs().sum() == 0


@pytest.mark.parametrize("built,cpu_auto", [({"avx512f", "avx512_bf16"}, "bf16"),
                                            ({"avx512f"}, "fp16"), (set(), "fp16")])
def test_auto_is_16_bit_on_cpu_and_the_engines_dtype_on_cuda(built, cpu_auto, monkeypatch):
    """One rule resolves --kv-cache-dtype for every device and engine dtype: on
    CPU bf16 where the kernels as built multiply it, else fp16, whatever the
    CPU's flags say (a g++ that does not know AVX512_BF16 builds without it; the
    planner, which loads no kernels, goes by the flags); a choice outside the
    flag's is a ValueError naming them."""
    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(custom_ops, "simd_features", lambda: frozenset(built))
    assert config.resolve_kv_cache_dtype("auto", "cpu", "fp32") == "bf16"
    cpu, cuda = CPU, torch.device("cuda")
    assert kv_cache_dtype_name("auto", cpu, torch.float32) == cpu_auto
    assert kv_cache_dtype_name("auto", cpu, torch.bfloat16) == "bf16"
    assert kv_cache_dtype_name("auto", cuda, torch.bfloat16) == "bf16"
    assert kv_cache_dtype_name("auto", cuda, torch.float32) == "fp32"
    assert kv_cache_dtype_name("fp32", cpu, torch.float32) == "fp32"
    assert kv_cache_dtype_name("int8", cuda, torch.float16) == "int8"
    with pytest.raises(ValueError, match="auto, fp32, fp16, bf16, int8"):
        kv_cache_dtype_name("fp4", cpu, torch.float32)


def test_fp16_cache_rounds_once_and_holds_twice_the_tokens(monkeypatch):
    """The flag's every choice has a class; fp16 stores K/V as torch's .half()
    rounds them and gives them back in the engine's dtype, at half fp32's bytes."""
    monkeypatch.setattr(custom_ops, "simd_features", lambda: frozenset())
    assert {c: kv_cache_class(kv_cache_dtype_name(c, CPU, torch.float32))
            for c in KV_CACHE_DTYPES} == {
        "auto": Fp16KVCache, "fp32": Fp32KVCache, "fp16": Fp16KVCache, "bf16": Bf16KVCache,
        "int8": Int8KVCache}
    torch.manual_seed(0)
    cache = Fp16KVCache(64, HKV, D, torch.float32, CPU)
    assert cache.data.dtype == torch.float16
    kv = torch.randn(10, 2, HKV, D) * 3
    slots = torch.tensor([3, 7, 8, 9, 20, 21, 40, 41, 42, 63])
    cache.write(slots, kv)
    got = cache.gather(slots)
    assert got.dtype == torch.float32
    assert torch.equal(got, kv.half().float())
    assert (Fp32KVCache.bytes_per_token_layer(3, 64)
            == 2 * Fp16KVCache.bytes_per_token_layer(3, 64) == 1536)


def reference_attention(q, k, v, ctx_lens, q_lens):
    """Plain causal attention per sequence (queries are the last q_len positions)."""
    outs = []
    qs = q.split(q_lens)
    for i, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        qi = qs[i].transpose(0, 1).unsqueeze(0)  # [1, H, ql, D]
        ki = k[i][:cl].transpose(0, 1).unsqueeze(0)
        vi = v[i][:cl].transpose(0, 1).unsqueeze(0)
        mask = torch.arange(cl)[None, :] <= (cl - ql + torch.arange(ql))[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(ql, H * D))
    return torch.cat(outs)


@pytest.mark.parametrize("cache_cls,tol",
                         [(Fp32KVCache, 1e-5), (Fp16KVCache, 5e-3), (Bf16KVCache, 0.03),
                          (Int8KVCache, 0.05)])
def test_paged_attention_matches_dense_reference(cache_cls, tol):
    torch.manual_seed(1)
    # Two decodes and two prefill chunks of different lengths, scattered blocks.
    ctx_lens, q_lens = [9, 5, 12, 7], [1, 1, 5, 7]
    tables = [[7, 2, 11], [4, 0], [1, 9, 3], [5, 8]]
    k = [torch.randn(c, HKV, D) for c in ctx_lens]
    v = [torch.randn(c, HKV, D) for c in ctx_lens]
    cache = cache_cls(16 * BS, HKV, D, torch.float32, CPU)
    for t, kk, vv in zip(tables, k, v):
        pos = torch.arange(kk.shape[0])
        slots = torch.tensor(t)[pos // BS] * BS + pos % BS
        cache.write(slots, torch.stack((kk, vv), 1))
    q = torch.randn(sum(q_lens), H, D)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        decode=build_group(q_lens[:2], ctx_lens[:2], padded_block_table(tables[:2], 3), BS, CPU),
        prefill=build_group(q_lens[2:], ctx_lens[2:], padded_block_table(tables[2:], 3), BS,
                            CPU),
    )
    out = paged_attention(q, cache, meta, D**-0.5)
    ref = reference_attention(q, k, v, ctx_lens, q_lens)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
