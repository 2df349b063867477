"""How a weight matrix is applied: dense, or weight-quantized to int8 / int4.

Every variant is a callable ``lin(x) -> x @ W.T (+ bias)`` plus
``lin.add(res, x) -> res + lin(x)`` (fused into one addmm for dense weights,
which saves an op per residual on the hot path), built from an HF-layout
weight ``[out, in]``.

Quantization trades a little quality for fewer bytes read per decode step
(decode at small batch is bound by reading them):

* int8: symmetric, one fp32 scale per output channel when tandem quantizes a
  float weight; from a GGUF's Q8_0 blocks (or a format requantized to int8)
  also an fp16 scale per group of 32 inputs, so the file's values are kept
  exactly. On CPU, activations are quantized too (W8A8), in groups of 32
  inputs with a scale each, as llama.cpp's Q8_0 does (a scale per token cost
  +4.8% perplexity on the default model, per group +0.9%). tandem's kernel
  multiplies them in exact int32 per group (AVX-512 VNNI where the CPU has it,
  a portable loop elsewhere), with weights packed 16 outputs x 4 inputs per 64
  bytes: batch 1 streams them at memory speed. Without the kernels (or on
  CUDA) the weight is dequantized per call: memory saved, not time.
* int4: groups of 32 input weights with an fp16 scale and lo each (GGUF's
  Q4_1 blocks exactly, Q4_K's within fp16 rounding of its scales), or with a
  scale and the fixed offset 8 (Q4_0's blocks: no lo to read or apply). On
  CPU the same kernel as int8's multiplies them with the activations
  quantized the same way (W4A8, llama.cpp's Q4_0 x Q8_0): the nibbles are
  unpacked in registers, so batch 1 reads half of int8's bytes and batches
  cost about what int8's do. Elsewhere it dequantizes per call.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum

import torch
import torch.nn.functional as F

from tandem.kernels import custom_ops

INT4_GROUP_SIZE = 32
INT8_GROUP_SIZE = 32  # inputs per activation scale (tandem/kernels/csrc/quant_linear.h: kInt8Group)

# Where packed weights are allocated: (shape, dtype) -> an uninitialised CPU
# tensor (the loader passes a HugePageArena's: decode streams them faster).
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class WeightKind(IntEnum):
    """A matmul's weight format as tandem's C++ decode step numbers it
    (tandem/kernels/csrc/step_matmul.h: WeightKind)."""

    DENSE = 0
    INT8 = 1
    INT4 = 2


class DenseLinear:
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # HF's [out, in], kept as is: a tied LM head shares the embedding's
        # storage, and tandem's fused decode step (tandem.worker.decode_step)
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
        return WeightKind.DENSE, [self.w, self.w, self.w]  # the kind's two other tensors: unused

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


class QuantizedWeight:
    """A weight [out, in] in one of tandem's block formats, as a checkpoint or a
    quantizer produced it, before it is packed for a kernel: int8 ``data`` [out, in]
    with fp16 ``scale`` per group of 32 inputs (GGUF's Q8_0: w = q * d), or int4
    ``data`` uint8 [out, in / 2] with fp16 ``scale`` and ``lo`` per group of 32
    (GGUF's Q4_0 / Q4_1 nibble layout: byte i of a group holds weight i in its
    low nibble and 16 + i in its high one; w = q * scale + lo), ``lo`` None for
    Q4_0's fixed offset (w = (q - 8) * scale). Rows are independent, so fused
    matmuls concatenate them without requantizing."""

    def __init__(self, kind: str, data: torch.Tensor, scale: torch.Tensor,
                 lo: torch.Tensor | None = None) -> None:
        self.kind, self.data, self.scale, self.lo = kind, data, scale, lo

    def to(self, device: torch.device) -> QuantizedWeight:
        lo = None if self.lo is None else self.lo.to(device)
        return QuantizedWeight(self.kind, self.data.to(device), self.scale.to(device), lo)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        return n, k * 2 if self.kind == "int4" else k

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of parts of one kind, in order."""
        kind = parts[0].kind
        if any(p.kind != kind for p in parts):
            raise ValueError("cannot concatenate weights of different block formats")
        if len(parts) == 1:
            return parts[0]
        lo = None
        if kind == "int4" and any(p.lo is not None for p in parts):
            lo = torch.cat([p.lo if p.lo is not None else p.scale * -8 for p in parts])
        return QuantizedWeight(kind, torch.cat([p.data for p in parts]),
                               torch.cat([p.scale for p in parts]), lo)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in]."""
        n, k = self.shape
        s = self.scale.float()[..., None]
        if self.kind == "int8":
            return (self.data.float().view(n, -1, INT8_GROUP_SIZE) * s).view(n, k)
        q = unpack_int4(self.data).float().view(n, -1, INT4_GROUP_SIZE)
        if self.lo is None:
            return ((q - 8) * s).view(n, k)
        return (q * s + self.lo.float()[..., None]).view(n, k)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k / 2] in QuantizedWeight's int4 layout -> uint8 [n, k] values 0..15."""
    n = packed.shape[0]
    g = packed.view(n, -1, 1, 16)
    return torch.cat((g & 15, g >> 4), 2).view(n, -1)


