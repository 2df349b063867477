"""Resolve a model argument to its files, and load its weights into LlamaModel.

Three weight sources, each read one tensor at a time so a model is never
held twice (nor in fp32 when it is stored smaller): a GGUF file (read in its
own block formats, see tandem.model.gguf; its config and tokenizer come from
a directory extracted once into the cache), an HF directory (config.json +
safetensors, memory-mapped) or, with ``--load-format dummy``, random weights
for any config.json, so large configs can be benchmarked without weights.
``fuse_weights`` turns them, layer by layer, into the layout LlamaModel runs.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.config import format_bytes, host_memory
from tandem.model.gguf import GGUFWeights, gguf_to_hf_dir
from tandem.model.hugepages import HugePageArena
from tandem.model.linear import (
    DenseLinear,
    Linear,
    QuantizedWeight,
    make_linear,
    quantize_int8_groups,
)
from tandem.model.llama import LlamaModel, ModelConfig
from tandem.model.moe import SparseMoE
from tandem.paths import default_model_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """dir: config.json and the tokenizer (for dummy, maybe config.json itself);
    gguf: the GGUF file the weights are read from, if the model is one."""

    dir: Path
    gguf: Path | None = None


def resolve_model(model: str | None, load_format: str) -> ModelFiles:
    """The files for the model argument (a GGUF's config and tokenizer extracted once)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (give a GGUF file or an HF "
                         "model directory with config.json)")
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if load_format == "gguf" or (load_format == "auto" and is_gguf):
        return ModelFiles(gguf_to_hf_dir(path), path)
    if load_format == "dummy" and path.is_file() and path.name.endswith(".json"):
        return ModelFiles(path)
    if load_format == "dummy" and is_gguf:
        return ModelFiles(gguf_to_hf_dir(path))
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a directory")
    if not (path / "config.json").exists():
        raise ValueError(f"{str(path)!r} has no config.json")
    return ModelFiles(path)


def read_hf_config(model_dir: Path) -> dict:
    cfg_path = model_dir if model_dir.is_file() else model_dir / "config.json"
    try:
        return json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {cfg_path}: {e}") from None


class SafetensorsWeights:
    """An HF directory's safetensors tensors by name, each read when taken."""

    quantized = False
    norms_plus_one = False  # Gemma's RMSNorm weights are stored as HF has them: w, not 1 + w
    stacked_experts = False  # HF's checkpoints hold each expert's matrices

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{str(model_dir)!r} has no *.safetensors weights")
        self._where: dict[str, object] = {}
        self.nbytes = 0
        for f in files:
            try:
                st = safe_open(str(f), framework="pt")
                for name in st.keys():
                    self._where[name] = st
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"cannot read weights {f}: {e}") from None
            self.nbytes += f.stat().st_size
        # A multimodal checkpoint (Gemma 3 4B-27B) holds its text model under
        # language_model. (transformers 5's own layout: model.language_model.);
        # its vision tower's tensors are not taken.
        self._names = {n: n for n in self._where}
        for prefix, to in (("language_model.", ""), ("model.language_model.", "model.")):
            if any(n.startswith((prefix + "model.", prefix + "layers.")) for n in self._where):
                self._names = {to + n[len(prefix):]: n for n in self._where
                               if n.startswith(prefix)}
                if "lm_head.weight" in self._where:  # transformers 5 keeps it at the top
                    self._names["lm_head.weight"] = "lm_head.weight"
        self.num_tensors = len(self._names)

    def pop(self, name: str) -> torch.Tensor:
        stored = self._names.pop(name)
        return self._where.pop(stored).get_tensor(stored)


