"""GGUF block formats decoded into tandem's int8 / int4 groups of 32.

Q8_0 and Q5_0 become int8 groups and Q4_0 / Q4_1 / Q4_K int4 groups exactly;
Q5_K and Q6_K are requantized to int8 groups. A decoder takes a tensor's rows
of whole blocks (uint8) and returns QuantizedWeight's parts, views of the
blocks where the format allows; the C++ kernel when built, else its torch or
numpy reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def quantized_weight(data: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None = None):
    from tandem.model.linear import QuantizedWeight

    return QuantizedWeight("int8" if data.dtype == torch.int8 else "int4", data, scale, lo)


def _blocks(data: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [rows, bytes] of a block format -> [rows, blocks, size] (a view)."""
    if data.dim() != 2 or data.shape[1] % size:
        raise ValueError(f"rows of {list(data.shape)} bytes are not whole {size}-byte blocks")
    return data.view(data.shape[0], -1, size)


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """[rows, blocks, size] -> the fp16 at byte ``offset`` (even) of each block (a view)."""
    return b.view(torch.float16)[:, :, offset // 2]


def _decode_q8_0(data: torch.Tensor) -> list:
    b = _blocks(data, 34)  # fp16 d, 32 x int8: w = d q
    return [b[:, :, 2:].view(torch.int8), _f16(b, 0)]


def _decode_q4_0(data: torch.Tensor) -> list:
    b = _blocks(data, 18)  # fp16 d, 16 bytes of nibbles: w = d (q - 8): no lo
    return [b[:, :, 2:], _f16(b, 0)]


def _decode_q5_0(data: torch.Tensor) -> list:
    """Q5_0 blocks (fp16 d, 32 high bits, 16 bytes of low nibbles: w = d (q - 16),
    q in 0..31) are int8 groups of 32 exactly, q - 16 with scale d. llama.cpp
    writes them where a K-quant's 256-wide super-blocks do not fit a row (Gemma
    3 1B's 1152 inputs in a Q4_K_M file). The kernel when built, else torch,
    which is faster than gguf's dequantize and a requantization."""
    from tandem.kernels import custom_ops

    if custom_ops.available():
        return torch.ops.tandem.q5_0_to_int8(data)
    return _decode_q5_0_torch(data)


def _decode_q5_0_torch(data: torch.Tensor) -> list:
    """_decode_q5_0 in torch (the kernel's reference)."""
    b = _blocks(data, 22)
    bits = torch.arange(8, dtype=torch.uint8)
    high = ((b[:, :, 2:6, None] >> bits) & 1).flatten(2)  # bit k of qh: value k's fifth bit
    q = torch.cat((b[:, :, 6:] & 15, b[:, :, 6:] >> 4), -1) | (high << 4)
    return [q.view(torch.int8) - 16, _f16(b, 0)]


def _decode_q4_1(data: torch.Tensor) -> list:
    b = _blocks(data, 20)  # fp16 d, fp16 m, 16 bytes of nibbles: w = d q + m
    return [b[:, :, 4:], _f16(b, 0), _f16(b, 2)]


def _decode_q4_k(data: torch.Tensor) -> list:
    """Q4_K super-blocks of 256 (fp16 d and dmin, 12 bytes of 6-bit scales and
    mins for 8 sub-blocks of 32, 128 bytes of nibbles: sub-block 2c is chunk c's
    low nibbles, 2c + 1 its high ones): w = d sc q - dmin m per sub-block, i.e.
    int4 groups of 32 with scale d sc and lo -dmin m (rounded to fp16). The
    kernel (tandem/kernels/csrc/block_formats.h) when built, else numpy."""
    from tandem.kernels import custom_ops

    if custom_ops.available():
        return torch.ops.tandem.q4_k_to_int4(data)
    return _decode_q4_k_numpy(data)


def _requantized(kind: str) -> Callable[[torch.Tensor], list]:
    """The decoder of a K-quant format requantized to int8 groups of 32
    (quantize_int8_groups' rule): its kernel when built (no fp32 copy of the
    tensor), else gguf's numpy dequantize and the torch quantizer."""

    def decode(data: torch.Tensor) -> list:
        from tandem.kernels import custom_ops
        from tandem.model.linear import quantize_int8_groups

        if custom_ops.available():
            return getattr(torch.ops.tandem, f"{kind.lower()}_to_int8")(data)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType[kind]
        w = dequantize(_blocks(data, GGML_QUANT_SIZES[qtype][1]).numpy(), qtype)
        qw = quantize_int8_groups(torch.from_numpy(w.reshape(data.shape[0], -1)))
        return [qw.data, qw.scale]

    return decode


def _decode_q4_k_numpy(data: torch.Tensor) -> list:
    """_decode_q4_k in numpy (the kernel's reference)."""
    tb = _blocks(data, 144)
    b = tb.numpy()
    rows, nsb = b.shape[:2]
    d = _f16(tb, 0).numpy().astype(np.float32)[..., None]
    dmin = _f16(tb, 2).numpy().astype(np.float32)[..., None]
    sc_b = b[:, :, 4:16]
    lo4, hi4 = sc_b[..., 0:4], sc_b[..., 4:8]
    mid = sc_b[..., 8:12]
    sc = np.concatenate((lo4 & 63, (mid & 15) | ((lo4 >> 6) << 4)), -1).astype(np.float32)
    m = np.concatenate((hi4 & 63, (mid >> 4) | ((hi4 >> 6) << 4)), -1).astype(np.float32)
    qs = b[:, :, 16:].reshape(rows, nsb, 4, 32)
    q = np.stack((qs & 15, qs >> 4), 3).reshape(rows, nsb * 8, 32)  # [rows, groups, 32]
    packed = q[:, :, :16] | (q[:, :, 16:] << 4)
    scale = (d * sc).reshape(rows, -1).astype(np.float16)
    lo = (-(dmin * m)).reshape(rows, -1).astype(np.float16)
    return [torch.from_numpy(packed), torch.from_numpy(scale), torch.from_numpy(lo)]


# Block formats read as tandem's int8 / int4 groups: exactly, but Q5_K (5 bits
# and a minimum) and Q6_K (16-value sub-blocks), requantized to int8 groups.
BLOCK_DECODERS = {"Q8_0": _decode_q8_0, "Q5_0": _decode_q5_0, "Q4_0": _decode_q4_0,
                   "Q4_1": _decode_q4_1, "Q4_K": _decode_q4_k, "Q5_K": _requantized("Q5_K"),
                   "Q6_K": _requantized("Q6_K")}
