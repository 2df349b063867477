"""Perplexity of the default model in each GGUF type llama.cpp writes, as tandem runs it.

The source is the default model's GGUF. Its tensor types are read and printed;
where its matmuls are already quantized (the shipped SmolLM2 file is Q4_1 with
a Q8_0 tied embedding), the "F32" reference is that file dequantized, and every
other type is requantized from it, so all of them carry the source's loss: the
table measures what each format adds on top, and the source's own type
reproduces the source (the script checks this byte for byte).

Tensor types per file follow llama-quantize's defaults for the type: every 2-D
matrix in the type, except the output matrix (output.weight, or token_embd
when the LM head is tied to it), which quantized types write as Q6_K (Q8_0
stays Q8_0); rows that are not whole blocks of a K-quant's 256 fall back to
what llama.cpp uses instead (Q6_K -> Q8_0, Q4_K -> Q5_0, Q5_K -> Q5_1): the
default model's 576-wide rows get a Q8_0 embedding in every quantized file.
"Q4_K" is every matrix Q4_K (llama-quantize's Q4_K_S/M also promote a few to
Q5_K/Q6_K). Types the installed gguf package cannot quantize to (the K-quants
in gguf 0.19) are listed and skipped. 1-D norm weights stay F32.

Each file is loaded twice: ``quantization="auto"`` keeps its block formats
(Q8_0 as int8 groups of 32, Q4_0 / Q4_1 / Q4_K as int4 groups of 32, other
block formats requantized to int8 groups of 32, float types as fp32; int8 and
int4 matmuls quantize their activations per group of 32: W8A8 / W4A8), and
``quantization="none"`` dequantizes every weight to fp32, which isolates the
weight format's cost from tandem's activation quantization. Deltas are
against the F32 file with "none".

Files are cached as ``$TANDEM_CACHE/gguf-formats/<source stem>-<type>-<key>.gguf``
(key: the source's path, size and mtime, and FORMAT_VERSION).

    .venv/bin/python benchmarks/gguf_formats.py [--types F32,Q8_0,Q4_0] [--window 512]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
from common import set_threads
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize
from quantization import TEXT, nll
from synthetic_gguf import K_FALLBACK, can_quantize, copy_fields, write_atomically

from tandem import LLM
from tandem.model.linear import Int4Linear, Int8Linear, Linear
from tandem.paths import cache_root_dir, default_model_path

FORMAT_VERSION = 1  # bump when the written files change (the cache key carries it)
# llama-quantize's type names, widest first, with the general.file_type each writes.
TYPES = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
}
FLOATS = frozenset({Q.F32, Q.F16, Q.BF16})
# Set by GGUFWriter itself, or rewritten for the new type.
OWN_FIELDS = frozenset({"general.architecture", "general.file_type",
                        "general.quantization_version"})


def category(t: gguf.ReaderTensor, tied: bool) -> str:
    """What a tensor is to the model, for the type rules and the summaries."""
    if len(t.shape) == 1:
        return "norms"
    if t.name == "output.weight":
        return "output"
    if t.name == "token_embd.weight":
        return "token_embd (tied LM head)" if tied else "token_embd"
    return "layer matmuls"


def is_tied(reader: gguf.GGUFReader) -> bool:
    return all(t.name != "output.weight" for t in reader.tensors)


def type_summary(reader: gguf.GGUFReader) -> dict[str, Counter[str]]:
    """{category: Counter of GGUF type names}."""
    tied = is_tied(reader)
    out: dict[str, Counter[str]] = {}
    for t in reader.tensors:
        out.setdefault(category(t, tied), Counter())[t.tensor_type.name] += 1
    return out


def names(types: Counter[str]) -> str:
    return "+".join(sorted(types))


def tensor_type(t: gguf.ReaderTensor, target: Q, tied: bool) -> Q:
    """The type llama-quantize gives tensor t in a file of type target."""
    if len(t.shape) == 1:
        return t.tensor_type
    if target in FLOATS:
        return target
    qtype = target
    if category(t, tied) in ("output", "token_embd (tied LM head)") and target != Q.Q8_0:
        qtype = Q.Q6_K
    if qtype in K_FALLBACK and int(t.shape[0]) % 256:  # t.shape[0]: the row length
        qtype = K_FALLBACK[qtype]
    return qtype


def plan(reader: gguf.GGUFReader, name: str) -> list[tuple[gguf.ReaderTensor, Q]]:
    """(tensor, its type in a file of type name) for reader's tensors, in file order."""
    tied = is_tied(reader)
    return [(t, tensor_type(t, Q[name], tied)) for t in reader.tensors]


