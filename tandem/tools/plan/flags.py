"""A plan as four engines' settings: tandem's and vLLM's flags, llama-server's,
and Ollama's environment, with the reasons for the two that need one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tandem.tools.plan.arithmetic import (
    CHUNK_STALL_S,
    ENGINE_DTYPES,
    KV8_DTYPES,
    engine_compute_dtype,
    kv_element_bytes,
    resolve_kv_dtype,
)
from tandem.tools.plan.devices import MiB
from tandem.tools.plan.text import plural

if TYPE_CHECKING:
    from tandem.tools.plan.capacity import Plan

# The CPU pool beyond what the planned streams hold at full context: room for
# the prefix cache to keep finished conversations' blocks.
CPU_POOL_HEADROOM = 1.25


def cpu_kv_pool_bytes(p: Plan) -> int:
    """--kv-cache-memory on a CPU: the blocks the planned streams hold at full context,
    a quarter more, at most what is free. The engine commits its pool at start-up,
    so every free byte (22 GB for one stream of a 135M model) would be held for
    nothing; a bigger load is a new plan."""
    block_bytes = p.cache_bytes / max(p.cache_blocks, 1)
    need = p.max_num_seqs * p.kv_blocks_per_conversation * block_bytes * CPU_POOL_HEADROOM
    return int(min(p.cache_bytes, math.ceil(need / MiB) * MiB))


def add_flags(p: Plan) -> None:
    """Fill ``p.flags``; none when nothing fits (the warnings say what to cut)."""
    if p.max_num_seqs < 1:
        return
    n, c = p.max_num_seqs, p.context
    p.flags = {
        "tandem": _tandem(p),
        "vllm": _vllm(p),
        "llama_server": _llama_server(p),
        "ollama": _ollama(p),
        "ollama_reserved_tokens": n * c,
        # llama.cpp's cache keeps a windowed layer's window per slot.
        "ollama_reserved_bytes": n * p.model.attended_keys(c) * p.kv_bytes_per_token,
        "max_queue_reason": _max_queue_reason(p),
        "max_num_batched_tokens_reason": _batched_tokens_reason(p),
    }


def _tandem(p: Plan) -> list[str]:
    kv8 = p.kv_cache_dtype in KV8_DTYPES
    # On a CPU tandem measures its token budget from the model's step cost at start-up
    # (engine/token_budget.py): a flag would replace that with this estimate.
    budget = ([f"--max-num-batched-tokens {p.max_num_batched_tokens}"]
              if p.device.kind == "gpu" else [])
    tandem = [f"--max-num-seqs {p.max_num_seqs}", *budget, f"--max-model-len {p.context}",
              f"--max-queue {p.max_queue}"]
    if p.device.kind == "gpu":
        tandem.append(f"--gpu-memory-utilization {p.gpu_memory_utilization:g}")
    else:  # on CPU tandem's pool is exactly this many bytes (default 2 GiB), not "what is free"
        tandem.append(f"--kv-cache-memory {cpu_kv_pool_bytes(p) // MiB}MiB")
    if kv8:  # tandem's only 8-bit cache is int8, whichever 8-bit format was planned
        tandem.append("--kv-cache-dtype int8")
    if p.dtype in ("int8", "int4"):
        tandem.append(f"--quantization {p.dtype}")
    # Float weights and cache as planned, where tandem's defaults would hold others.
    if p.dtype in ENGINE_DTYPES:
        if p.model.default_dtype == "file":  # a GGUF's blocks held as floats
            tandem.append("--quantization none")
        if p.dtype != engine_compute_dtype(p.device.kind):
            tandem.append(f"--dtype {ENGINE_DTYPES[p.dtype]}")
    auto_kv = resolve_kv_dtype("auto", p.dtype, p.device.kind)
    hd = p.model.head_dim
    if not kv8 and kv_element_bytes(p.kv_cache_dtype, hd) != kv_element_bytes(auto_kv, hd):
        tandem.append(f"--kv-cache-dtype {p.kv_cache_dtype}")
    return tandem


def _vllm(p: Plan) -> list[str]:
    """vLLM's flags; a note where it has none for the plan's weights."""
    vllm = [
        f"--max-num-seqs {p.max_num_seqs}", f"--max-model-len {p.context}",
        f"--max-num-batched-tokens {p.max_num_batched_tokens}",
    ]
    if p.device.kind == "gpu":
        vllm.append(f"--gpu-memory-utilization {p.gpu_memory_utilization:g}")
    if p.kv_cache_dtype in KV8_DTYPES:
        vllm.append("--kv-cache-dtype fp8")
    if p.dtype == "int8":
        vllm.append("--quantization fp8")
    elif p.dtype == "int4":
        p.notes.append("vLLM has no int4 flag for a 16-bit checkpoint: serve an AWQ or GPTQ "
                       "4-bit one")
    return vllm


def _llama_server(p: Plan) -> list[str]:
    n = p.max_num_seqs
    llama = [f"-np {n}", f"-c {n * p.context}"]
    if p.device.kind == "gpu":
        llama.append("-ngl 999")
    if p.kv_cache_dtype in KV8_DTYPES:
        llama += ["--cache-type-k q8_0", "--cache-type-v q8_0"]
    return llama


def _ollama(p: Plan) -> dict[str, str]:
    ollama = {
        "OLLAMA_NUM_PARALLEL": str(p.max_num_seqs),
        "OLLAMA_CONTEXT_LENGTH": str(p.context),
        "OLLAMA_MAX_QUEUE": str(p.max_queue),
        "OLLAMA_KEEP_ALIVE": "-1",
    }
    if p.kv_cache_dtype in KV8_DTYPES:
        ollama.update({"OLLAMA_KV_CACHE_TYPE": "q8_0", "OLLAMA_FLASH_ATTENTION": "1"})
    return ollama


def _max_queue_reason(p: Plan) -> str:
    return (
        f"{plural(p.max_queue, 'waiting request')} {'drains' if p.max_queue == 1 else 'drain'}"
        f" through {plural(p.max_num_seqs, 'slot')} in about one reply's time"
        + (f" (~{p.gen_seconds:g} s)" if p.gen_seconds else "")
        + "; past that, an immediate 503 with Retry-After that the client can retry "
        "beats a spinner that never resolves. vLLM and llama-server have no queue "
        "bound: put one in the proxy in front of them."
    )


def _batched_tokens_reason(p: Plan) -> str:
    return (
        "the per-step token budget: a prompt is prefilled in chunks of this size mixed "
        "with running decodes; smaller protects inter-token latency, larger cuts "
        "time to first token"
        + (
            f"; sized so a full chunk costs ~{p.chunk_stall_s * 1e3:,.0f} ms of compute "
            f"that running streams wait through (at most max({CHUNK_STALL_S:g} s, "
            "2 decode steps))"
            if p.chunk_stall_s is not None else ""
        )
        + ("; tandem on a CPU measures its own at start-up (no flag: the log's "
           "\"token budget\" line)" if p.device.kind == "cpu" else "")
    )
