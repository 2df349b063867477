"""GGUF model files: config and tokenizer extracted once, weights read in place.

``gguf_to_hf_dir`` writes ``config.json``, ``generation_config.json`` and the
tokenizer files in transformers' layout into the cache once, so the
tokenizer, the chat template and the model config are read the same way for
every format. The weights are not converted: ``GGUFWeights`` reads them from
the memory-mapped file one tensor at a time, in their own block formats
(Q8_0 as int8 and Q4_0 / Q4_1 / Q4_K as int4 exactly, other block formats
requantized to int8 in groups of 32, F16 / BF16 / F32 as floats), so a
multi-GB model never has an fp32 copy. ``weights=True`` also writes an fp32
``model.safetensors``, for HF transformers as the correctness reference.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.model.gguf_meta import window_fields
from tandem.paths import cache_root_dir, file_lock, hash_key, safe_stem

# Bump when the produced directory changes (names, config keys, files): old
# cache entries then miss instead of being served in a stale layout.
FORMAT_VERSION = 4

_ARCHITECTURES = {
    # GGUF general.architecture -> (HF model_type, HF architectures[0])
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),  # its text model (vision: a separate file)
    "llama": ("llama", "LlamaForCausalLM"),  # also Mistral's: llama.cpp writes it as llama
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# Control tokens llama.cpp also treats as end-of-generation (llama-vocab.cpp):
# chat models end a turn with these even when tokenizer.ggml.eos_token_id names
# another token, so they go into generation_config.json's eos list.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "<|end_of_text|>",
    }
)
_TOKEN_TYPE_CONTROL = 3

# GGUF per-layer tensor name -> HF name (suffix after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Phi-3 keeps HF's fused matmuls: attn_qkv is qkv_proj, ffn_up holds gate and up.
_PHI3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_up.weight"},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# Gemma 2 and 3 norm each block's input and output: ffn_norm is the MLP's input
# norm (HF's pre_feedforward_layernorm), post_attention_norm attention's output's.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# ----------------------------------------------------------------------- conversion


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


class _BadMetadata(ValueError):
    """A metadata value gguf cannot decode; _convert adds the file name."""


def _convert(src: Path, dest: Path, weights: bool) -> None:
    try:
        _convert_unchecked(src, dest, weights)
    except _BadMetadata as e:
        raise ValueError(f"{src} is not a valid GGUF file: {e}") from e


def _checked(src: Path) -> tuple:
    """(reader, config, {hf name: (tensor, heads to unpermute or None)}), every
    tensor the model needs present and none it cannot use."""
    reader = _open_reader(src)
    arch = _str_field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{src}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    tensors = {t.name: t for t in reader.tensors}
    config, rope_freqs = _hf_config(reader, arch, tensors, src)
    names = _tensor_names(tensors, config, arch, src, skip={rope_freqs} - {None})
    return reader, config, names


def _convert_unchecked(src: Path, dest: Path, weights: bool) -> None:
    reader, config, names = _checked(src)
    _write_tokenizer(src, dest)  # first: the likelier failure, and cheaper than the weights
    if weights:
        # HF's Gemma norms hold w where llama.cpp's file holds 1 + w.
        shift = 1.0 if config["architectures"][0].startswith("Gemma") else 0.0
        _write_safetensors(dest / "model.safetensors", src, names, norm_shift=shift)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {hf: [asdict(StoredTensor.of(t)), heads] for hf, (t, heads) in names.items()}
    (dest / TENSORS_FILE).write_text(json.dumps(tensors) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": _eos_ids(reader)}
    gen = {k: v for k, v in gen.items() if v not in (None, [])}
    (dest / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _open_reader(src: Path):
    """GGUFReader with every failure (bad magic, truncation, ...) as one clear ValueError."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(src, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/struct.error/...
        # A file cut short fails in the reader's numpy views of its header or its
        # last tensors: "cannot reshape array of size ...", "When changing to a
        # larger dtype ...", "index 0 is out of bounds" say nothing of why.
        if isinstance(e, (IndexError, struct.error)) or any(
                w in str(e) for w in ("reshape", "larger dtype", "out of bounds")):
            raise ValueError(f"{src} is not a valid GGUF file: it ends before its header or "
                             "tensors do (a truncated download?)") from e
        raise ValueError(f"{src} is not a valid GGUF file: {e}") from e
    size = src.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(
                f"{src} is not a valid GGUF file: tensor {t.name!r} ends past the end of the "
                f"file (truncated download?)"
            )
    if "general.architecture" not in reader.fields:
        raise ValueError(f"{src} is not a valid GGUF file: no general.architecture")
    split = _field(reader, "split.count")
    if split is not None and int(split) > 1:
        raise ValueError(
            f"{src} is one shard of a split GGUF ({split} shards); merge it first "
            f"(llama-gguf-split --merge)"
        )
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except Exception as e:  # e.g. a string that is not UTF-8
        raise _BadMetadata(f"unreadable metadata {key!r}: {e}") from e
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _str_field(reader, key: str) -> str:
    value = _field(reader, key)
    return value if isinstance(value, str) else str(value)