def requantize(reader: gguf.GGUFReader, dest: Path, name: str) -> None:
    """Write reader's model to dest in type name: the metadata and tokenizer copied, each
    2-D tensor dequantized and quantized again, one at a time."""
    w = gguf.GGUFWriter(str(dest), reader.fields["general.architecture"].contents())
    copy_fields(w, reader, lambda key: not key.startswith("GGUF.") and key not in OWN_FIELDS)
    w.add_file_type(int(TYPES[name]))
    if Q[name] not in FLOATS:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensors = plan(reader, name)
    for t, qtype in tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        nbytes = int(np.prod(quant_shape_to_byte_shape(shape, qtype)))
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, qtype in tensors:
        if len(t.shape) == 1:
            w.write_tensor_data(np.asarray(t.data))
        else:
            w.write_tensor_data(quantize(dequantize(t.data, t.tensor_type), qtype))
    w.close()


def cached_copy(src: Path, reader: gguf.GGUFReader, name: str) -> Path:
    """The cached copy of src in type name, written first if absent."""
    st = src.stat()
    key = hashlib.sha256(repr((str(src.resolve()), st.st_size, st.st_mtime_ns,
                               FORMAT_VERSION)).encode()).hexdigest()[:12]
    dest = cache_root_dir() / "gguf-formats" / f"{src.stem}-{name}-{key}.gguf"
    if not dest.is_file():
        write_atomically(dest, lambda tmp: requantize(reader, tmp, name))
    return dest


def same_blocks(a: gguf.GGUFReader, b: gguf.GGUFReader) -> tuple[int, int]:
    """(matrices of a that b holds in the same type with the same bytes, matrices of a)."""
    other = {t.name: t for t in b.tensors}
    mats = [t for t in a.tensors if len(t.shape) == 2]
    same = sum(t.tensor_type == other[t.name].tensor_type
               and np.array_equal(t.data, other[t.name].data) for t in mats)
    return same, len(mats)


def weight_error(ref: gguf.GGUFReader, copy: gguf.GGUFReader) -> float:
    """RMS of (copy - ref) over the layer matmuls relative to ref's RMS: the rounding
    noise the copy's type added to the weights."""
    other = {t.name: t for t in copy.tensors}
    tied = is_tied(ref)
    err = total = 0.0
    for t in ref.tensors:
        if category(t, tied) == "layer matmuls":
            w = dequantize(t.data, t.tensor_type).astype(np.float64)
            c = other[t.name]
            err += float(np.sum((dequantize(c.data, c.tensor_type) - w) ** 2))
            total += float(np.sum(w**2))
    return math.sqrt(err / total)


def tandem_format(lin: Linear) -> str:
    """How tandem holds a Linear: int8 / int4 groups of 32, int8 per channel, or floats."""
    if isinstance(lin, Int4Linear):
        return "int4 g32"
    if isinstance(lin, Int8Linear):
        return "int8 g32" if lin.grouped else "int8 ch"
    return str(lin.w.dtype).removeprefix("torch.")


