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

from enum import IntEnum

import torch
import torch.nn.functional as F

from tandem.kernels import custom_ops
from tandem.model.hugepages import Allocator

INT4_GROUP_SIZE = 32
INT8_GROUP_SIZE = 32  # inputs per activation scale (tandem/kernels/csrc/quant_linear.h: kInt8Group)

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
    quantizer produced it, before it is packed for a kernel: int8 ``data`` [out,
    in / 32, 32] with fp16 ``scale`` [out, in / 32], a scale per group of 32
    inputs (GGUF's Q8_0: w = q * d), or int4 ``data`` uint8 [out, in / 32, 16]
    with fp16 ``scale`` and ``lo`` per group (GGUF's Q4_0 / Q4_1 nibble layout:
    byte i of a group holds weight i in its low nibble and 16 + i in its high
    one; w = q * scale + lo), ``lo`` None for Q4_0's fixed offset (w = (q - 8) *
    scale). Any of them may be a strided view (a GGUF's blocks as the file
    holds them: the kernels' packing reads them in place). Rows are
    independent, so fused matmuls take a list of parts without requantizing."""

    def __init__(self, kind: str, data: torch.Tensor, scale: torch.Tensor,
                 lo: torch.Tensor | None = None) -> None:
        if data.dim() == 2:  # [out, bytes]: a view, grouped
            data = data.reshape(data.shape[0], -1, _GROUP_BYTES[kind])
        self.kind, self.data, self.scale, self.lo = kind, data, scale, lo

    def to(self, device: torch.device) -> QuantizedWeight:
        lo = None if self.lo is None else self.lo.to(device)
        return QuantizedWeight(self.kind, self.data.to(device), self.scale.to(device), lo)

    @property
    def shape(self) -> tuple[int, int]:
        n, g, _ = self.data.shape
        return n, g * INT8_GROUP_SIZE  # int4's groups are as wide (INT4_GROUP_SIZE)

    def lo_or_offset(self) -> torch.Tensor:
        """lo, or the fixed offset's (-8 scale: Q4_0's, exact in fp16) beside weights with lo."""
        return self.lo if self.lo is not None else self.scale * -8

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
            lo = torch.cat([p.lo_or_offset() for p in parts])
        return QuantizedWeight(kind, torch.cat([p.data for p in parts]),
                               torch.cat([p.scale for p in parts]), lo)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in]."""
        n, k = self.shape
        s = self.scale.float()[..., None]
        if self.kind == "int8":
            return (self.data.float() * s).view(n, k)
        q = unpack_int4(self.data).float()
        if self.lo is None:
            return ((q - 8) * s).view(n, k)
        return (q * s + self.lo.float()[..., None]).view(n, k)


