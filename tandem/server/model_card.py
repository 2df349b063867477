"""What the server says about its one model: names, size, family, window.

Both APIs list it (/v1/models, /api/tags, /api/ps, /api/show) and both check
the ``model`` field of each request against its names, so a typo is a 404
rather than a silent answer from a different model than the client asked for.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.engine.llm_engine import LLMEngine
from tandem.model.linear import quantization_level

_FAMILIES = {  # Ollama's family names (Mistral GGUFs are llama's architecture)
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelCard:
    name: str
    aliases: list[str]
    root: str
    max_model_len: int
    family: str
    format: str
    parameter_count: int
    size_bytes: int
    quantization_level: str
    device: str
    chat_template: str | None
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine: LLMEngine, served_names: list[str] | None) -> ModelCard:
        cfg = engine.model_config
        source = engine.config.model
        root = str(source) if source is not None else str(_default_source())
        names = list(served_names or [default_served_name(source)])
        if engine.config.load_format == "dummy":
            fmt = "dummy"
        elif root.lower().endswith(".gguf"):
            fmt = "gguf"
        else:
            fmt = "safetensors"
        tok = engine.tokenizer
        return cls(
            name=names[0],
            aliases=names[1:],
            root=root,
            max_model_len=engine.max_model_len,
            family=_FAMILIES.get(cfg.architecture, cfg.architecture),
            format=fmt,
            parameter_count=parameter_count(cfg),
            size_bytes=weight_bytes(engine),
            quantization_level=served_quantization(engine),
            device=engine.device.type,
            chat_template=tok.chat_template if tok is not None else None,
        )

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def matches(self, requested: str | None, ollama: bool = False) -> bool:
        """Whether a request's ``model`` means this model (None = the default)."""
        if requested is None or requested == "":
            return True
        if requested in self.names:
            return True
        # Ollama clients write name:tag; a bare name means :latest.
        return ollama and requested.endswith(":latest") and requested[:-7] in self.names

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.root}|{self.size_bytes}".encode()).hexdigest()

    @property
    def parameter_size(self) -> str:
        n = self.parameter_count
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= scale:
                return f"{n / scale:.1f}{unit}"
        return str(n)


def _default_source() -> Path:
    from tandem.model.gguf import default_model_path

    return default_model_path()


DEFAULT_MODEL_NAME = "smollm2"  # the embedded SmolLM2-135M-Instruct: short, as Ollama names it


def default_served_name(source: str | None) -> str:
    """The model's file or directory name ('Llama-3.2-1B.Q8_0' for a .gguf); 'smollm2' for
    the embedded default."""
    if source is None:
        return DEFAULT_MODEL_NAME
    path = Path(source)
    if path.name == "config.json":
        path = path.parent
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def parameter_count(cfg) -> int:
    """From the config (not the tensors), so a quantized layout does not change it."""
    h, v, inter, d = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    per_layer = (
        h * (heads + 2 * kv) * d  # q, k, v
        + heads * d * h  # o
        + 3 * h * inter  # gate, up, down
        + 2 * h  # norms
    )
    if cfg.attention_bias:
        per_layer += (heads + 2 * kv) * d
    if cfg.qk_norm:
        per_layer += 2 * d
    embed = v * h
    head = 0 if cfg.tie_word_embeddings else v * h
    return embed + cfg.num_hidden_layers * per_layer + h + head


def served_quantization(engine: LLMEngine) -> str:
    """The format holding most of the layer matmuls' bytes, as served (a Q4_K_M
    file's few Q6_K matrices run as int8 beside its int4 majority)."""
    by_level: dict[str, int] = {}
    for layer in engine.model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            level = quantization_level(lin)
            by_level[level] = by_level.get(level, 0) + lin.nbytes
    return max(by_level, key=by_level.__getitem__)


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes the loaded weights occupy."""
    return engine.model.nbytes
