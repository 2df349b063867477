"""Llama- and Gemma-3-architecture GGUF files with random weights, for benchmarks at real
model sizes.

Shapes (Llama 3 layouts; the tokenizer is the default model's, SmolLM2's, so
every token id is valid and the server can tokenize prompts):

* ``1b``: 24 layers, hidden 2048, ffn 8192, 32 heads, 8 KV heads, head_dim 64
  (1.66 B parameters: 1.46 B in the layers, 2 x 0.10 B embedding + LM head;
  Llama-3.2 1B has the same layer shape but 16 layers);
* ``8b``: 32 layers, hidden 4096, ffn 14336, 32 heads, 8 KV heads, head_dim 128
  (7.38 B parameters). Real Llama-3 8B has vocab 128256; we keep the
  tokenizer's 49152 so the ids are valid, so the embedding and LM head hold
  0.65 B fewer parameters than a real one (0.36 GB less at Q4_0, 0.69 GB at
  Q8_0, 1.3 GB at F16). The layers, which decode streams, are the real size.
* ``gemma3-1b``: Gemma 3 1B's layers (arch ``gemma3``): 26 layers, hidden 1152,
  ffn 6912, 4 heads, 1 KV head, head_dim 256, a 512-token window in five
  layers of six, q/k norms and norms on each block's output, a tied LM head
  (0.70 B parameters in the layers; its vocab of 262144 is 49152 here, so the
  embedding is 0.24 B instead of 0.30 B).

Tensor types: ``f16``, ``q8_0``, ``q4_0``: every matrix (token_embd, output,
the layer matmuls) has the type; and ``q4_k_m``, llama.cpp's most pulled mix:
Q4_K, with Q6_K for the LM head and for attn_v and ffn_down in the layers
llama.cpp gives more bits (the first and last eighth, every third between).
gguf.quants cannot quantize K-quants (0.19), so their blocks are random bytes
with small fp16 super-block scales (weights within ~0.1): as random as the
others, and decoded exactly as a real file's. The norm weights are F32 ones.
The Llama shapes' LM head is untied (``output.weight``). Weights are N(0, 0.02),
drawn per row-chunk from a seed derived from (seed, tensor, chunk), so a file is
reproducible. numpy does this
at ~55 M params/s on one core here (threads did not help: 1B in ~30 s, 8B in
~2.5 min).

Memory: the writer emits the header, metadata and tensor table first, then
generates, quantizes and writes one tensor at a time (in row chunks of 64 MB
of float32), so peak RSS is about one quantized tensor plus a chunk, not the
model: 0.45 GiB measured writing 8B Q4_0, 0.54 GiB writing 1B F16.

Files are cached as ``$TANDEM_CACHE/synthetic/llama-<shape>-<type>-v<N>.gguf``
(written under a temporary name, then renamed), so reruns reuse them.

    .venv/bin/python benchmarks/synthetic_gguf.py --shape 1b --type q8_0 [--out PATH] [--force]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape, quantize

FORMAT_VERSION = 1  # bump when the files' content changes (the cache name carries it)
CHUNK_FLOATS = 16 << 20  # float32 elements generated at once per worker (64 MB)
T = TypeVar("T")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    arch: str = "llama"  # "gemma3": its extra norms, a tied LM head, a window
    sliding_window: int = 0


SHAPES = {
    "1b": Shape(layers=24, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64),
    # 1.18 B matmul parameters: the 1.2B model (24 layers, 2048 wide, 2.2 GiB in F16)
    # the targets were set on; "1b" has 1.56 B.
    "1.2b": Shape(layers=24, hidden=2048, ffn=5632, heads=32, kv_heads=8, head_dim=64),
    "8b": Shape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128),
    "gemma3-1b": Shape(layers=26, hidden=1152, ffn=6912, heads=4, kv_heads=1, head_dim=256,
                       context=32768, rope_theta=1e6, rms_eps=1e-6, arch="gemma3",
                       sliding_window=512),
}
TYPES = {
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_k_m": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
}
# K-quant super-blocks: where their fp16 scales lie (d, dmin for Q4_K), with the
# largest value each may take so that |w| stays within ~0.1.
K_BLOCKS = {Q.Q4_K: {0: 1e-4, 2: 1e-4}, Q.Q6_K: {208: 2.5e-5}}


# llama.cpp's stand-in for a K-quant on rows that are not whole 256-blocks.
K_FALLBACK = {Q.Q6_K: Q.Q8_0, Q.Q5_K: Q.Q5_1, Q.Q4_K: Q.Q5_0}


def tensor_type(qtype_name: str, name: str, layers: int, cols: int) -> Q:
    """A tensor of rows of cols values' type in a file of type qtype_name (q4_k_m:
    llama.cpp's mix, and its stand-ins where a row is not whole K-quant blocks, as
    Gemma 3 1B's 1152-wide ones)."""
    qtype = TYPES[qtype_name][0]
    if qtype_name == "q4_k_m":
        if name == "output.weight":
            qtype = Q.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")):
            i = int(name.split(".")[1])  # llama.cpp's use_more_bits
            if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
                qtype = Q.Q6_K
    if cols % gguf.GGML_QUANT_SIZES[qtype][0]:
        return K_FALLBACK.get(qtype, qtype)
    return qtype


