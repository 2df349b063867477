"""A GGUF's config, tokenizer and tensor list as an HF model directory, made once.

In transformers' layout, so the tokenizer, the chat template and the model
config are read the same way for every format. The weights stay in the GGUF
(``GGUFWeights`` reads them there); ``weights=True`` adds an fp32
``model.safetensors`` for HF transformers, the correctness reference.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tandem.model.gguf.metadata import BadMetadata, checked, eos_ids
from tandem.model.gguf.weights import TENSORS_FILE, StoredTensor, dequantized
from tandem.paths import cache_root_dir, file_lock, hash_key, safe_stem

# Bump when the produced directory changes (names, config keys, files): old
# cache entries then miss instead of being served in a stale layout.
FORMAT_VERSION = 4


def gguf_to_hf_dir(path: str | os.PathLike, cache_root: str | os.PathLike | None = None,
                   weights: bool = False) -> Path:
    """The GGUF's config and tokenizer as an HF model directory in the cache,
    made once; with ``weights``, a separate directory that also holds the
    weights dequantized to fp32 safetensors (what HF transformers loads).

    The cache key hashes the resolved path, size and mtime (cheap, no read of
    the file) plus FORMAT_VERSION. The directory is built under a temporary
    name and renamed into place, and converters of the same file serialise on
    a lock file, so readers only ever see complete directories.
    """
    src = Path(path).expanduser()
    if not src.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist or is not a file")
    src = src.resolve()
    st = src.stat()
    key = hash_key([str(src), st.st_size, st.st_mtime_ns, FORMAT_VERSION, weights])
    base = cache_root_dir(cache_root) / "gguf"
    name = f"{safe_stem(src)}{'-f32' if weights else ''}-{key}"
    final = base / name
    if (final / "config.json").is_file():
        return final
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the cache folder {base} ({e.strerror}): set "
                         "TANDEM_CACHE to a writable folder") from None
    with file_lock(base / f".{name}.lock"):
        if (final / "config.json").is_file():  # another process finished it
            return final
        for stale in base.glob(f".{name}.tmp-*"):  # left by a crashed converter
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=base, prefix=f".{name}.tmp-"))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; like any cache dir
            _convert(src, tmp, weights)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "config.json").is_file():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # lost a lock-free race
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _convert(src: Path, dest: Path, weights: bool) -> None:
    try:
        _convert_unchecked(src, dest, weights)
    except BadMetadata as e:
        raise ValueError(f"{src} is not a valid GGUF file: {e}") from e


def _convert_unchecked(src: Path, dest: Path, weights: bool) -> None:
    reader, config, names = checked(src)
    _write_tokenizer(src, dest)  # first: the likelier failure, and cheaper than the weights
    if weights:
        # HF's Gemma norms hold w where llama.cpp's file holds 1 + w.
        shift = 1.0 if config["architectures"][0].startswith("Gemma") else 0.0
        _write_safetensors(dest / "model.safetensors", src, names, norm_shift=shift)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {hf: [asdict(StoredTensor.of(t)), heads] for hf, (t, heads) in names.items()}
    (dest / TENSORS_FILE).write_text(json.dumps(tensors) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos_ids(reader)}
    gen = {k: v for k, v in gen.items() if v not in (None, [])}
    (dest / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _write_tokenizer(src: Path, dest: Path) -> None:
    """Tokenizer files via transformers' own GGUF vocab conversion (BPE/SPM rules and
    all), saved as the generic fast tokenizer: the converted tokenizer.json is the
    whole tokenizer. AutoTokenizer wrapped it in the architecture's class, which
    loads again by its own rules: a Gemma file with a byte-level BPE vocabulary
    came back splitting on U+2581 (every space an unknown token), with a
    ``<mask>`` token the model has no row for. The same sentencepiece files encode
    alike either way, and the conversion is faster."""
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:
        raise ValueError(f"{src}: transformers could not convert the GGUF tokenizer: {e}") from e
    # chat_template inside tokenizer_config.json (not chat_template.jinja) so
    # older transformers and plain-JSON readers see it too.
    tok.save_pretrained(str(dest), save_jinja_files=False)


def _write_safetensors(path: Path, src: Path, names: dict, norm_shift: float = 0.0) -> None:
    """Stream a float32 safetensors file: one dequantized tensor in memory at a time
    (norm weights less ``norm_shift``).

    safetensors' own save_file wants the whole state dict in memory (2.5 GB for
    the 0.5B model); the format is a JSON header of offsets then raw bytes, so
    we write the header from the known shapes and then each tensor in turn.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (t, _) in names.items():
        shape = [int(d) for d in reversed(t.shape)]
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (t, heads) in names.items():
            w = dequantized(src, StoredTensor.of(t), heads, t.data)
            if norm_shift and name.endswith("norm.weight"):
                w = w - np.float32(norm_shift)
            f.write(np.ascontiguousarray(w, dtype="<f4").data)