class DummyWeights:
    """Random HF-named weights with the shapes of cfg (std 0.02, norms 1), each
    made when taken (seeded by name, so the order of taking does not matter)."""

    quantized = False
    norms_plus_one = True  # norms of 1 are what every family's norms multiply by
    stacked_experts = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, seed: int) -> None:
        self.dtype, self.seed = dtype, seed
        hd, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        s = {"model.embed_tokens.weight": (cfg.vocab_size, hidden), "model.norm.weight": (hidden,)}
        if not cfg.tie_word_embeddings:
            s["lm_head.weight"] = (cfg.vocab_size, hidden)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            if cfg.family == "phi3":
                s[p + "self_attn.qkv_proj.weight"] = ((nh + 2 * nkv) * hd, hidden)
            else:
                s[p + "self_attn.q_proj.weight"] = (nh * hd, hidden)
                s[p + "self_attn.k_proj.weight"] = (nkv * hd, hidden)
                s[p + "self_attn.v_proj.weight"] = (nkv * hd, hidden)
            if cfg.moe is not None and i in cfg.moe.layers:
                s |= {p + "mlp." + n: shape
                      for n, shape in cfg.moe.expert_shapes(hidden).items()}
            else:
                if cfg.family == "phi3":
                    s[p + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
                else:
                    s[p + "mlp.gate_proj.weight"] = (inter, hidden)
                    s[p + "mlp.up_proj.weight"] = (inter, hidden)
                s[p + "mlp.down_proj.weight"] = (hidden, inter)
            s[p + "self_attn.o_proj.weight"] = (hidden, nh * hd)
            if cfg.attention_bias:
                for n, k in (("q", nh), ("k", nkv), ("v", nkv)):
                    s[p + f"self_attn.{n}_proj.bias"] = (k * hd,)
            if cfg.qk_norm:
                s[p + "self_attn.q_norm.weight"] = (hd,)
                s[p + "self_attn.k_norm.weight"] = (hd,)
            s[p + "input_layernorm.weight"] = (hidden,)
            s[p + "post_attention_layernorm.weight"] = (hidden,)
            if cfg.sandwich_norms:
                s[p + "pre_feedforward_layernorm.weight"] = (hidden,)
                s[p + "post_feedforward_layernorm.weight"] = (hidden,)
        self._shapes = s
        self.num_tensors = len(s)
        self.nbytes = 0

    def pop(self, name: str) -> torch.Tensor:
        shape = self._shapes.pop(name)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(*shape, generator=g).mul_(0.02).to(self.dtype)


WeightSource = GGUFWeights | SafetensorsWeights | DummyWeights


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) on Windows
        return None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS.

    Building a layer frees its temporaries (a tensor's file bytes, fp32
    copies, quantizer chunks) between the packed weights it keeps, and glibc
    holds such holes in its heap: a 1.66B F16 GGUF quantized to int8 ended its
    load at 1.43x (weights + KV pool) resident, 1.09x with them released
    after each layer.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class MemoryGuard:
    """Stops a CPU load, with the numbers, once its weights cannot fit beside the
    KV pool in the memory that was available when it began.

    The weights are measured as they are built, not predicted from the config:
    what a tensor becomes depends on its format (an F16 tensor is held in fp32,
    a Q6_K one as int8 groups) and fuse_weights is the one place that decides
    that. Without the guard an 8B model in fp32 on a 24 GB machine grew until
    the kernel killed the process. It refuses when what is built already
    leaves no room, or when the layers still to come, at the bytes of the
    built ones times MARGIN, would not fit: a GGUF's layers differ (Q4_K_M
    keeps about half its layers' attn_v and ffn_down in Q6_K, which tandem
    holds as int8 groups: such a layer of an 8B is 1.27x a plain one), so the
    first layers may overstate the rest by that much and MARGIN keeps the
    estimate below the true need.
    """

    MARGIN = 0.75

    def __init__(self, reserved: int, layers: int, held_as: str, quantized: bool) -> None:
        self.reserved, self.layers, self.held_as, self.quantized = (
            reserved, layers, held_as, quantized)
        _, self.available = host_memory()
        if self.available is not None and reserved > self.available:
            raise ValueError(
                f"the KV cache pool ({format_bytes(reserved)}) is larger than the "
                f"{format_bytes(self.available)} of memory available; lower --kv-cache-memory")
        self.base = 0  # bytes held besides the layers (embedding, LM head, final norm)
        self.layer_bytes: list[int] = []

    def check(self) -> None:
        """Raises ValueError if the weights built so far show the model cannot fit."""
        if self.available is None:
            return
        done, layers = len(self.layer_bytes), sum(self.layer_bytes)
        held = self.base + layers
        rest = layers / done * (self.layers - done) if done else 0
        if held + self.reserved <= self.available and (
                held + self.MARGIN * rest + self.reserved <= self.available):
            return
        need = held + rest
        if need < self.available:  # the weights would fit: the pool beside them does not
            advice = f"lower --kv-cache-memory to about {format_bytes(self.available - need)}"
        elif self.quantized:
            advice = "use a smaller model or fewer bits"
        else:
            advice = ("quantize it (--quantization int8 holds a weight in about 1 byte, int4 "
                      "in about 0.6)")
        raise ValueError(
            f"the model does not fit in memory: its weights need about {format_bytes(need)} "
            f"as loaded ({self.held_as}) beside the {format_bytes(self.reserved)} KV cache "
            f"pool, and {format_bytes(self.available)} was available (stopped after {done} of "
            f"{self.layers} layers); {advice}")


def held_bytes(*parts: Linear | torch.Tensor | None) -> int:
    """Bytes the given weights occupy."""
    return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes
               for p in parts if p is not None)


