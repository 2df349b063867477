"""HF config.json fields whose default depends on the model class, read in one
place: the model loader and the capacity planner must agree on them. Torch-free."""

from __future__ import annotations

from typing import Any

# transformers' config classes for these model types default tie_word_embeddings
# to False; PretrainedConfig, and so most other types, to True.
_UNTIED_BY_DEFAULT = frozenset({"llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe",
                                "qwen3moe"})


def tie_word_embeddings(cfg: dict[str, Any], model_type: str | None = None) -> bool:
    """Whether the LM head is the token embedding: the config's value, else the
    default of its model type's config class (``model_type`` when the config
    names none)."""
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        tie = str(cfg.get("model_type", model_type)) not in _UNTIED_BY_DEFAULT
    return bool(tie)


def sliding_window(cfg: dict[str, Any], family: str,
                   max_positions: int | None) -> tuple[int | None, tuple[int, ...]]:
    """The window HF attends through (W keys: HF keeps key k for query q when
    q - k < W) and the layers that do, or (None, ()). A window no shorter than
    ``max_positions`` hides no key of any context: None, the layers kept (Gemma
    3's rotate by their own base, window or not).

    HF's Mistral and Phi-3 window every layer when ``sliding_window`` is set;
    Qwen2/Qwen3(-MoE) only with ``use_sliding_window``, and only the layers from
    ``max_window_layers`` on (``layer_types`` in transformers 5); Gemma the
    "sliding_attention" ones of ``layer_types``, else all but every
    ``sliding_window_pattern``-th (Gemma 3's 6; Gemma 2's 2: the even ones);
    Llama never.
    """
    window, n = cfg.get("sliding_window"), int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is not None and len(types) != n:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {n} layers")
    layers: tuple[int, ...] = tuple(range(n))
    if family in ("gemma2", "gemma3"):
        pattern = int(cfg.get("sliding_window_pattern", 6 if family == "gemma3" else 2))
        layers = tuple(i for i in range(n) if (
            types[i] == "sliding_attention" if types is not None else (i + 1) % pattern))
    elif family == "llama" or not window:
        return None, ()
    elif family in ("qwen2", "qwen3", "qwen3moe"):
        if not cfg.get("use_sliding_window"):
            return None, ()
        if types is not None:
            layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        else:
            layers = tuple(range(int(cfg.get("max_window_layers", n)), n))
        if not layers:
            return None, ()
    hides = window and (max_positions is None or int(window) < max_positions)
    return (int(window) if hides else None), layers
