"""HF config.json fields whose default depends on the model class, read in one
place: the model loader and the capacity planner must agree on them. Torch-free."""

from __future__ import annotations

from typing import Any

# transformers' config classes for these model types default tie_word_embeddings
# to False; PretrainedConfig, and so most other types, to True.
_UNTIED_BY_DEFAULT = frozenset({"llama", "mistral", "phi3", "qwen2", "qwen3"})


def tie_word_embeddings(cfg: dict[str, Any], model_type: str | None = None) -> bool:
    """Whether the LM head is the token embedding: the config's value, else the
    default of its model type's config class (``model_type`` when the config
    names none)."""
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        tie = str(cfg.get("model_type", model_type)) not in _UNTIED_BY_DEFAULT
    return bool(tie)
