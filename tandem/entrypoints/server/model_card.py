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

from tandem.engine.client import EngineClient

_FAMILIES = {  # Ollama's family names (Mistral GGUFs are llama's architecture)
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
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
    def from_engine(cls, engine: EngineClient, served_names: list[str] | None) -> ModelCard:
        info = engine.model_info
        source, root = info.source, info.model_path
        names = list(served_names or [default_served_name(source)])
        if info.load_format == "dummy":
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
            max_model_len=info.max_model_len,
            family=_FAMILIES.get(info.architecture, info.architecture),
            format=fmt,
            parameter_count=info.parameter_count,
            size_bytes=info.size_bytes,
            quantization_level=info.quantization_level,
            device=info.device,
            chat_template=tok.chat_template if tok is not None else None,
        )

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def matches(self, requested: str | None) -> bool:
        """Whether a request's ``model`` means this model (None = the default): one of
        its names, or the name as Ollama lists it (``name:latest``; Ollama also reads
        ``registry.ollama.ai/library/name:latest``), on every API as Ollama's own /v1
        takes what its /api/tags lists."""
        if requested is None or requested == "" or requested in self.names:
            return True
        name = requested.removeprefix("registry.ollama.ai/").removeprefix("library/")
        return name.removesuffix(":latest") in self.names

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
