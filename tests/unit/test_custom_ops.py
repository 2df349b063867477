"""tandem's fused CPU kernels against the torch reference paths they replace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem.config import cpu_flags
from tandem.kernels import custom_ops
from tandem.model.attention import AttentionMetadata, build_group, paged_attention
from tandem.model.kv_cache import Bf16KVCache, Fp16KVCache, Fp32KVCache, Int8KVCache
from tandem.model.linear import Int8Linear, quantize_activations

from .test_kv_cache import padded_block_table

CPU = torch.device("cpu")
custom_ops.available()  # loads torch.ops.tandem (test_kernels_are_built_here says if not)
ops = torch.ops.tandem


def test_kernels_are_built_here():
    # CI machines have g++: the fast path must be what the other tests exercise.
    assert custom_ops.available(), "tandem's CPU kernels failed to build (see the warning)"
    # What they were built for is what this CPU has, at most (-march=native).
    built = custom_ops.simd_features()
    assert built <= cpu_flags() and ("avx512f" in built) == ("avx512f" in cpu_flags())


def test_rms_norm_and_act_and_mul():
    torch.manual_seed(0)
    x, w = torch.randn(5, 576) * 3, torch.randn(576)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5),
                               atol=1e-6, rtol=1e-5)
    # Rows with a stride (a slice of a wider tensor) are read correctly.
    wide = torch.randn(4, 700)
    torch.testing.assert_close(ops.rms_norm(wide[:, :576], w, 1e-6),
                               F.rms_norm(wide[:, :576], (576,), w, 1e-6), atol=1e-6, rtol=1e-5)
    gu = torch.randn(7, 2 * 100) * 6  # a wide range, incl. exp overflow territory
    gu[0, 0], gu[0, 1] = 95.0, -95.0
    ref = F.silu(gu[:, :100]) * gu[:, 100:]
    torch.testing.assert_close(ops.act_and_mul(gu), ref, atol=1e-5, rtol=1e-5)  # 0: SiLU
    ref = F.gelu(gu[:, :100], approximate="tanh") * gu[:, 100:]  # Gemma's GeGLU
    torch.testing.assert_close(ops.act_and_mul(gu, 1), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="unknown activation"):
        ops.act_and_mul(gu, 2)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(x.double(), w, 1e-5)


@pytest.mark.parametrize("cache_cls", [Fp32KVCache, Fp16KVCache, Bf16KVCache, Int8KVCache])
def test_rotary_embedding_and_cache_matches_reference(cache_cls):
    torch.manual_seed(1)
    h, hkv, d, t = 6, 2, 16, 9
    pos = torch.tensor([0, 3, 17, 4, 5, 6, 90, 2, 1])
    slots = torch.tensor([5, 9, 0, 33, 34, 35, 12, 7, 63])
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
    qkv = torch.randn(t, h + 2 * hkv, d)
    # Reference: HF's q * cos + rotate_half(q) * sin, then the cache's own write.
    x1, x2 = qkv[:, : h + hkv, : d // 2], qkv[:, : h + hkv, d // 2 :]
    c, s = cos[pos, None, : d // 2], -sin[pos, None, : d // 2]
    rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    ref_cache = cache_cls(64, hkv, d, torch.float32, CPU)
    ref_cache.write(slots, torch.cat((rot[:, h:], qkv[:, h + hkv :]), 1).view(t, 2, hkv, d))
    cache = cache_cls(64, hkv, d, torch.float32, CPU)
    out = qkv.clone()
    ops.rotary_embedding_and_cache(out, pos, cos, sin, h, hkv, *cache.kernel_args, slots)
    torch.testing.assert_close(out[:, : h + hkv], rot, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[:, h + hkv :], qkv[:, h + hkv :])
    for got, want in zip(cache.kernel_args, ref_cache.kernel_args):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def query_as(q, cache_cls):
    """The queries as the kernels take them: attention against a bf16 cache
    rounds them to bf16 (a bf16 model's queries), on every path."""
    return q.bfloat16().float() if cache_cls is Bf16KVCache else q


@pytest.mark.parametrize("cache_cls", [Fp32KVCache, Fp16KVCache, Bf16KVCache, Int8KVCache])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 8, 128), (14, 2, 64), (4, 1, 32),
                                     (18, 2, 64), (32, 8, 64), (12, 2, 128), (4, 1, 256),
                                     (8, 4, 256), (6, 6, 96)])