def can_quantize(qtype: Q) -> bool:
    """Whether gguf.quants implements quantization to this type (Q4_K: not in gguf 0.19)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    try:
        quantize(np.zeros((1, block), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def available_types() -> list[str]:
    return [t for t, (qtype, _) in TYPES.items() if can_quantize(qtype) or qtype in K_BLOCKS]


def default_path(shape: str, qtype: str) -> Path:
    from tandem.paths import cache_root_dir

    stem = f"llama-{shape}" if SHAPES[shape].arch == "llama" else shape
    return cache_root_dir() / "synthetic" / f"{stem}-{qtype}-v{FORMAT_VERSION}.gguf"


def tensor_list(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy-order shape) of every tensor, in file order; 1-D ones are norms."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    gemma = s.arch == "gemma3"
    out = [("token_embd.weight", (vocab, s.hidden)), ("output_norm.weight", (s.hidden,))]
    if not gemma:  # Gemma's LM head is the embedding
        out.append(("output.weight", (vocab, s.hidden)))
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (s.hidden,)),
            (b + "attn_q.weight", (q, s.hidden)),
            (b + "attn_k.weight", (kv, s.hidden)),
            (b + "attn_v.weight", (kv, s.hidden)),
            (b + "attn_output.weight", (s.hidden, q)),
            (b + "ffn_norm.weight", (s.hidden,)),
            (b + "ffn_gate.weight", (s.ffn, s.hidden)),
            (b + "ffn_up.weight", (s.ffn, s.hidden)),
            (b + "ffn_down.weight", (s.hidden, s.ffn)),
        ]
        if gemma:
            out += [(b + "attn_q_norm.weight", (s.head_dim,)),
                    (b + "attn_k_norm.weight", (s.head_dim,)),
                    (b + "post_attention_norm.weight", (s.hidden,)),
                    (b + "post_ffw_norm.weight", (s.hidden,))]
    return out


def copy_fields(writer: gguf.GGUFWriter, reader: gguf.GGUFReader,
                keep: Callable[[str], bool]) -> None:
    """Copy the metadata fields of reader whose names keep selects, each with its own
    GGUF types (an array keeps its element type)."""
    for name, field in reader.fields.items():
        if keep(name):
            main = field.types[0]
            sub = field.types[-1] if main == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), main, sub_type=sub)


def copy_tokenizer(writer: gguf.GGUFWriter, src: Path) -> int:
    """Copy every ``tokenizer.*`` field of src (tokens, token types, merges, scores if any,
    special ids, chat template, ggml.model/pre) with its own types; return the vocab size."""
    reader = gguf.GGUFReader(str(src))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or not tokens.data:
        raise ValueError(f"{src} has no tokenizer.ggml.tokens")
    copy_fields(writer, reader, lambda name: name.startswith("tokenizer."))
    return len(tokens.data)


def _matrix(shape: tuple[int, int], qtype: Q, seed: int, index: int) -> np.ndarray:
    """One weight matrix, N(0, 0.02), quantized, generated in float32 row chunks."""
    rows, cols = shape
    if qtype in K_BLOCKS and not can_quantize(qtype):
        return _random_k_blocks(shape, qtype, seed, index)
    if qtype == Q.F16:
        out = np.empty(shape, np.float16)
    else:
        out = np.empty(quant_shape_to_byte_shape(shape, qtype), np.uint8)
    step = max(1, CHUNK_FLOATS // cols)
    for k, r0 in enumerate(range(0, rows, step)):
        r1 = min(rows, r0 + step)
        x = np.random.default_rng([seed, index, k]).standard_normal((r1 - r0, cols),
                                                                    dtype=np.float32)
        x *= np.float32(0.02)
        out[r0:r1] = quantize(x, qtype)
        del x
    return out


def _random_k_blocks(shape: tuple[int, int], qtype: Q, seed: int, index: int) -> np.ndarray:
    """K-quant blocks of random bytes, their fp16 scales uniform in [0, K_BLOCKS' bound)."""
    rng = np.random.default_rng([seed, index])
    out = rng.integers(0, 256, quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
    blocks = out.reshape(shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])
    for at, bound in K_BLOCKS[qtype].items():
        d = (rng.random(blocks.shape[:2], dtype=np.float32) * bound).astype(np.float16)
        blocks[:, :, at:at + 2] = d[..., None].view(np.uint8)
    return out


def write_synthetic(path: Path, shape: str, qtype_name: str, *, seed: int = 0,
                    tokenizer_src: Path | None = None,
                    log=None) -> dict:
    """Write the file at path (directly; see synthetic_gguf for the cached, atomic entry
    point). Returns {'seconds', 'bytes', 'params', 'maxrss_bytes'}."""
    from tandem.paths import default_model_path

    s = SHAPES[shape]
    qtype, ftype = TYPES[qtype_name]
    if not (can_quantize(qtype) or qtype in K_BLOCKS):
        raise ValueError(f"this gguf package cannot quantize to {qtype.name}; "
                         f"choose one of {available_types()}")
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"synthetic-{s.arch}-{shape}-{qtype_name}")
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_file_type(int(ftype))
    if qtype != Q.F16:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = copy_tokenizer(w, tokenizer_src or default_model_path())
    w.add_vocab_size(vocab)

    tensors = tensor_list(s, vocab)
    params = 0
    types = {name: tensor_type(qtype_name, name, s.layers, shp[-1]) for name, shp in tensors}
    for name, shp in tensors:
        params += int(np.prod(shp))
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        elif qtype == Q.F16:
            w.add_tensor_info(name, shp, np.dtype(np.float16), shp[0] * shp[1] * 2)
        else:
            nbytes = int(np.prod(quant_shape_to_byte_shape(shp, types[name])))
            w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes, raw_dtype=types[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (name, shp) in enumerate(tensors):
        data = (np.ones(shp, np.float32) if len(shp) == 1
                else _matrix(shp, types[name], seed, index))
        w.write_tensor_data(data)
        del data
        if log is not None and name.endswith("ffn_down.weight"):
            layer = int(name.split(".")[1])
            if layer % 8 == 7 or layer == s.layers - 1:
                log(f"  {layer + 1}/{s.layers} layers written, {time.perf_counter() - t0:.0f} s")
    w.close()
    return {
        "seconds": time.perf_counter() - t0,
        "bytes": path.stat().st_size,
        "params": params,
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def write_atomically(dest: Path, write: Callable[[Path], T]) -> T:
    """write(path) into a temporary file beside dest, then renamed to dest: a crash or a
    concurrent reader never sees a partial file. Returns what write returned."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.tmp-")
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; like any cache file
        result = write(Path(tmp))
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result


def synthetic_gguf(shape: str, qtype: str, out: str | os.PathLike | None = None, *,
                   force: bool = False, seed: int = 0, log=None) -> Path:
    """The cached file for (shape, type) (or out), written first if absent or force."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {list(SHAPES)}")
    if qtype not in TYPES:
        raise ValueError(f"unknown type {qtype!r}; choose one of {list(TYPES)}")
    dest = Path(out) if out is not None else default_path(shape, qtype)
    if dest.is_file() and not force:
        return dest
    info = write_atomically(dest, lambda tmp: write_synthetic(tmp, shape, qtype, seed=seed,
                                                               log=log))
    if log is not None:
        log(f"wrote {dest}: {info['params'] / 1e9:.2f} B params, {info['bytes'] / 1e9:.2f} GB "
            f"in {info['seconds']:.0f} s (writer peak RSS {info['maxrss_bytes'] / 2**30:.2f} GiB)")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--type", dest="qtype", choices=list(TYPES), default="q8_0")
    ap.add_argument("--out", default=None, help="default: the cache path (reused if present)")
    ap.add_argument("--force", action="store_true", help="rewrite even if the file exists")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    print(synthetic_gguf(a.shape, a.qtype, a.out, force=a.force, seed=a.seed, log=log))


if __name__ == "__main__":
    main()
