"""The knobs a finding names, in each server's words, and the advice on fewer bytes.

A finding names a knob by its concept ("slots", "budget", ...); ``knob`` gives
the flag or setting of the server at hand, so the same finding tells a vLLM
user ``--max-num-seqs`` and an Ollama user ``OLLAMA_NUM_PARALLEL``.
"""

from __future__ import annotations

import re

# The same knob in each server's words.
KNOBS: dict[str, dict[str, str]] = {
    "tandem": {
        "slots": "--max-num-seqs N",
        "queue": "--max-queue N",
        "kv_memory": "--kv-cache-memory (CPU) / --gpu-memory-utilization (GPU)",
        "kv_8bit": "--kv-cache-dtype int8",
        "quantize": "--quantization int8 (int4: fewer bytes still)",
        "budget": "--max-num-batched-tokens",
        "prefix": "prefix caching (on unless --no-enable-prefix-caching): keep shared "
                  "prompt prefixes byte-identical",
        "context": "--max-model-len",
        "keep_alive": "a warm-up request after start (the first pays for lazy "
                      "initialisation; tandem never unloads the model)",
        "size_plan": "tandem plan MODEL --device ... --users N",
    },
    "vllm": {
        "slots": "--max-num-seqs N",
        "queue": "a queue bound in the proxy in front (vLLM has none)",
        "kv_memory": "--gpu-memory-utilization",
        "kv_8bit": "--kv-cache-dtype fp8",
        "quantize": "a quantized checkpoint (AWQ/GPTQ) or --quantization fp8",
        "budget": "--max-num-batched-tokens",
        "prefix": "--enable-prefix-caching, with shared prompt prefixes byte-identical",
        "context": "--max-model-len",
        "keep_alive": "a warm-up request after start (vLLM never unloads the model; the "
                      "first request pays for compilation and CUDA graphs)",
        "size_plan": "tandem plan MODEL --device ... --users N",
    },
    "llama-server": {
        "slots": "-np N, with -c N x the context per conversation (-c is split across slots)",
        "queue": "a queue bound in the proxy in front (llama-server has none)",
        "kv_memory": "-c (total KV tokens over all slots), and -ngl so every layer is on the GPU",
        "kv_8bit": "--cache-type-k q8_0 --cache-type-v q8_0 -fa on",
        "quantize": "a smaller GGUF (Q8_0, Q4_K_M)",
        "budget": "-b / -ub (the logical and physical batch)",
        "prefix": "cache_prompt (on by default) and --cache-reuse 256, with shared prefixes "
                  "byte-identical",
        "context": "-c",
        "keep_alive": "a warm-up request after start (llama-server never unloads the model)",
        "size_plan": "tandem plan MODEL.gguf --device ... --users N",
    },
    "ollama": {
        "slots": "OLLAMA_NUM_PARALLEL=N (Ollama reserves NUM_PARALLEL x OLLAMA_CONTEXT_LENGTH "
                 "tokens of KV: check they fit)",
        "queue": "OLLAMA_MAX_QUEUE",
        "kv_memory": "a smaller OLLAMA_NUM_PARALLEL x OLLAMA_CONTEXT_LENGTH, or more GPU memory",
        "kv_8bit": "OLLAMA_KV_CACHE_TYPE=q8_0 with OLLAMA_FLASH_ATTENTION=1",
        "quantize": "a smaller quantization tag (q4_K_M, q8_0)",
        "budget": "the num_batch option",
        "prefix": "keep each conversation's earlier turns byte-identical (Ollama reuses a "
                  "slot's cached prompt)",
        "context": "OLLAMA_CONTEXT_LENGTH (or num_ctx per request)",
        "keep_alive": "OLLAMA_KEEP_ALIVE=-1 (or keep_alive: -1 per request)",
        "size_plan": "tandem plan MODEL --device ... --users N",
    },
}
KNOBS["openai"] = {
    k: v.replace("--", "the server's --", 1) if v.startswith("--") else v
    for k, v in KNOBS["vllm"].items()
}


def knob(kind: str, name: str) -> str:
    return KNOBS.get(kind, KNOBS["openai"])[name]


def weight_bits(level: str | None) -> int | None:
    """Bits a weight of the server's named format (F16, Q8_0, INT8, Q4_K_M...), if known."""
    name = (level or "").upper()
    if name in ("F32", "FP32"):
        return 32
    if name in ("F16", "BF16", "FP16"):
        return 16
    digits = re.match(r"(?:Q|INT|IQ)(\d)", name)
    return int(digits.group(1)) if digits else None


def fewer_bytes(kind: str, level: str | None) -> str:
    """The advice for fewer bytes a token, from what the weights are already (the
    server's quantization level): a model served as Q8_0 is told int4, one at 4
    bits a smaller model (int8 would read more)."""
    bits = weight_bits(level)
    if bits is None or bits > 8:
        return f"quantize the weights (8 bit halves the bytes read per token): " \
               f"{knob(kind, 'quantize')}"
    if bits == 8 and kind == "tandem":
        return "4-bit weights: --quantization int4, or a Q4_0 / Q4_K_M file"
    if bits == 8:
        return f"a 4-bit quantization: {knob(kind, 'quantize')}"
    return f"the weights are already {level} ({bits} bits): a smaller model reads fewer bytes"

