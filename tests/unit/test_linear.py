"""Dense and quantized linear layers against their (dequantized) references."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import custom_ops
from tandem.model.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    QuantizedWeight,
    make_linear,
    quantization_level,
    quantize_activations,
    quantize_int4,
    quantize_int8_groups,
    unpack_int4,
)

torch.manual_seed(0)


def weights(out_f=96, in_f=128):
    return torch.randn(out_f, in_f) * 0.05, torch.randn(out_f) * 0.1


def test_dense_matches_matmul_and_fuses_residual():
    w, b = weights()
    x, res = torch.randn(5, 128), torch.randn(5, 96)
    for bias in (None, b):
        lin = DenseLinear(w, bias)
        ref = x @ w.t() + (0 if bias is None else bias)
        torch.testing.assert_close(lin(x), ref)
        torch.testing.assert_close(lin.add(res, x), res + ref)
    assert DenseLinear(w).nbytes == w.numel() * 4


def test_int8_matches_dequantized_reference():
    w, b = weights()
    lin = Int8Linear(w, b)
    deq = torch.round(w / lin.scale[:, None]).clamp(-127, 127) * lin.scale[:, None]
    x = torch.randn(7, 128)
    ref = x @ deq.t() + b
    # Activations are quantized in groups of 32 (8-bit): well under 1% of the output range.
    err = (lin(x) - ref).abs().max() / ref.abs().max()
    assert err < 0.01
    # Per-row scales: a row's result does not depend on the rest of the batch.
    torch.testing.assert_close(lin(x[2:3]), lin(x)[2:3])
    assert lin.nbytes == w.numel() + 96 * 4
    assert (deq - w).abs().max() <= lin.scale.max() / 2 + 1e-7  # rounding, not worse


@pytest.mark.parametrize("kernel", [True, False], ids=["tandem-kernel", "torch"])
def test_int4_matches_dequantized_reference_exactly(kernel, monkeypatch):
    """int4 multiplies as its dequantized weight with W4A8's per-group
    activations, at every batch size, kernel and torch alike."""
    if not kernel:
        monkeypatch.setattr(custom_ops, "available", lambda: False)
    w, b = weights(40, 128)  # 40 outputs: a partial tile of 16
    lin = Int4Linear(w, b)
    assert lin.kernel == kernel
    wg = w.view(40, 4, 32)
    # Scale and lo are stored in fp16 (GGUF's Q4_1 blocks), q rounded against them.
    lo = wg.amin(-1, keepdim=True).half().float()
    scale = ((wg.amax(-1, keepdim=True) - lo) / 15).half().float()
    deq = (torch.round((wg - lo) / scale).clamp(0, 15) * scale + lo).view(40, 128)
    for rows in (1, 2, 3, 4, 5, 6, 7, 17):  # whole blocks of 4 rows, and tails of 1-3
        x = torch.randn(rows, 128)
        ref = quantize_activations(x).double() @ deq.double().t() + b.double()
        torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-4)
        # Per-row scales: a row's result does not depend on the rest of the batch.
        torch.testing.assert_close(lin(x[-1:]), lin(x)[-1:])
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-3
    assert lin.nbytes == w.numel() // 2 + 40 * 4 * 2 * 2  # nibbles + fp16 scale, lo / 32


@pytest.mark.parametrize("kernel", [True, False], ids=["tandem-kernel", "torch"])
def test_int4_with_the_fixed_offset_matches_its_blocks_exactly(kernel, monkeypatch):
    """Q4_0's blocks (w = (q - 8) * scale, no lo) multiply as their dequantized
    weight at every batch size, kernel and torch alike, and hold no lo."""
    if not kernel:
        monkeypatch.setattr(custom_ops, "available", lambda: False)
    n, k = 72, 128  # 72 outputs: tile pairs, the next pair's share, a partial tile
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // 32) * 0.01).half()
    g = q.view(n, -1, 2, 16)
    qw = QuantizedWeight("int4", (g[:, :, 0] | (g[:, :, 1] << 4)).view(n, k // 2), scale)
    deq = ((q.float() - 8).view(n, -1, 32) * scale.float()[..., None]).view(n, k)
    torch.testing.assert_close(qw.dequantize(), deq, atol=0, rtol=0)
    b = torch.randn(n) * 0.1
    lin = Int4Linear(qw, b)
    assert lin.kernel == kernel and lin.fixed_offset and quantization_level(lin) == "Q4_0"
    assert lin.nbytes == n * k // 2 + n * 4 * 2  # nibbles + an fp16 scale per 32
    for rows in (1, 2, 3, 4, 5, 6, 7, 9, 17):  # whole blocks of 4 rows, and tails of 1-3
        x = torch.randn(rows, k)
        ref = quantize_activations(x).double() @ deq.double().t() + b.double()
        torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-4)
    # Fused with an int4 weight that has lo, the offset becomes that weight's lo.
    other = quantize_int4(torch.randn(16, k) * 0.05)
    both = QuantizedWeight.cat([qw, other])
    assert both.lo is not None and not Int4Linear(both).fixed_offset
    torch.testing.assert_close(both.dequantize(), torch.cat([deq, other.dequantize()]))


@pytest.mark.parametrize("kernel", [True, False], ids=["tandem-kernel", "torch"])
def test_int8_blocks_keep_group_scales_exactly(kernel, monkeypatch):
    """int8 blocks with a scale per group of 32 (a GGUF's Q8_0) multiply as their
    dequantized weight with W8A8's per-group activations, kernel and torch alike."""
    if not kernel:
        monkeypatch.setattr(custom_ops, "available", lambda: False)
    w, b = weights(40, 96)  # 40 outputs: a partial tile of 16
    qw = quantize_int8_groups(w)
    assert qw.scale.dtype == torch.float16 and qw.scale.shape == (40, 3)
    deq = qw.dequantize()
    assert (deq - w).abs().max() <= qw.scale.float().max() / 2 + 1e-6
    lin = Int8Linear(qw, b)
    assert lin.kernel == kernel and lin.nbytes == 40 * 96 + 40 * 4 + 40 * 3 * 2
    for rows in (1, 2, 3, 5, 6, 7):  # whole blocks of 4 rows, and tails of 1-3
        x = torch.randn(rows, 96)
        ref = quantize_activations(x).double() @ deq.double().t() + b.double()
        torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["tandem-kernel", "torch"])