@pytest.mark.parametrize("ctx", [[1, 16, 17, 45, 200, 3, 64, 33], [1000], [37, 700], [3000]],
                         ids=["8-seqs", "1-long", "2-ragged", "1-longer"])
def test_paged_attention_decode_matches_gather_and_sdpa(cache_cls, h, hkv, d, ctx):
    """Register-blocked shapes (head size 64/128, groups of 1, 3, 4, 6 and 7; 96,
    Phi-3's; 256, Gemma 3's, its PV in passes of 4 or 8 chunks for groups of 4
    and 2) and
    generic ones (head size 32, a group of 9), across block boundaries and
    ragged lengths; one or two long contexts are split across threads and
    merged: by KV head (1000 tokens), or into ranges of every KV head (700
    beside 37, and 3000)."""
    check_paged_attention_decode(cache_cls, h, hkv, d, ctx, 16)


@pytest.mark.parametrize("cache_cls", [Fp16KVCache, Bf16KVCache, Int8KVCache])
@pytest.mark.parametrize("bs", [8, 32, 128])
def test_paged_attention_decode_block_sizes(cache_cls, bs):
    """The online softmax steps over 64 keys (several blocks of 8 or 32, one of 128)."""
    check_paged_attention_decode(cache_cls, 32, 8, 64, [1, 40, 300, 1000], bs)


@pytest.mark.parametrize("cache_cls", [Fp32KVCache, Fp16KVCache, Bf16KVCache, Int8KVCache])
@pytest.mark.parametrize("window", [1, 7, 16, 100, 2500])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (32, 8, 64), (4, 1, 32)])
def test_paged_attention_decode_sliding_window(cache_cls, window, h, hkv, d):
    """A sliding window of W keys: each sequence's last W, from mid-block
    (split into ranges of a long context, the first starting mid-block), as
    the reference path's mask has it; contexts shorter than W see them all."""
    for ctx in ([1, 16, 17, 45, 200, 3, 64, 33], [3000]):
        check_paged_attention_decode(cache_cls, h, hkv, d, ctx, 16, window)


@pytest.mark.parametrize("cache_cls", [Fp32KVCache, Bf16KVCache, Int8KVCache])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 4, 256), (4, 1, 32)])
def test_paged_attention_soft_capped_scores(cache_cls, h, hkv, d):
    """Gemma 2's soft-capped scores (cap * tanh(s / cap), before the mask and the
    window), decode and prefill, against the reference path's own arithmetic."""
    check_paged_attention_decode(cache_cls, h, hkv, d, [1, 17, 300, 45], 16, 20, softcap=3.0)
    check_paged_attention_prefill(cache_cls, h, hkv, d, [(5, 37), (17, 17), (1, 40)], 7,
                                  softcap=3.0)