def evaluate(path: Path, quantization: str, window: int, threads: int
             ) -> tuple[list[int], float, str, str]:
    """(token ids of the eval text, mean NLL, layer matmuls' format, LM head's format).

    The KV cache is fp32 (not CPU's default fp16) so the table measures the weight
    formats alone; benchmarks/quantization.py measures the cache's own cost."""
    llm = LLM(model=str(path), quantization=quantization, num_threads=threads,
              kv_cache_memory="256MiB", kv_cache_dtype="fp32", max_model_len=2048)
    ids = llm.get_tokenizer().encode(TEXT.read_text())
    model = llm.engine.model
    layers = {tandem_format(lin) for layer in model.layers
              for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    result = ids, nll(llm, ids, window), "+".join(sorted(layers)), tandem_format(model.lm_head)
    del llm, model
    gc.collect()
    return result


def bits_per_weight(qtype: str) -> float:
    block, nbytes = gguf.GGML_QUANT_SIZES[Q[qtype]]
    return 8 * nbytes / block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(TYPES),
                    help="comma-separated llama-quantize type names; F32 is always included")
    ap.add_argument("--window", type=int, default=512, help="tokens scored per forward pass")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    wanted = ["F32"] + [t.upper() for t in a.types.split(",") if t.upper() != "F32"]
    unknown = [t for t in wanted if t not in TYPES]
    if unknown:
        raise SystemExit(f"unknown types {unknown}; choose from {list(TYPES)}")

    src = default_model_path()
    reader = gguf.GGUFReader(str(src))
    summary = type_summary(reader)
    print(f"source: {src} ({src.stat().st_size / 1e6:.1f} MB)")
    for cat, types in summary.items():
        print(f"  {cat}: " + ", ".join(f"{n} {t}" for t, n in sorted(types.items())))
    stored = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    lossy = sorted(set(stored) - {q.name for q in FLOATS})
    if lossy:
        print(f"caveat: the source's matrices are already {'/'.join(lossy)}: the F32 reference "
              "is that file dequantized, not the original\n  model, and every type below is "
              "requantized from it, so each row shows the loss that type adds on top of the "
              "source's.\n  A finer type's levels do not include the source's (Q5_1's 32 per "
              "block fall on 2 of Q4_1's 16), so requantizing\n  adds rounding noise of its "
              "own (w err): the deltas overstate what such a type costs on an unquantized "
              "original")

    types, skipped = [], []
    for name in wanted:
        missing = sorted({q.name for _, q in plan(reader, name) if not can_quantize(q)})
        if missing:
            skipped.append(f"{name} (needs {'/'.join(missing)})")
        else:
            types.append(name)
    if skipped:
        print(f"skipped, gguf {version('gguf')} cannot quantize to: {', '.join(skipped)}")

    rows, ref_ids, ref = [], None, None
    for name in types:
        path = cached_copy(src, reader, name)
        copy = gguf.GGUFReader(str(path))
        if name in summary["layer matmuls"]:
            same, total = same_blocks(reader, copy)
            print(f"{name} copy: {same}/{total} matrices byte-identical to the source's")
        results = {}
        for quant in ("none", "auto"):
            ids, loss, layers, head = evaluate(path, quant, a.window, a.threads)
            if ref_ids is None:
                ref_ids, ref = ids, loss
            elif ids != ref_ids:
                raise SystemExit(f"{path}: its tokenizer encodes the eval text differently")
            results[quant] = (loss, layers, head)
        s = type_summary(copy)
        embd = names(s.get("token_embd (tied LM head)") or s["token_embd"])
        rows.append((name, names(s["layer matmuls"]), embd, path.stat().st_size,
                     weight_error(reader, copy), results))

    print(f"\neval: {TEXT.name}, {len(ref_ids)} tokens in windows of {a.window}; "
          f"delta vs F32 loaded with quantization=none; {a.threads} threads")
    print(f"{'type':5} {'matmuls':>7} {'embd':>5} {'bpw':>5} {'MB':>6} {'w err':>6} | "
          f"{'none: NLL':>9} {'PPL':>6} {'dNLL':>7} | "
          f"{'auto: layers':>12} {'head':>8} {'NLL':>7} {'PPL':>6} {'dNLL':>7}")
    for name, mats, embd, size, werr, res in rows:
        n_loss = res["none"][0]
        a_loss, layers, head = res["auto"]
        bpw = bits_per_weight(mats) if "+" not in mats else float("nan")
        print(f"{name:5} {mats:>7} {embd:>5} {bpw:5.2f} {size / 1e6:6.1f} {werr:6.4f} | "
              f"{n_loss:9.4f} {math.exp(n_loss):6.2f} {n_loss - ref:+7.4f} | "
              f"{layers:>12} {head:>8} {a_loss:7.4f} {math.exp(a_loss):6.2f} "
              f"{a_loss - ref:+7.4f}")
    print("bpw: bits per weight of the layer matmuls' type; w err: RMS(copy - source) / "
          "RMS(source) over the layer matmuls; dNLL = NLL - F32's; PPL = exp(NLL)")


if __name__ == "__main__":
    main()
