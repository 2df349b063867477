"""A GGUF header walk: metadata and the tensor table, without the payloads.

gguf.GGUFReader builds a numpy view of every metadata item, so the default
model's 49k tokenizer strings and 49k merges take it 2.5-5 s to parse. The
planner only needs scalar metadata, array lengths and tensor shapes/types,
which a sequential walk of the header reads in milliseconds (skipping string
arrays element by element, numeric arrays in one seek). The format and type
sizes come from the gguf package, so new quantization types are covered.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALAR = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
MAX_ARRAY_VALUES = 4096  # numeric arrays longer than this are kept as their length only


@dataclass(frozen=True)
class ArrayLen:
    """A long or string array, summarised by its element count."""

    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str
    n_elements: int
    n_bytes: int


class _Stream:
    def __init__(self, f: IO[bytes], endian: str) -> None:
        self.f, self.e = f, endian

    def read(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack(self.e + fmt, data)[0]

    def string(self) -> str:
        n = self.read("Q")
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("truncated GGUF header")
        return data.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.f.seek(self.read("Q"), 1)

    def value(self, vtype: int) -> Any:
        vt = GGUFValueType(vtype)
        if vt == GGUFValueType.STRING:
            return self.string()
        if vt == GGUFValueType.ARRAY:
            etype, count = GGUFValueType(self.read("I")), self.read("Q")
            if etype == GGUFValueType.STRING:
                for _ in range(count):
                    self.skip_string()
                return ArrayLen(count)
            if etype == GGUFValueType.ARRAY:
                raise ValueError("nested GGUF arrays are not supported")
            fmt = _SCALAR[etype]
            if count > MAX_ARRAY_VALUES:
                self.f.seek(count * struct.calcsize(fmt), 1)
                return ArrayLen(count)
            return [self.read(fmt) for _ in range(count)]
        return self.read(_SCALAR[vt])


def read_gguf_header(path: str) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensors) of a GGUF file; ValueError if it is not one."""
    with open(path, "rb") as raw:
        if raw.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version_bytes = raw.read(4)
        endian = "<" if struct.unpack("<I", version_bytes)[0] < 0x10000 else ">"
        s = _Stream(raw, endian)
        version = struct.unpack(endian + "I", version_bytes)[0]
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (need 2 or later)")
        n_tensors, n_kv = s.read("Q"), s.read("Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = s.string()
            meta[key] = s.value(s.read("I"))
        tensors = []
        for _ in range(n_tensors):
            name = s.string()
            shape = tuple(s.read("Q") for _ in range(s.read("I")))
            ttype = GGMLQuantizationType(s.read("I"))
            s.read("Q")  # offset into the data section
            n = 1
            for d in shape:
                n *= d
            block, size = GGML_QUANT_SIZES[ttype]
            tensors.append(TensorInfo(name, shape, ttype.name, n, n // block * size))
    return meta, tensors


def window_fields(arch: str, get: Callable[[str], Any], n_layers: int,
                  src: object) -> dict[str, Any]:
    """The config.json fields of a GGUF's sliding windows (read by
    tandem.model.hf_config.sliding_window), from ``get(key)``: the metadata
    value of ``{arch}.{key}`` (arrays as lists) or None. phi3's window 0 means
    none; llama's is not read (HF's Llama has none); gemma3's is every 6th
    layer global unless Ollama's file names the windowed ones."""
    out: dict[str, Any] = {}
    window = get("attention.sliding_window")
    if arch in ("phi3", "gemma2", "gemma3") and window:
        out["sliding_window"] = int(window)
    if arch == "gemma3":
        out["sliding_window_pattern"] = 6
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            if len(pattern) != n_layers:
                raise ValueError(f"{src}: {arch}.attention.sliding_window_pattern has "
                                 f"{len(pattern)} entries for {n_layers} layers")
            out["layer_types"] = ["sliding_attention" if p else "full_attention"
                                  for p in pattern]
    return out