def check_paged_attention_decode(cache_cls, h, hkv, d, ctx, bs, window=0, softcap=0.0):
    torch.manual_seed(2)
    nb = -(-max(ctx) // bs)
    tables = [list(range(i * nb, i * nb + -(-c // bs)))[::-1] for i, c in enumerate(ctx)]
    cache = cache_cls(nb * len(ctx) * bs, hkv, d, torch.float32, CPU)
    slots = torch.arange(nb * len(ctx) * bs)
    cache.write(slots, torch.randn(len(slots), 2, hkv, d) * 2)
    q = torch.randn(len(ctx), h + 2 * hkv, d)[:, :h]  # strided, like the model's view
    out = {}
    for fused in (False, True):
        g = build_group([1] * len(ctx), ctx, padded_block_table(tables, nb), bs, CPU,
                        fused=fused, window=window)
        qf = q if fused else query_as(q, cache_cls)
        out[fused] = paged_attention(qf, cache, AttentionMetadata(None, g, None), d**-0.5,
                                     window, softcap)
    if 0 < window < max(ctx) or softcap:  # the window hides keys, the cap bends scores
        g = build_group([1] * len(ctx), ctx, padded_block_table(tables, nb), bs, CPU, fused=True)
        full = paged_attention(q, cache, AttentionMetadata(None, g, None), d**-0.5)
        assert not torch.allclose(full, out[True], atol=1e-3)
    # Products of bf16 values are exact in fp32: a bf16 cache as close as the others.
    torch.testing.assert_close(out[True], out[False], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_cls", [Fp32KVCache, Fp16KVCache, Bf16KVCache, Int8KVCache])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 8, 128), (32, 8, 64), (4, 1, 32),
                                     (40, 2, 64)])
@pytest.mark.parametrize("chunks", [[(5, 37), (17, 17), (1, 40)], [(80, 700)], [(33, 33)]],
                         ids=["3-ragged", "chunk-of-long", "whole-prompt"])
def test_paged_attention_prefill_matches_gather_and_sdpa(cache_cls, h, hkv, d, chunks):
    """Prefill chunks (q new tokens at the end of a ctx-token context) of several
    sequences in one flat batch, causal from each chunk's position: tiles of 16
    (token, query head) rows for groups of 3, 1, 4 and 8 query heads, and of
    one token's 16 heads for a group of 20; head size 32 on the portable loop."""
    check_paged_attention_prefill(cache_cls, h, hkv, d, chunks)


@pytest.mark.parametrize("cache_cls", [Fp32KVCache, Fp16KVCache, Bf16KVCache, Int8KVCache])
@pytest.mark.parametrize("window", [1, 5, 20, 300])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (40, 2, 64), (4, 1, 32)])
def test_paged_attention_prefill_sliding_window(cache_cls, window, h, hkv, d):
    """A sliding window of W keys: each query row sees its last W, so a tile's
    rows start at different keys (rows of a tile whose first key lies past a
    block see none of it) and a chunk of a long context skips its early blocks."""
    check_paged_attention_prefill(cache_cls, h, hkv, d, [(5, 37), (17, 17), (1, 40)], window)
    check_paged_attention_prefill(cache_cls, h, hkv, d, [(80, 700)], window)


def check_paged_attention_prefill(cache_cls, h, hkv, d, chunks, window=0, softcap=0.0):
    torch.manual_seed(3)
    bs = 16
    ctx = [c for _, c in chunks]
    nb = -(-max(ctx) // bs)
    tables = [list(range(i * nb, i * nb + -(-c // bs)))[::-1] for i, c in enumerate(ctx)]
    cache = cache_cls(nb * len(ctx) * bs, hkv, d, torch.float32, CPU)
    slots = torch.arange(nb * len(ctx) * bs)
    cache.write(slots, torch.randn(len(slots), 2, hkv, d) * 2)
    t = sum(n for n, _ in chunks)
    q = torch.randn(t, h + 2 * hkv, d)[:, :h]  # strided, like the model's view
    out = {}
    for fused in (False, True):
        g = build_group([n for n, _ in chunks], ctx, padded_block_table(tables, nb), bs, CPU,
                        fused=fused, window=window)
        qf = q if fused else query_as(q, cache_cls)
        out[fused] = paged_attention(qf, cache, AttentionMetadata(None, None, g), d**-0.5,
                                     window, softcap)
    if 0 < window < max(ctx) or softcap:  # the window hides keys, the cap bends scores
        g = build_group([n for n, _ in chunks], ctx, padded_block_table(tables, nb), bs, CPU,
                        fused=True)
        full = paged_attention(q, cache, AttentionMetadata(None, None, g), d**-0.5)
        assert not torch.allclose(full, out[True], atol=1e-3)
    if (cache_cls is Bf16KVCache and d % 32 == 0
            and {"avx512_bf16", "avx512bw"} <= custom_ops.simd_features()):
        # The bf16 tiles round the probabilities to bf16 too (2^-9 relative):
        # outputs of magnitude ~1 err by ~2e-3 on average here; a wrong pairing
        # of dims or keys errs by O(1). Elsewhere a bf16 cache is as exact as
        # the others (queries rounded on both sides).
        err = (out[True] - out[False]).abs()
        assert err.max() < 0.1 and err.mean() < 5e-3, (err.max(), err.mean())
    else:
        torch.testing.assert_close(out[True], out[False], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (100, 37)])
def test_int8_kernel_matches_exact_arithmetic_and_is_batch_invariant(k, n, monkeypatch):
    """The kernel's per-group integer sums, scaled, against the same arithmetic in
    float64; the torch path (no kernels) agrees; a row's output never depends on
    the rest of its batch."""
    torch.manual_seed(3)
    w = torch.randn(n, k) * 0.05
    lin = Int8Linear(w)
    assert lin.kernel and not hasattr(lin, "q")  # one copy of the weights
    x = torch.randn(40, k) * 3
    x[1] *= 1e-3  # a row of small magnitude keeps its own scales
    x[2] = 0.0
    x[3, 5] = 400.0  # an outlier flattens only its own group
    q = torch.round(w / lin.scale[:, None]).clamp(-127, 127).double()
    exact = (quantize_activations(x).double() @ q.t()) * lin.scale.double()
    big = lin(x)
    torch.testing.assert_close(big.double(), exact, atol=1e-5, rtol=1e-5)
    for rows in (slice(0, 1), slice(0, 3), slice(3, 11), slice(0, 40)):
        assert torch.equal(lin(x[rows]), big[rows])
    monkeypatch.setattr(custom_ops, "available", lambda: False)
    ref = Int8Linear(w)
    assert not ref.kernel
    torch.testing.assert_close(ref(x), big, atol=1e-4, rtol=1e-4)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


@pytest.mark.parametrize(("k", "n"), [(576, 960), (100, 37), (1536, 576), (16, 4)])
def test_matvec_matches_matmul_and_is_batch_invariant(k, n):
    """The decode step's fp32 matmul: K not a multiple of 16 (masked tail), N not
    a multiple of 4 (single-row tiles), up to 9 rows (row blocks of 4)."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(9, k), torch.randn(n, k), torch.randn(n)
    want = torch.addmm(bias.double(), x.double(), w.double().t()).float()
    got = ops.matvec(x, w, bias)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # A row's result does not depend on the rows batched with it.
    for m in (1, 2, 3, 5):
        assert torch.equal(ops.matvec(x[:m], w, None), ops.matvec(x, w, None)[:m])
    with pytest.raises(RuntimeError, match="matvec"):
        ops.matvec(x, w[:, :-1].contiguous(), None)


def test_without_a_compiler_the_reference_paths_run(tmp_path):
    code = ("from tandem import LLM, SamplingParams\n"
            "from tandem.kernels import custom_ops\n"
            "assert not custom_ops.available()\n"
            "print('ok')\n")
    res = _run(code, CXX="/bin/false", TANDEM_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "unavailable" in res.stderr and "reference paths" in res.stderr
    res = _run(code, TANDEM_CUSTOM_OPS="0")
    assert res.returncode == 0 and res.stderr == "", res.stderr


def test_importing_compiles_nothing(tmp_path):
    """Every module imports without building or loading the kernels; the first
    model built does (with no compiler here, it warns and falls back)."""
    code = ("import importlib, pkgutil, tandem\n"
            "for m in pkgutil.walk_packages(tandem.__path__, 'tandem.'):\n"
            "    importlib.import_module(m.name)\n"
            "import torch\n"
            "assert not hasattr(torch.ops.tandem, 'rms_norm')\n"
            "print('ok')\n")
    res = _run(code, CXX="/bin/false", TANDEM_CACHE=str(tmp_path))
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
    assert "unavailable" not in res.stderr and not (tmp_path / "kernels").exists()