# Quantizers work on this many rows at a time: their float temporaries stay
# ~100 MB whatever the matrix (an 8B model's LM head is 2.1 GB in fp32).
_CHUNK_ROWS = 2048


def quantize_int8_groups(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 in groups of 32 inputs, fp16 scale absmax / 127 each (Q8_0's
    rule): the target for block formats tandem has no kernel of its own for."""
    n, k = w.shape
    if k % INT8_GROUP_SIZE:
        raise ValueError(f"int8 groups need in_features ({k}) divisible by {INT8_GROUP_SIZE}")
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, k // INT8_GROUP_SIZE, dtype=torch.float16, device=w.device)
    for r in range(0, n, _CHUNK_ROWS):
        wg = w[r:r + _CHUNK_ROWS].float().view(-1, k // INT8_GROUP_SIZE, INT8_GROUP_SIZE)
        scale[r:r + _CHUNK_ROWS] = wg.abs().amax(-1) / 127.0
        s = scale[r:r + _CHUNK_ROWS].float().clamp_min(1e-30)[..., None]
        q[r:r + _CHUNK_ROWS] = torch.round(wg / s).clamp(-127, 127).view(-1, k)
    return QuantizedWeight("int8", q, scale)


def quantize_int4(w: torch.Tensor) -> QuantizedWeight:
    """Asymmetric int4 in groups of 32, fp16 scale (max - min) / 15 and lo = min
    each (Q4_1's rule); q is rounded against the fp16 values it is stored with."""
    n, k = w.shape
    if k % INT4_GROUP_SIZE:
        raise ValueError(f"int4 needs in_features ({k}) divisible by the group size "
                         f"{INT4_GROUP_SIZE}")
    g = k // INT4_GROUP_SIZE
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, g, dtype=torch.float16, device=w.device)
    lo = torch.empty(n, g, dtype=torch.float16, device=w.device)
    for r in range(0, n, _CHUNK_ROWS):
        wg = w[r:r + _CHUNK_ROWS].float().view(-1, g, INT4_GROUP_SIZE)
        lo[r:r + _CHUNK_ROWS] = wg.amin(-1)
        lo_f = lo[r:r + _CHUNK_ROWS].float()[..., None]
        scale[r:r + _CHUNK_ROWS] = (wg.amax(-1, keepdim=True) - lo_f)[..., 0] / 15.0
        s = scale[r:r + _CHUNK_ROWS].float().clamp_min(1e-30)[..., None]
        q = torch.round((wg - lo_f) / s).clamp(0, 15).to(torch.uint8).view(-1, g, 2, 16)
        packed[r:r + _CHUNK_ROWS] = (q[:, :, 0] | (q[:, :, 1] << 4)).view(-1, k // 2)
    return QuantizedWeight("int4", packed, scale, lo)


def _tile_pack(u8: torch.Tensor, group: int, flip: int = 0,
               alloc: Allocator = _torch_empty) -> torch.Tensor:
    """uint8 [n, k] -> tiles [ceil(n / 16), kp / 4, 16, 4] (kp: k padded to whole
    groups of ``group`` bytes with 0), every byte XORed with ``flip``: each 64
    bytes hold 4 consecutive columns of a tile's 16 rows
    (tandem/kernels/csrc/quant_linear.h). Tile by tile, so no second full-size
    temporary; 4 bytes move as one int32 and the flip rides along (a uint8
    permute and a separate XOR took 3x as long: packing is seconds of an 8B
    model's load)."""
    n, k = u8.shape
    tiles, kp = -(-n // 16), -(-k // group) * group
    if (tiles * 16, kp) != (n, k):
        padded = torch.zeros(tiles * 16, kp, dtype=torch.uint8)
        padded[:n, :k] = u8
        u8 = padded
    words = u8.contiguous().view(torch.int32)  # [tiles * 16, kp / 4]
    flip32 = torch.tensor([flip] * 4, dtype=torch.uint8).view(torch.int32).item()
    packed = alloc((tiles, kp // 4, 16), torch.int32)
    step = _CHUNK_ROWS // 16
    for t in range(0, tiles, step):
        chunk = words[t * 16:(t + step) * 16].view(-1, 16, kp // 4).transpose(1, 2)
        torch.bitwise_xor(chunk, flip32, out=packed[t:t + step])
    return packed.view(torch.uint8).view(tiles, kp // 4, 16, 4)


_NONE = torch.empty(0)  # an unused tensor argument of the C++ decode step


def _tile_groups(v: torch.Tensor) -> torch.Tensor:
    """Per-group values fp16 [n, G] -> [ceil(n / 16), G, 16]: a tile's together."""
    n, g = v.shape
    tiles = -(-n // 16)
    padded = torch.zeros(tiles * 16, g, dtype=torch.float16)
    padded[:n] = v
    return padded.view(tiles, 16, g).transpose(1, 2).contiguous()


class Int8Linear(_QuantLinear):
    def __init__(self, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
                 alloc: Allocator = _torch_empty) -> None:
        """From a float weight (one fp32 scale per output channel: on the default
        model it measured better than per group and reads fewer bytes) or from
        int8 blocks (exact, e.g. a GGUF's Q8_0)."""
        if isinstance(w, QuantizedWeight):
            q, gs = w.data, w.scale
            self.scale = torch.ones(q.shape[0], device=q.device)
        else:
            gs = None
            self.scale = torch.empty(w.shape[0], device=w.device)  # [out]
            q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
            for r in range(0, w.shape[0], _CHUNK_ROWS):
                rows = slice(r, r + _CHUNK_ROWS)
                wr = w[rows].float()
                self.scale[rows] = (wr.abs().amax(1) / 127.0).clamp_min(1e-12)
                q[rows] = torch.round(wr / self.scale[rows, None]).clamp(-127, 127)
        out_f, in_f = q.shape
        self.group_scale = gs  # fp16 [out, in / 32] or None
        self.bias = bias
        self.cpu = q.device.type == "cpu"
        self._nbytes = out_f * in_f + out_f * 4 + (0 if gs is None else gs.numel() * 2)
        self.kernel = self.cpu and custom_ops.available()
        if self.kernel:
            # int8 x + 128 as uint8 is x's bits with the top one flipped (padding 0 too).
            self.wpack = _tile_pack(q.view(torch.uint8), INT8_GROUP_SIZE, flip=128, alloc=alloc)
            self.w_scale = torch.zeros(self.wpack.shape[0] * 16)
            self.w_scale[:out_f] = self.scale
            # Group scales come from blocks of 32 (in_features % 32 == 0): no padding.
            self.g_pack = torch.empty(0, dtype=torch.float16) if gs is None else _tile_groups(gs)
            self.out_features = out_f
        else:
            self.q = q  # [out, in], dequantized per call (no kernel for it here)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32, as the torch paths multiply it."""
        w = self.q.float() * self.scale[:, None].to(self.q.device)
        if self.group_scale is None:
            return w
        n, k = w.shape
        gs = self.group_scale.float()[..., None]
        return (w.view(n, -1, INT8_GROUP_SIZE) * gs).view(n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return torch.ops.tandem.int8_linear(
                x.float(), self.wpack, self.w_scale, self.g_pack, self.out_features).to(x.dtype)
        if self.cpu:  # the same arithmetic in torch (float-exact up to rounding): slower
            return torch.mm(quantize_activations(x.float()), self.dequantize().t()).to(x.dtype)
        return torch.mm(x, self.dequantize().to(x.dtype).t())

    @property
    def step_args(self) -> tuple[int, list[torch.Tensor]] | None:
        return (WeightKind.INT8, [self.wpack, self.w_scale, self.g_pack]) if self.kernel else None

    @property
    def nbytes(self) -> int:
        return self._nbytes


class Int4Linear(_QuantLinear):
    def __init__(self, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
                 alloc: Allocator = _torch_empty) -> None:
        """From a float weight (quantized per group of 32, with lo) or from int4
        blocks (exact, e.g. a GGUF's Q4_0 / Q4_1 / Q4_K)."""
        qw = w if isinstance(w, QuantizedWeight) else quantize_int4(w)
        n, k = qw.shape
        self.bias = bias
        self.cpu = qw.data.device.type == "cpu"
        self.kernel = self.cpu and custom_ops.available()
        self.fixed_offset = qw.lo is None  # Q4_0: w = (q - 8) * scale
        groups = k // INT4_GROUP_SIZE
        self._nbytes = n * k // 2 + n * groups * 2 * (1 if self.fixed_offset else 2)
        self.out_features = n
        if self.kernel:
            # A row's bytes are already 16 low + 16 high nibbles per group: the
            # kernel's chunks are those bytes tiled as int8's are (padding 0),
            # each tile's group followed by its fp16 scales and lo (if any), so
            # a tile is one stream (tandem/kernels/csrc/quant_linear.h).
            nib = _tile_pack(qw.data, INT4_GROUP_SIZE // 2)
            tiles = nib.shape[0]
            parts = [nib.view(tiles, groups, 256), _tile_groups(qw.scale).view(torch.uint8)]
            if not self.fixed_offset:
                parts.append(_tile_groups(qw.lo).view(torch.uint8))
            group_bytes = sum(p.shape[2] for p in parts)  # 288 or 320
            self.packed = torch.cat(parts, dim=2, out=alloc((tiles, groups, group_bytes),
                                                           torch.uint8))
        else:
            self._weight = qw  # dequantized per call (no kernel for it here)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            y = torch.ops.tandem.int4_linear(x.float(), self.packed, self.out_features)
            return y.to(x.dtype)
        w = self._weight.dequantize()
        if self.cpu:  # the kernel's arithmetic (W4A8) in torch: slower
            return torch.mm(quantize_activations(x.float()), w.t()).to(x.dtype)
        return torch.mm(x, w.to(x.dtype).t())

    @property
    def step_args(self) -> tuple[int, list[torch.Tensor]] | None:
        return (WeightKind.INT4, [self.packed, _NONE, _NONE]) if self.kernel else None

    @property
    def nbytes(self) -> int:
        return self._nbytes


Linear = DenseLinear | Int8Linear | Int4Linear

_DENSE_LEVELS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def quantization_level(lin: Linear) -> str:
    """The weight format as Ollama and llama.cpp name it: F32 / BF16 / F16, Q8_0
    (int8 with a scale per group of 32), INT8 (a scale per output channel), Q4_0
    (int4 with a scale per group of 32 and the fixed offset 8), Q4_1 (int4 with
    a scale and a minimum per group of 32: tandem's own int4, and Q4_K's)."""
    if isinstance(lin, Int8Linear):
        return "INT8" if lin.group_scale is None else "Q8_0"
    if isinstance(lin, Int4Linear):
        return "Q4_0" if lin.fixed_offset else "Q4_1"
    return _DENSE_LEVELS.get(lin.w.dtype, str(lin.w.dtype))


def make_linear(
    w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
    quantization: str = "none", alloc: Allocator = _torch_empty,
) -> Linear:
    """The Linear for a weight: float weights are quantized to ``quantization``;
    blocks are kept as they are when the kinds match, else dequantized first.
    ``alloc`` places a quantized Linear's packed weights."""
    if isinstance(w, QuantizedWeight) and w.kind != quantization:
        w = w.dequantize()
    if quantization == "int8":
        return Int8Linear(w, bias, alloc)
    if quantization == "int4":
        return Int4Linear(w, bias, alloc)
    if quantization != "none":
        raise ValueError(f"a weight is none, int8 or int4, not {quantization!r}")
    return DenseLinear(w, bias)