def _uniform(value, what: str, src: Path) -> int:
    # Some GGUFs store per-layer arrays (e.g. head_count_kv); we support one value.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"{src}: per-layer {what} {value} is not supported")
        value = value[0]
    return int(value)


def _hf_config(reader, arch: str, tensors: dict, src: Path) -> tuple[dict, str | None]:
    """config.json from GGUF metadata; also returns the name of a consumed rope_freqs tensor."""
    model_type, hf_arch = _ARCHITECTURES[arch]

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key):
        value = get(key)
        if value is None:
            raise ValueError(f"{src}: GGUF metadata lacks {arch}.{key}")
        return _uniform(value, key, src)

    hidden = need("embedding_length")
    n_layers = need("block_count")
    n_heads = need("attention.head_count")
    n_kv = need("attention.head_count_kv") if get("attention.head_count_kv") else n_heads
    ffn = need("feed_forward_length")
    rope_dims = get("rope.dimension_count")
    if arch == "phi3":  # its rope.dimension_count is the rotated part of a head
        head_dim = int(get("attention.key_length") or hidden // n_heads)
    else:
        head_dim = int(get("attention.key_length") or rope_dims or hidden // n_heads)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ValueError(f"{src}: GGUF has no token_embd.weight tensor")
    rope_theta = float(get("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0))
    context = int(get("context_length", 2048))
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": context,
        # The embedding's row count, not len(tokens): some GGUFs pad the matrix.
        "vocab_size": int(emb.shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
        "attention_bias": arch == "qwen2",
    }
    if rope_dims is not None and int(rope_dims) != head_dim:
        config["partial_rotary_factor"] = int(rope_dims) / head_dim
    config.update(window_fields(arch, get, n_layers, src))
    if arch in ("gemma2", "gemma3"):
        # What llama.cpp assumes of a Gemma file: queries scaled by the head
        # size, but the 27Bs' (gemma2: 46 layers, gemma3: 62) by hidden / heads;
        # gemma2's even layers windowed (ModelConfig's default), gemma3's every
        # 6th layer global and the others windowed with RoPE base 10000. Soft-caps
        # the file leaves out are the config class's defaults (ModelConfig).
        big = n_layers == (46 if arch == "gemma2" else 62)
        config.update(hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=hidden // n_heads if big else head_dim)
        del config["hidden_act"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                config[key] = float(get(key))
    if arch == "gemma3":  # Ollama's files may name the windowed layers' RoPE base
        config["rope_local_base_freq"] = float(get("rope.local.freq_base", 10000.0))
    special = (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
    for key, name in special:
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)

    if "rope_factors_long.weight" in tensors:
        raise ValueError(f"{src}: rope scaling 'longrope' (rope_factors_long / rope_factors_short "
                         "tensors) is not supported")
    rope_freqs = "rope_freqs.weight" if "rope_freqs.weight" in tensors else None
    scaling_type = get("rope.scaling.type")
    if rope_freqs is not None:
        from gguf.quants import dequantize

        factors = dequantize(tensors[rope_freqs].data, tensors[rope_freqs].tensor_type)
        config["rope_scaling"] = _llama3_rope_scaling(
            np.asarray(factors, dtype=np.float64).reshape(-1), head_dim, rope_theta, src
        )
    elif scaling_type in ("linear", "yarn"):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        orig = get("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        config["rope_scaling"] = scaling
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{src}: rope scaling type {scaling_type!r} is not supported")
    return config, rope_freqs


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, src: Path) -> dict:
    """Recover HF's llama3 rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores the per-frequency divisors instead of the parameters; the
    curve only determines them up to a common scale, so we try the parameters
    Meta's Llama 3.x models use and check they reproduce the tensor exactly.
    """
    factor = float(factors.max())
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    for orig, low, high in ((8192, 1.0, 4.0),):
        smooth = (orig / wavelen - low) / (high - low)
        expect = np.where(
            wavelen < orig / high,
            1.0,
            np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if expect.shape == factors.shape and np.allclose(expect, factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ValueError(f"{src}: rope_freqs tensor does not match a known llama3 rope scaling")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute, which reorders each head's Q/K rows from
    HF's rotate-half RoPE layout to GGML's interleaved one:
    ``reshape(n_head, 2, d, ...).swapaxes(1, 2)``; the inverse swaps back from (n_head, d, 2).
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_names(tensors: dict, config: dict, arch: str, src: Path, skip: set) -> dict:
    """{hf_name: (tensor, heads)} for every tensor, checked against what the model
    needs; heads: llama's Q/K rows to unpermute (their head count), else None."""
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    layer_names = {"phi3": _PHI3_LAYER_NAMES, "gemma2": _GEMMA_LAYER_NAMES,
                   "gemma3": _GEMMA_LAYER_NAMES}.get(arch, _LAYER_NAMES)
    names, unknown = {}, []
    for gname, t in tensors.items():
        if gname in skip:
            continue
        if arch == "gemma3" and gname.startswith(("v.", "mm.")):
            continue  # Ollama's files hold the vision tower too: the text model is served
        hf = _GLOBAL_NAMES.get(gname)
        if hf is None and gname.startswith("blk."):
            _, layer, rest = gname.split(".", 2)
            suffix = layer_names.get(rest)
            if suffix is not None and layer.isdigit():
                hf = f"model.layers.{int(layer)}.{suffix}"
        if hf is None:
            unknown.append(gname)
            continue
        heads = None
        if arch == "llama" and ".attn_q." in gname:
            heads = n_heads
        elif arch == "llama" and ".attn_k." in gname:
            heads = n_kv
        names[hf] = (t, heads)
    if unknown:
        raise ValueError(f"{src}: unsupported tensors for {arch}: {', '.join(unknown[:8])}")
    missing = sorted(_expected_names(config, arch) - set(names))
    if missing:
        raise ValueError(f"{src}: GGUF lacks tensors {', '.join(missing[:8])}")
    return names


def _expected_names(config: dict, arch: str) -> set[str]:
    layer = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    if arch == "qwen2":
        layer |= {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    if arch in ("qwen3", "gemma3"):
        layer |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    if arch in ("gemma2", "gemma3"):
        layer |= {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"}
    if arch == "phi3":
        layer -= {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight"}
        layer |= {"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"}
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{s}" for s in layer}
    return names


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
            w = _dequantized(src, StoredTensor.of(t), heads, t.data)
            if norm_shift and name.endswith("norm.weight"):
                w = w - np.float32(norm_shift)
            f.write(np.ascontiguousarray(w, dtype="<f4").data)


def _dequantized(src: Path, t: StoredTensor, heads: int | None, data: np.ndarray) -> np.ndarray:
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


# ------------------------------------------------------------------- weights


TENSORS_FILE = "gguf_tensors.json"  # beside config.json in gguf_to_hf_dir's directory


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in its GGUF and how it is stored: what reading it takes,
    without gguf's reader (which parses every metadata array, the vocabulary's
    too: 8.4 s for a Llama-3-sized one, so the conversion caches these)."""

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

    def __init__(self, src: Path, converted: Path | None = None) -> None:
        self.src = src
        listed = None if converted is None else converted / TENSORS_FILE
        if listed is not None and listed.is_file():
            self._names = {hf: (StoredTensor(**t), heads)
                           for hf, (t, heads) in json.loads(listed.read_text()).items()}
        else:
            try:
                _, _, names = _checked(src)
            except _BadMetadata as e:
                raise ValueError(f"{src} is not a valid GGUF file: {e}") from e
            self._names = {hf: (StoredTensor.of(t), heads) for hf, (t, heads) in names.items()}
        # Are the 2-D weights stored quantized (then --quantization auto keeps them so)?
        self.quantized = any(len(t.shape) == 2 and t.type not in _FLOAT_TYPES
                             for t, _ in self._names.values())
        self.num_tensors = len(self._names)
        self.nbytes = sum(t.n_bytes for t, _ in self._names.values())

    def pop(self, name: str):
        """The tensor as a float32 torch tensor, or a QuantizedWeight for block formats
        (KeyError when the file has none of that name)."""
        t, heads = self._names.pop(name)
        raw = _mapped(self.src, t)
        kind = t.type
        if kind in _BLOCK_DECODERS and len(t.shape) == 2:
            rows = raw.view(t.data_shape[0], -1)
            if heads:  # rows are whole blocks: reorder the stored rows
                rows = _unpermute(rows, heads)
            try:
                return _quantized_weight(*_BLOCK_DECODERS[kind](rows))
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"{self.src}: tensor {t.name} ({kind}): {e}") from e
        data = raw.numpy().view(np.dtype(t.dtype)).reshape(t.data_shape)
        w = _dequantized(self.src, t, heads, data)
        if np.may_share_memory(w, data):  # F32 as stored: the model's own copy, not the mapping
            w = w.copy()
        w = torch.from_numpy(w)
        if kind in _FLOAT_TYPES or w.dim() != 2:
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
    MAP_POPULATE, measured no faster: 8B Q8_0 loads of 7.5-10.8 s either way.)"""
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


_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def _quantized_weight(data: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None = None):
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
    3 1B's 1152 inputs in a Q4_K_M file). The kernel when built, else torch:
    the 118 Q5_0 tensors of such a file took 21-24 s through gguf's dequantize
    and a requantization, 6.4-6.5 s in torch."""
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
_BLOCK_DECODERS = {"Q8_0": _decode_q8_0, "Q5_0": _decode_q5_0, "Q4_0": _decode_q4_0,
                   "Q4_1": _decode_q4_1, "Q4_K": _decode_q4_k, "Q5_K": _requantized("Q5_K"),
                   "Q6_K": _requantized("Q6_K")}


def _write_tokenizer(src: Path, dest: Path) -> None:
    """Tokenizer files via transformers' own GGUF vocab conversion (BPE/SPM rules and
    all), saved as the generic fast tokenizer: the converted tokenizer.json is the
    whole tokenizer. AutoTokenizer wrapped it in the architecture's class, which
    loads again by its own rules: a Gemma file with a byte-level BPE vocabulary
    came back splitting on U+2581 (every space an unknown token), with a
    ``<mask>`` token the model has no row for. The same sentencepiece files encode
    alike either way, and the conversion took 0.4 s instead of 4-5."""
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:
        raise ValueError(f"{src}: transformers could not convert the GGUF tokenizer: {e}") from e
    # chat_template inside tokenizer_config.json (not chat_template.jinja) so
    # older transformers and plain-JSON readers see it too.
    tok.save_pretrained(str(dest), save_jinja_files=False)


def _eos_ids(reader) -> list[int]:
    """eos, eot, eom ids, then control tokens llama.cpp also ends generation on."""
    ids = []
    for name in ("eos", "eot", "eom"):
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        kinds = types.contents()
        for i, text in enumerate(tokens.contents()):
            if text in _EOG_TEXTS and kinds[i] == _TOKEN_TYPE_CONTROL and i not in ids:
                ids.append(i)
    return ids