_GROUP_BYTES = {"int8": INT8_GROUP_SIZE, "int4": INT4_GROUP_SIZE // 2}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, G, 16] in QuantizedWeight's int4 layout -> uint8 [n, G, 32] values 0..15."""
    return torch.cat((packed & 15, packed >> 4), -1)


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


Parts = QuantizedWeight | list[QuantizedWeight]  # a weight, or its rows in parts (fused)


def _parts(w: Parts) -> list[QuantizedWeight]:
    return w if isinstance(w, list) else [w]


class _Tiles:
    """A packed weight's tile buffer [ceil(n / 16), G, group bytes] (the layout of
    tandem/kernels/csrc/quant_linear.h), filled part by part at row offsets by
    the C++ packer (tile_pack.h), straight from each part's (strided) arrays."""

    def __init__(self, n: int, groups: int, group_bytes: int, alloc: Allocator,
                 pad: int = 0) -> None:
        self.tiles = -(-n // 16)
        self.buf = alloc((self.tiles, groups, group_bytes), torch.uint8)
        if n % 16:  # rows past n: a zero weight (pad: its byte), scale 0
            self.buf[-1].fill_(pad)

    def bytes(self, src: torch.Tensor, row0: int, flip: int = 0) -> None:
        torch.ops.tandem.pack_tile_bytes(self.buf, src, row0, flip)

    def halves(self, src: torch.Tensor, row0: int, offset: int) -> None:
        torch.ops.tandem.pack_tile_halves(self.buf, src, row0, offset)


_NONE = torch.empty(0)  # an unused tensor argument of the C++ decode step


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] -> int8 [out, in] and an fp32 scale per output channel."""
    scale = torch.empty(w.shape[0], device=w.device)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for r in range(0, w.shape[0], _CHUNK_ROWS):
        rows = slice(r, r + _CHUNK_ROWS)
        wr = w[rows].float()
        scale[rows] = (wr.abs().amax(1) / 127.0).clamp_min(1e-12)
        q[rows] = torch.round(wr / scale[rows, None]).clamp(-127, 127)
    return q, scale


class Int8Linear(_QuantLinear):
    def __init__(self, w: torch.Tensor | Parts, bias: torch.Tensor | None = None,
                 alloc: Allocator = _torch_empty) -> None:
        """From a float weight (one fp32 scale per output channel: on the default
        model it measured better than per group and reads fewer bytes) or from
        int8 blocks (exact, e.g. a GGUF's Q8_0), whole or as a fused matmul's parts."""
        if isinstance(w, torch.Tensor):
            q, self.scale = _int8_per_channel(w)
            k = q.shape[1]
            kp = -(-k // INT8_GROUP_SIZE) * INT8_GROUP_SIZE  # zero inputs to whole groups
            q = q if kp == k else F.pad(q, (0, kp - k))
            parts = [(q.view(q.shape[0], -1, INT8_GROUP_SIZE), None)]
        else:
            parts = [(p.data, p.scale) for p in _parts(w)]
            k = parts[0][0].shape[1] * INT8_GROUP_SIZE
            self.scale = torch.ones(sum(d.shape[0] for d, _ in parts), device=parts[0][0].device)
        out_f, groups = self.scale.shape[0], parts[0][0].shape[1]
        self.grouped = grouped = parts[0][1] is not None  # Q8_0's scales per group of 32
        self.bias = bias
        self.cpu = self.scale.device.type == "cpu"
        self._nbytes = out_f * k + out_f * 4 + (out_f * groups * 2 if grouped else 0)
        self.out_features = out_f
        self.kernel = self.cpu and custom_ops.available()
        if self.kernel:
            # int8 x + 128 as uint8 is x's bits with the top one flipped.
            tiles = _Tiles(out_f, groups, 16 * INT8_GROUP_SIZE, alloc, pad=128)
            gs = _Tiles(out_f, groups, 32, alloc) if grouped else None
            row0 = 0
            for data, scale in parts:
                tiles.bytes(data, row0, flip=128)
                if gs is not None:
                    gs.halves(scale, row0, 0)
                row0 += data.shape[0]
            self.wpack = tiles.buf.view(tiles.tiles, -1, 16, 4)  # [tiles, kp / 4, 16, 4]
            self.w_scale = torch.zeros(tiles.tiles * 16)
            self.w_scale[:out_f] = self.scale
            # fp16 [tiles, G, 16]: each tile's group scales together
            self.g_pack = (torch.empty(0, dtype=torch.float16) if gs is None
                           else gs.buf.view(torch.float16))
        else:  # dequantized per call (no kernel for it here)
            self.q = torch.cat([d for d, _ in parts]).view(out_f, -1)[:, :k]
            self.group_scale = torch.cat([s for _, s in parts]) if grouped else None

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
    def __init__(self, w: torch.Tensor | Parts, bias: torch.Tensor | None = None,
                 alloc: Allocator = _torch_empty) -> None:
        """From a float weight (quantized per group of 32, with lo) or from int4
        blocks (exact, e.g. a GGUF's Q4_0 / Q4_1 / Q4_K), whole or as a fused
        matmul's parts."""
        parts = [quantize_int4(w)] if isinstance(w, torch.Tensor) else _parts(w)
        n = sum(p.data.shape[0] for p in parts)
        groups = parts[0].data.shape[1]
        self.bias = bias
        self.cpu = parts[0].data.device.type == "cpu"
        self.kernel = self.cpu and custom_ops.available()
        self.fixed_offset = all(p.lo is None for p in parts)  # Q4_0: w = (q - 8) * scale
        self._nbytes = n * groups * (16 + 2 * (1 if self.fixed_offset else 2))
        self.out_features = n
        if self.kernel:
            # A row's bytes are already 16 low + 16 high nibbles per group: tiled
            # as int8's are, each tile's group followed by its fp16 scales and lo
            # (if any), so a tile is one stream (tandem/kernels/csrc/quant_linear.h).
            tiles = _Tiles(n, groups, 256 + 32 * (1 if self.fixed_offset else 2), alloc)
            row0 = 0
            for p in parts:
                tiles.bytes(p.data, row0)
                tiles.halves(p.scale, row0, 256)
                if not self.fixed_offset:
                    tiles.halves(p.lo_or_offset(), row0, 288)
                row0 += p.data.shape[0]
            self.packed = tiles.buf
        else:  # dequantized per call (no kernel here), from copies, not a file's mapping
            w = QuantizedWeight.cat(parts)
            self._weight = QuantizedWeight(w.kind, w.data.contiguous(), w.scale.contiguous(),
                                           None if w.lo is None else w.lo.contiguous())

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
        return "Q8_0" if lin.grouped else "INT8"
    if isinstance(lin, Int4Linear):
        return "Q4_0" if lin.fixed_offset else "Q4_1"
    return _DENSE_LEVELS.get(lin.w.dtype, str(lin.w.dtype))


def make_linear(
    w: torch.Tensor | Parts, bias: torch.Tensor | None = None,
    quantization: str = "none", alloc: Allocator | None = None,
) -> Linear:
    """The Linear for a weight (or a fused matmul's parts): float weights are
    quantized to ``quantization``; blocks are kept as they are when the kinds
    match, else dequantized first. ``alloc`` places a quantized Linear's packed
    weights (the loader passes a HugePageArena's: decode streams them faster;
    None: torch.empty)."""
    if not isinstance(w, torch.Tensor) and any(p.kind != quantization for p in _parts(w)):
        w = torch.cat([p.dequantize() for p in _parts(w)])
    if quantization == "int8":
        return Int8Linear(w, bias, alloc or _torch_empty)
    if quantization == "int4":
        return Int4Linear(w, bias, alloc or _torch_empty)
    if quantization != "none":
        raise ValueError(f"a weight is none, int8 or int4, not {quantization!r}")
    return DenseLinear(w, bias)