class _Progress:
    """Loading progress: a tqdm bar on a terminal, else a log line every few seconds."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.done, self.t0, self.last = total, 0, time.monotonic(), time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm  # installed with transformers, not required
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=what, unit="layer", leave=False)
        self.what = what

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.bar is not None:
            self.bar.update(1)
        elif now - self.last >= 5.0 or self.done == self.total:
            self.last = now
            logger.info("%s: %d/%d layers (%.0f s)", self.what, self.done, self.total,
                        now - self.t0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fuse_weights(
    cfg: ModelConfig,
    src: WeightSource,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    memory_reserve: int | None = None,
) -> dict:
    """Tensors taken from src -> LlamaModel's fused layout, layer by layer.

    Q/K/V become one matmul and gate/up another. ``quantization``: "none"
    (float), "int8" / "int4" (every layer matmul; the LM head int8), or
    "auto": what the source holds (a GGUF's block formats, each fused matmul
    in its widest part's format: int8 groups of 32 when its parts differ; the
    LM head in its own; float sources stay float). A quantized model keeps its
    embedding in fp16 for the row lookup. With ``memory_reserve`` bytes (the
    KV pool) a CPU load is watched by a MemoryGuard.
    """

    def take(name: str) -> torch.Tensor | QuantizedWeight:
        try:
            return src.pop(name)
        except KeyError:
            raise ValueError(f"the weights have no tensor {name!r}") from None

    def put(t: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(t, QuantizedWeight):
            t = t.dequantize()
        return t.to(device=device, dtype=dtype).contiguous()

    # Gemma's RMSNorm multiplies by 1 + w; the model multiplies by what it holds.
    shift = 1.0 if cfg.family in ("gemma2", "gemma3") and not src.norms_plus_one else 0.0

    def norm(name: str) -> torch.Tensor:
        t = take(name).float()
        return put(t + shift if shift else t)

    # Matmul weights on CPU go to huge pages: decode streams them faster
    # (tandem/model/hugepages.py); quantized ones are packed straight there.
    arena = HugePageArena() if device.type == "cpu" else None
    alloc = None if arena is None else arena.empty

    def dense(t: torch.Tensor) -> torch.Tensor:
        return arena.copy(put(t)) if arena is not None else put(t)

    def target(parts: list) -> str:
        if quantization != "auto":
            return quantization
        kinds = {p.kind for p in parts if isinstance(p, QuantizedWeight)}
        return "none" if not kinds else "int8" if "int8" in kinds else "int4"

    def lin(parts: list, bias: torch.Tensor | None = None, kind: str | None = None) -> Linear:
        kind = kind or target(parts)
        bias = None if bias is None else put(bias)
        if kind == "int8" and quantization == "auto" and all(
                isinstance(p, QuantizedWeight) for p in parts):
            # A fused matmul of mixed block formats (Q4_K_M's Q4_K attn_q / attn_k
            # with a Q6_K attn_v): int8 groups of 32 part by part, so the int8
            # parts stay exact and the others lose far less than to one scale
            # per output row of the whole matmul.
            parts = [p if p.kind == "int8" else quantize_int8_groups(p.dequantize())
                     for p in parts]
        if all(isinstance(p, QuantizedWeight) and p.kind == kind for p in parts):
            return make_linear([p.to(device) for p in parts], bias, kind, alloc)
        w = put(parts[0]) if len(parts) == 1 else torch.cat([put(p) for p in parts])
        if kind == "none":
            return DenseLinear(dense(w), bias)
        return make_linear(w, bias, kind, alloc)

    quantized = quantization in ("int8", "int4") or (quantization == "auto" and src.quantized)
    if quantized and cfg.moe is not None:
        raise ValueError(f"{cfg.architecture}: quantized expert weights are not supported yet; "
                         "serve it unquantized (--quantization none, float weights)")
    guard = None
    if memory_reserve is not None and device.type == "cpu":
        held_as = (quantization if quantization in ("int8", "int4") else
                   "the file's block formats" if quantized else str(dtype).removeprefix("torch."))
        guard = MemoryGuard(memory_reserve, cfg.num_hidden_layers, held_as, quantized)
    # Counted from here: the embedding and LM head come first (an 8B's, in fp32,
    # took 15-25 s before the first layer).
    progress = _Progress(cfg.num_hidden_layers, "loading weights")
    logger.info("loading weights: the embedding and LM head, then %d layers",
                cfg.num_hidden_layers)
    try:
        lm = src.pop("lm_head.weight")
    except KeyError:  # tied: the LM head is the embedding
        lm = None
    if lm is None and not cfg.tie_word_embeddings:
        raise ValueError("the weights have no lm_head.weight and tie_word_embeddings is false")
    if not quantized:
        embed_w = take("model.embed_tokens.weight")
        # A tied dense LM head is the embedding itself, streamed: in huge pages.
        embed = dense(embed_w) if lm is None else put(embed_w)
        lm_head: Linear = DenseLinear(embed if lm is None else dense(lm))
    else:
        # Quantized models get a quantized LM head: "auto" keeps a GGUF's own
        # format (Q8_0, Q6_K as int8 groups, ...); int8 / int4 make it int8 (as
        # llama.cpp's Q4/Q8 files have a Q6_K/Q8_0 one): per-channel weights
        # with activations in groups of 32 cost +0.003 NLL on the default
        # model, and it is ~a third of what an int8 step reads otherwise.
        # An untied head is built and its source dropped before the embedding
        # is read: an 8B model's are 2.1 GB each in fp32.
        def head_of(w: torch.Tensor | QuantizedWeight) -> Linear:
            auto = quantization == "auto" and isinstance(w, QuantizedWeight)
            return lin([w], kind=w.kind if auto else "int8")

        if lm is not None:
            lm_head = head_of(lm)
            del lm
            embed_w = take("model.embed_tokens.weight")
        else:
            embed_w = take("model.embed_tokens.weight")
            lm_head = head_of(embed_w)
        # The row lookup reads one row a token: fp16 halves an fp32 table
        # (1 GB of a Llama-3 8B) for a rounding far below the weights' own.
        if isinstance(embed_w, QuantizedWeight):
            embed_w = embed_w.dequantize()
        embed = embed_w.to(device=device, dtype=torch.float16 if dtype == torch.float32 else dtype)
    del embed_w
    final_norm = norm("model.norm.weight")
    if guard is not None:
        tied = isinstance(lm_head, DenseLinear) and lm_head.w is embed
        guard.base = held_bytes(embed, None if tied else lm_head, final_norm)
        guard.check()
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([put(take(a + f"{n}_proj.bias")) for n in "qkv"])
        phi3 = cfg.family == "phi3"  # stored fused, in tandem's order (q, k, v; gate, up)
        qkv = ([take(a + "qkv_proj.weight")] if phi3 else
               [take(a + f"{n}_proj.weight") for n in "qkv"])
        w: dict = {"qkv": lin(qkv, qkv_bias), "o": lin([take(a + "o_proj.weight")])}
        if cfg.moe is not None and i in cfg.moe.layers:
            w["moe"] = SparseMoE.load(cfg.moe, take, put, alloc, m, src.stacked_experts)
        else:
            w["gate_up"] = lin([take(m + "gate_up_proj.weight")] if phi3 else
                               [take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
            w["down"] = lin([take(m + "down_proj.weight")])
        w["input_layernorm"] = norm(p + "input_layernorm.weight")
        if cfg.sandwich_norms:  # Gemma: HF's post_attention_layernorm is attention's output's
            w["post_attention_layernorm"] = norm(p + "pre_feedforward_layernorm.weight")
            w["attn_out_norm"] = norm(p + "post_attention_layernorm.weight")
            w["mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight")
        else:  # the MLP's input norm, in Llama's name
            w["post_attention_layernorm"] = norm(p + "post_attention_layernorm.weight")
        if cfg.qk_norm:
            w["q_norm"] = norm(a + "q_norm.weight")
            w["k_norm"] = norm(a + "k_norm.weight")
        layers.append(w)
        release_free_memory()
        if guard is not None:
            guard.layer_bytes.append(held_bytes(*w.values()))
            guard.check()
        progress.step()
    progress.close()
    return {"embed": embed, "norm": final_norm, "lm_head": lm_head,
            "layers": layers}


def load_model(
    files: ModelFiles,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quantization: str = "none",
    cfg: ModelConfig | None = None,
    memory_reserve: int | None = None,
) -> LlamaModel:
    """The model of ``files``; ``cfg``: its config, if the caller has read it
    already. On CPU the load stops with a ValueError as soon as the weights
    cannot fit beside ``memory_reserve`` bytes (the KV pool): MemoryGuard."""
    cfg = cfg or ModelConfig.from_hf(read_hf_config(files.dir))
    src: WeightSource
    if load_format == "dummy":
        src = DummyWeights(cfg, dtype, seed)
    elif files.gguf is not None:
        src = GGUFWeights(files.gguf, files.dir)
    else:
        src = SafetensorsWeights(files.dir)
    return LlamaModel(cfg, fuse_weights(cfg, src, dtype, device, quantization, memory_reserve))
