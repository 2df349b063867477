"""How a weight matrix is applied: dense, or weight-quantized to int8 / int4.

Every variant is a callable ``lin(x) -> x @ W.T (+ bias)`` plus
``lin.add(res, x) -> res + lin(x)`` (fused into one addmm for dense weights,
which saves an op per residual on the hot path), built from an HF-layout
weight ``[out, in]``.

Quantization trades a little quality for fewer bytes read per decode step
(the seeds' strongest lever on decode speed):

* int8: symmetric, one fp32 scale per output channel. On CPU, activations are
  quantized too (W8A8), in groups of 32 inputs with a scale each, as
  llama.cpp's Q8_0 does (a scale per token cost +4.8% perplexity on the
  default model, per group +0.9%). tandem's kernel multiplies them in exact
  int32 per group (AVX-512 VNNI where the CPU has it, a portable loop
  elsewhere), with weights packed 16 outputs x 4 inputs per 64 bytes: batch 1
  streams them at memory speed. Without the kernels the same arithmetic runs
  in torch, slower. On CUDA the weight is dequantized inside the matmul
  (y = (x @ q) * scale), saving memory, not time.
* int4: asymmetric, groups of ``group_size`` input weights with a scale and a
  zero point each. On CPU, tandem's kernel (groups of 32) unpacks the nibbles
  in registers for up to 4 rows (decode: 0.9-2x the speed of fp32 at an eighth
  of the bytes) and dequantizes for torch's GEMM beyond; torch's int4-pack
  matmul (``_weight_int4pack_mm_for_cpu``, ~10x slower at batch 1) is the
  fallback. Elsewhere it dequantizes per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem import _custom_ops

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32
INT8_GROUP_SIZE = 32  # inputs per activation scale (tandem/csrc/quant_linear.h: kInt8Group)


class DenseLinear:
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # HF's [out, in], kept as is: a tied LM head shares the embedding's
        # storage, and tandem's fused decode step (tandem.model.decode_step)
        # streams it row by row.
        self.w = w
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.w.t())
        return torch.addmm(self.bias, x, self.w.t())

    def add(self, res: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.addmm(res, x, self.w.t())
        return res + self(x)

    @property
    def step_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """(weight kind, tensors) as tandem's C++ decode step takes them."""
        if self.w.device.type != "cpu" or self.w.dtype != torch.float32:
            return None
        return 0, [self.w, self.w, self.w]  # the kind's two other tensors: unused

    @property
    def nbytes(self) -> int:
        n = self.w.numel() * self.w.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