def test_fused_parts_pack_at_their_row_offsets(kernel, monkeypatch):
    """A fused matmul's parts (Q/K/V's 20 + 13 + 7 rows: tiles shared across
    parts, a partial last tile) are packed one by one, straight from strided
    views like a GGUF's blocks, into what their concatenation multiplies as;
    a Q4_0 part beside parts with lo takes lo = -8 scale."""
    if not kernel:
        monkeypatch.setattr(custom_ops, "available", lambda: False)
    k = 96
    w = torch.randn(40, k) * 0.05
    rows = (slice(0, 20), slice(20, 33), slice(33, 40))

    def strided(qw: QuantizedWeight) -> QuantizedWeight:
        """The same blocks inside a wider buffer, as a GGUF's bytes hold them."""
        n, g, b = qw.data.shape
        buf = torch.zeros(n, g, b + 2, dtype=qw.data.dtype)
        buf[:, :, 2:] = qw.data
        lo = None if qw.lo is None else qw.lo.t().contiguous().t()
        return QuantizedWeight(qw.kind, buf[:, :, 2:], qw.scale.t().contiguous().t(), lo)

    q8 = [quantize_int8_groups(w[r]) for r in rows]
    q4 = [quantize_int4(w[r]) for r in rows]
    q4[1] = QuantizedWeight("int4", q4[1].data, q4[1].scale)  # a Q4_0 part
    for make, parts in ((Int8Linear, q8), (Int4Linear, q4)):
        lin = make([strided(p) for p in parts])
        assert lin.kernel == kernel
        whole = QuantizedWeight.cat(parts)
        for m in (1, 5):
            x = torch.randn(m, k)
            ref = quantize_activations(x).double() @ whole.dequantize().double().t()
            torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-4)


def test_quantized_weight_rows_concatenate_and_round_trip():
    w = torch.randn(48, 64) * 0.05
    for quantize in (quantize_int4, quantize_int8_groups):
        parts = [quantize(w[:16]), quantize(w[16:])]
        whole = QuantizedWeight.cat(parts)
        assert whole.shape == (48, 64)
        torch.testing.assert_close(whole.dequantize(), quantize(w).dequantize())
    q4 = quantize_int4(w)
    assert unpack_int4(q4.data).max() <= 15
    with pytest.raises(ValueError, match="different block formats"):
        QuantizedWeight.cat([quantize_int4(w), quantize_int8_groups(w)])


def test_quantized_residual_add():
    w, _ = weights()
    x, res = torch.randn(2, 128), torch.randn(2, 96)
    for lin in (Int8Linear(w), Int4Linear(w)):
        torch.testing.assert_close(lin.add(res, x), res + lin(x))


def test_bad_choices():
    w, _ = weights(96, 100)
    with pytest.raises(ValueError, match="divisible"):
        Int4Linear(w)
    with pytest.raises(ValueError, match="fp3"):
        make_linear(w, quantization="fp3")


def test_quantization_levels_use_llama_cpps_names():
    w, _ = weights()
    assert quantization_level(DenseLinear(w)) == "F32"
    assert quantization_level(DenseLinear(w.bfloat16())) == "BF16"
    assert quantization_level(Int8Linear(w)) == "INT8"
    assert quantization_level(Int8Linear(quantize_int8_groups(w))) == "Q8_0"
    assert quantization_level(Int4Linear(w)) == "Q4_1"


def test_weight_kind_numbers_match_the_cpp_step():
    """Python's WeightKind and the C++ step's enum are one numbering."""
    import re
    from pathlib import Path

    import tandem.kernels
    from tandem.model.linear import WeightKind

    header = (Path(tandem.kernels.__file__).parent / "csrc" / "step_matmul.h").read_text()
    body = re.search(r"enum class WeightKind[^{]*\{([^}]*)\}", header).group(1)
    cpp = {name.strip()[1:].upper(): int(v) for name, v in re.findall(r"(\w+)\s*=\s*(\d+)", body)}
    assert cpp == {k.name: k.value for k in WeightKind}


def test_packed_weights_go_where_the_allocator_puts_them():
    """The loader packs quantized weights straight into huge pages: same results."""
    from tandem.model.hugepages import HugePageArena

    torch.manual_seed(0)
    w, x = torch.randn(40, 96), torch.randn(3, 96)
    for make in (Int8Linear, Int4Linear, lambda w, **kw: Int8Linear(quantize_int8_groups(w), **kw)):
        arena = HugePageArena(chunk_bytes=1 << 20)
        lin = make(w, alloc=arena.empty)
        if not lin.kernel:
            pytest.skip("tandem's CPU kernels are unavailable")
        start = arena._buf.data_ptr()
        packed = lin.wpack if isinstance(lin, Int8Linear) else lin.packed
        assert start <= packed.data_ptr() < start + arena.chunk_bytes
        torch.testing.assert_close(lin(x), make(w)(x), rtol=0, atol=0)
