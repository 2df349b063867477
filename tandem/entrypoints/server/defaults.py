"""Sampling defaults: what a request gets for a field it leaves out, resolved once.

Both APIs read the one ``SamplingDefaults`` built at start-up, in vLLM's way
(``--generation-config``):

* ``auto`` (default): the model's own values, from the generation_config.json
  beside it (an HF directory, or the one extracted from a GGUF) and a GGUF's
  ``general.sampling.*`` metadata; a model with none gets tandem's server
  default, Ollama's documented defaults (temperature 0.8, top_k 40, top_p 0.9),
  because sampling at temperature 1 with no filtering makes small models ramble;
* ``vllm``: no defaults: the API's neutral values (temperature 1, no top-k or
  top-p), what OpenAI documents and vLLM does with this setting;
* a directory: the generation_config.json in it.

``--override-generation-config '{"temperature": 0.5}'`` is applied on top.
The start-up log and Ollama's ``/api/show`` say which values apply and where
they came from.

The output length is not a sampling default: chat completions and Ollama's
endpoints generate until the model stops or the context is full (OpenAI's chat
API, Ollama's num_predict -1), /v1/completions keeps OpenAI's 16. A model's
``max_new_tokens`` caps the former, as in vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.sampling_params import SamplingParams

logger = logging.getLogger("tandem.entrypoints.server")

# generation_config.json keys vLLM reads -> SamplingParams fields.
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF general.sampling.* keys (llama.cpp's) -> SamplingParams fields.
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
SERVER_DEFAULT = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# Ollama's Modelfile parameter names, for /api/show.
OLLAMA_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "min_p": "min_p", "repetition_penalty": "repeat_penalty",
                "max_tokens": "num_predict"}
MODES = ("auto", "vllm")


@dataclass(frozen=True)
class SamplingDefaults:
    """values: SamplingParams fields a request gets when it leaves them out;
    sources: where each came from (for the log and /api/show)."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def apply(self, given: dict[str, Any]) -> dict[str, Any]:
        """The request's fields (None = left out) over the defaults."""
        return {**self.values, **{k: v for k, v in given.items() if v is not None}}

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.values:
            return "none (temperature 1, no top-k/top-p: --generation-config vllm)"
        by_source: dict[str, list[str]] = {}
        for k, v in self.values.items():
            by_source.setdefault(self.sources[k], []).append(f"{k}={v}")
        return "; ".join(f"{', '.join(kv)} ({src})" for src, kv in by_source.items())

    def ollama_parameters(self) -> list[str]:
        """Modelfile-style ``name value`` lines."""
        return [f"{OLLAMA_NAMES[k]} {v}" for k, v in self.values.items()]


def resolve(mode: str, override: dict[str, Any] | None, model_dir: Path | None,
            gguf: Path | None) -> SamplingDefaults:
    """The defaults for a model (its config directory, its GGUF file if it is one).

    ``mode`` and ``override`` come checked from check_mode and parse_override. A
    model's unreadable file or invalid value is logged and left out: the model
    must still serve.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if mode == "auto":
        if model_dir is not None:
            _merge(values, sources, _valid(_read_hf(model_dir), model_dir),
                   "the model's generation_config.json")
        if gguf is not None:
            _merge(values, sources, _valid(_read_gguf(gguf), gguf),
                   "the GGUF's general.sampling metadata")
        if not values:
            _merge(values, sources, SERVER_DEFAULT,
                   "tandem's default: the model sets none; --generation-config vllm for none")
    elif mode != "vllm":
        path = Path(mode).expanduser()
        _merge(values, sources, _valid(_read_hf(path), path), f"{path / 'generation_config.json'}")
    _merge(values, sources, override or {}, "--override-generation-config")
    return SamplingDefaults(values, sources)


def check_mode(mode: str) -> str:
    """--generation-config: auto, vllm or a directory, else a ValueError naming the flag."""
    if mode not in MODES and not Path(mode).expanduser().is_dir():
        raise ValueError(f"--generation-config must be auto, vllm or a directory with a "
                         f"generation_config.json, got {mode!r}")
    return mode


def parse_override(text: str | None) -> dict[str, Any] | None:
    """--override-generation-config's JSON object as SamplingParams fields, or a
    ValueError naming the flag (checked before the model loads)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. "
                         "'{\"temperature\": 0.5}'")
    unknown = sorted(set(value) - set(HF_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown keys {unknown}; "
                         f"accepted: {', '.join(HF_KEYS)}")
    fields = {HF_KEYS[k]: v for k, v in value.items()}
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"--override-generation-config: {e}") from None
    return fields


def _merge(values: dict, sources: dict, new: dict[str, Any], source: str) -> None:
    for k, v in new.items():
        values[k] = v
        sources[k] = source


def _valid(values: dict[str, Any], where: Path) -> dict[str, Any]:
    """The values SamplingParams accepts one by one (float32 metadata rounded to 6 digits)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, float):
            v = float(f"{v:.6g}")
        try:
            SamplingParams(**{k: v})
        except (TypeError, ValueError) as e:
            logger.warning("ignoring the sampling default %s=%r of %s: %s", k, v, where, e)
            continue
        out[k] = v
    return out


def _read_hf(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return {}
    if not isinstance(config, dict):
        return {}
    return {HF_KEYS[k]: v for k, v in config.items() if k in HF_KEYS and v is not None}


def _read_gguf(path: Path) -> dict[str, Any]:
    from tandem.model.gguf_meta import read_gguf_header

    try:
        meta, _ = read_gguf_header(str(path))
    except (OSError, ValueError) as e:
        logger.warning("cannot read sampling metadata from %s: %s", path, e)
        return {}
    return {GGUF_KEYS[k]: v for k, v in meta.items() if k in GGUF_KEYS}
