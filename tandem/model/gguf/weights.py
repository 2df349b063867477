"""A GGUF's tensors read in place, one at a time, in their own formats.

Block formats come back as tandem's int8 / int4 groups (``blocks``), floats
as fp32 tensors: a multi-GB model never has an fp32 copy of its weights.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.model.gguf.blocks import BLOCK_DECODERS, quantized_weight
from tandem.model.gguf.metadata import FLOAT_TYPES, BadMetadata, checked

TENSORS_FILE = "gguf_tensors.json"  # beside config.json in gguf_to_hf_dir's directory


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in its GGUF and how it is stored: what reading it takes,
    without gguf's reader (which parses every metadata array, the vocabulary's
    too: slow for a large vocabulary, so the conversion caches these)."""

    name: str
    type: str  # GGMLQuantizationType's name
    shape: list[int]  # GGUF's order (innermost first)
    data_offset: int
    n_bytes: int
    dtype: str  # the stored array's numpy dtype and shape
    data_shape: list[int]

    @classmethod
    def of(cls, t) -> StoredTensor:
        """From gguf's ReaderTensor."""
        return cls(t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset),
                   int(t.n_bytes), t.data.dtype.str, [int(d) for d in t.data.shape])


class GGUFWeights:
    """A GGUF's tensors by HF name, each mapped from the file when taken.

    Each tensor has a mapping of its own, not one of the whole file (gguf's
    reader's): mapped pages count in the process's resident memory until
    unmapped, which would hold the whole file resident beside the weights
    built from it. A block format comes back as strided views of its mapped
    blocks, which the Linear packs in place. Given gguf_to_hf_dir's directory
    for the file, the tensors' places come from its cached list instead of a
    parse of the file's metadata.
    """

    # llama.cpp's converter writes Gemma's RMSNorm weights as 1 + w (what they multiply by).
    norms_plus_one = True
    stacked_experts = True  # an MoE layer's experts are 3-D tensors (ffn_*_exps)

    def __init__(self, src: Path, converted: Path | None = None) -> None:
        self.src = src
        listed = None if converted is None else converted / TENSORS_FILE
        if listed is not None and listed.is_file():
            self._names = {hf: (StoredTensor(**t), heads)
                           for hf, (t, heads) in json.loads(listed.read_text()).items()}
        else:
            try:
                _, _, names = checked(src)
            except BadMetadata as e:
                raise ValueError(f"{src} is not a valid GGUF file: {e}") from e
            self._names = {hf: (StoredTensor.of(t), heads) for hf, (t, heads) in names.items()}
        # Are the 2-D weights stored quantized (then --quantization auto keeps them so)?
        self.quantized = any(len(t.shape) == 2 and t.type not in FLOAT_TYPES
                             for t, _ in self._names.values())
        self.num_tensors = len(self._names)
        self.nbytes = sum(t.n_bytes for t, _ in self._names.values())

    def pop(self, name: str):
        """The tensor as a float32 torch tensor, or a QuantizedWeight for block formats
        (KeyError when the file has none of that name)."""
        t, heads = self._names.pop(name)
        raw = _mapped(self.src, t)
        kind = t.type
        if kind in BLOCK_DECODERS and len(t.shape) == 2:
            rows = raw.view(t.data_shape[0], -1)
            if heads:  # rows are whole blocks: reorder the stored rows
                rows = _unpermute(rows, heads)
            try:
                return quantized_weight(*BLOCK_DECODERS[kind](rows))
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"{self.src}: tensor {t.name} ({kind}): {e}") from e
        data = raw.numpy().view(np.dtype(t.dtype)).reshape(t.data_shape)
        w = dequantized(self.src, t, heads, data)
        if np.may_share_memory(w, data):  # F32 as stored: the model's own copy, not the mapping
            w = w.copy()
        w = torch.from_numpy(w)
        if kind in FLOAT_TYPES or w.dim() != 2:
            return w
        # A block format without a kernel of tandem's: int8 in groups of 32.
        from tandem.model.linear import quantize_int8_groups

        return quantize_int8_groups(w)


def _mapped(src: Path, t: StoredTensor) -> torch.Tensor:
    """Tensor t's bytes, uint8, mapped from the file copy-on-write (the file is
    never written; what the model keeps is copied or packed from them). Mapped,
    not read: the kernels' packing reads a block format in place, so a
    quantized tensor is never copied before it is packed. The mapping lives as
    long as a tensor viewing it; mapped pages count as resident only until
    then, one layer's tensors at a time. (Mapping every page up front,
    MAP_POPULATE, measured no faster.)"""
    start = t.data_offset - t.data_offset % mmap.ALLOCATIONGRANULARITY
    try:
        with open(src, "rb") as f:
            m = mmap.mmap(f.fileno(), t.data_offset + t.n_bytes - start,
                          access=mmap.ACCESS_COPY, offset=start)
    except ValueError:  # the file ends before the tensor does
        raise ValueError(f"{src}: tensor {t.name} is truncated") from None
    except OSError:  # a file system without mmap: read the bytes instead
        buf = np.empty(t.n_bytes, dtype=np.uint8)
        with open(src, "rb") as f:
            f.seek(t.data_offset)
            if f.readinto(buf) != t.n_bytes:
                raise ValueError(f"{src}: tensor {t.name} is truncated") from None
        return torch.from_numpy(buf)
    return torch.frombuffer(m, dtype=torch.uint8, count=t.n_bytes, offset=t.data_offset - start)


def dequantized(src: Path, t: StoredTensor, heads: int | None, data: np.ndarray) -> np.ndarray:
    """Tensor t (its stored array: data) as fp32 [rows, cols] (HF's orientation),
    Q/K rows unpermuted."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(t.shape)]
    try:
        w = np.asarray(dequantize(data, GGMLQuantizationType[t.type]), dtype=np.float32)
    except Exception as e:  # unsupported quant type, bad block data
        raise ValueError(
            f"{src}: cannot dequantize tensor {t.name} ({t.type}): {e}") from e
    if list(w.shape) != shape:
        raise ValueError(f"{src}: tensor {t.name} dequantized to {w.shape}, not {shape}")
    return _unpermute(w, heads) if heads else w


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute, which reorders each head's Q/K rows from
    HF's rotate-half RoPE layout to GGML's interleaved one:
    ``reshape(n_head, 2, d, ...).swapaxes(1, 2)``; the inverse swaps back from (n_head, d, 2).
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