class _QuantLinear:
    """Shared parts of the quantized variants (each defines ``matmul``)."""

    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def add(self, res: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return res + self(x)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as int8 W8A8 sees it: each group of INT8_GROUP_SIZE inputs
    rounded to a multiple of its own scale, absmax / 127 (llama.cpp's Q8_0
    activations; the reference for tandem's int8 kernel)."""
    m, k = x.shape
    kp = -(-k // INT8_GROUP_SIZE) * INT8_GROUP_SIZE
    xg = F.pad(x, (0, kp - k)).view(m, kp // INT8_GROUP_SIZE, INT8_GROUP_SIZE)
    s = xg.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    return (torch.round(xg / s) * s).view(m, kp)[:, :k]


class Int8Linear(_QuantLinear):
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = w.float()
        out_f, in_f = w.shape
        self.scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12)  # [out]
        self.bias = bias
        self.cpu = w.device.type == "cpu"
        self._nbytes = out_f * in_f + out_f * 4
        q = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.kernel = self.cpu and _custom_ops.AVAILABLE
        if self.kernel:
            self._pack_for_kernel(q)
        elif self.cpu:
            self.q = q  # [out, in], for the torch reference path
        else:
            self.qt = q.t().contiguous()  # [in, out]

    def _pack_for_kernel(self, q: torch.Tensor) -> None:
        """[out, in] int8 -> uint8 (+ 128) tiles of 16 outputs x (4 inputs per 64
        bytes), inputs zero-padded to whole groups (tandem/csrc/quant_linear.h)."""
        n, k = q.shape
        tiles, kp = -(-n // 16), -(-k // INT8_GROUP_SIZE) * INT8_GROUP_SIZE
        padded = torch.zeros(tiles * 16, kp, dtype=torch.int16)
        padded[:n, :k] = q
        u8 = (padded + 128).to(torch.uint8)
        self.wpack = u8.view(tiles, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
        self.w_scale = torch.zeros(tiles * 16)
        self.w_scale[:n] = self.scale
        self.out_features = n

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return torch.ops.tandem.int8_linear(
                x.float(), self.wpack, self.w_scale, self.out_features).to(x.dtype)
        if self.cpu:  # the same arithmetic in torch (float-exact up to rounding): slower
            w = self.q.float() * self.scale[:, None]
            return torch.mm(quantize_activations(x.float()), w.t()).to(x.dtype)
        return torch.mm(x, self.qt.to(x.dtype)) * self.scale.to(x.dtype)

    @property
    def step_args(self) -> tuple[int, list[torch.Tensor]] | None:
        return (1, [self.wpack, self.w_scale, self.w_scale]) if self.kernel else None  # 3rd unused

    @property
    def nbytes(self) -> int:
        return self._nbytes


class Int4Linear(_QuantLinear):
    def __init__(
        self, w: torch.Tensor, bias: torch.Tensor | None = None,
        group_size: int = INT4_GROUP_SIZE,
    ) -> None:
        n, k = w.shape
        if k % group_size:
            raise ValueError(f"int4 needs in_features ({k}) divisible by the group size "
                             f"{group_size}")
        wg = w.float().view(n, k // group_size, group_size)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
        self.group_size = group_size
        self.bias = bias
        self.cpu = w.device.type == "cpu"
        self.kernel = self.cpu and _custom_ops.AVAILABLE and group_size == 32
        if self.kernel:  # tandem's kernel: byte i of a group = weight i | weight 16 + i << 4
            g = q.view(n, k // 32, 2, 16).to(torch.uint8)
            self.packed = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
            self.scale, self.lo = scale.view(n, -1).contiguous(), lo.view(n, -1).contiguous()
        elif self.cpu:
            # int4pack's convention: w = (q - 8) * scale + zero, so zero = lo + 8 * scale.
            sz = torch.stack((scale.view(n, -1), (lo + 8 * scale).view(n, -1)), -1)
            self.scales_zeros = sz.transpose(0, 1).contiguous()  # [k / group, n, 2]
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            self.q = q.to(torch.uint8)
            self.scale, self.lo = scale, lo
        self._nbytes = n * k // 2 + 2 * n * (k // group_size) * 4

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return torch.ops.tandem.int4_linear(x.float(), self.packed, self.scale, self.lo).to(
                x.dtype)
        if self.cpu:
            return torch._weight_int4pack_mm_for_cpu(
                x.float(), self.packed, self.group_size, self.scales_zeros
            ).to(x.dtype)
        n, k = self.q.shape
        w = (self.q.view(n, -1, self.group_size).to(x.dtype) * self.scale.to(x.dtype)
             + self.lo.to(x.dtype)).view(n, k)
        return torch.mm(x, w.t())

    @property
    def step_args(self) -> tuple[int, list[torch.Tensor]] | None:
        return (2, [self.packed, self.scale, self.lo]) if self.kernel else None

    @property
    def nbytes(self) -> int:
        return self._nbytes


Linear = DenseLinear | Int8Linear | Int4Linear


def make_linear(
    w: torch.Tensor, bias: torch.Tensor | None = None, quantization: str = "none"
) -> Linear:
    if quantization == "int8":
        return Int8Linear(w, bias)
    if quantization == "int4":
        return Int4Linear(w, bias)
    if quantization != "none":
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    return DenseLinear(w, bias)
