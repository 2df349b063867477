"""The engine client contract: all that the HTTP server may use of an engine.

Requests go in (``generate``, ``abort``), outputs and a snapshot of the
counters come out (``stats``), and ``model_info`` describes the model once.
The scheduler, the KV cache manager and the model stay behind it: the local
``AsyncEngine`` implements it, and an engine in another process or on another
machine can implement the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tandem.core.request import Request, RequestStatus
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """The served model, fixed once it is loaded."""

    source: str | None  # what --model named; None: the embedded default
    model_path: str  # the file or directory loaded (the embedded default's GGUF for None)
    model_dir: str  # config, tokenizer, generation_config.json (a GGUF's extracted copy)
    load_format: str
    architecture: str  # HF class name, e.g. LlamaForCausalLM
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_model_len: int
    max_num_seqs: int
    parameter_count: int
    size_bytes: int  # the weights as held in memory
    quantization_level: str  # the format of most layer bytes, llama.cpp's names
    device: str
    load_duration_s: float


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests in flight at the time were failed with it."""


class RequestFailedError(ValueError):
    """One request could not go on (it finished FINISHED_ERROR: its grammar failed
    mid-output); the others in its steps were not touched. A ValueError: the
    request's own input is the cause."""


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and cumulative counters at one moment."""

    num_running: int
    num_waiting: int  # admitted by the engine, waiting for a slot, blocks or the token budget
    num_waiting_for_kv: int  # of those, what the KV pool could not take at the last step
    num_pending: int  # handed over, not yet seen by the engine loop
    kv_cache_usage: float  # 0..1
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    prompt_tokens_total: int
    generation_tokens_total: int
    num_threads: int | None  # CPU threads a step runs on (None on a GPU)
    num_kv_blocks: int  # the pool's size; kv_cache_usage is the share held by requests
    num_steps: int  # steps that ran the model
    scheduled_tokens_total: int  # tokens computed over all steps (prompt chunks + decodes)
    prefill_tokens_total: int  # of those, prompt tokens (recomputes after preemption too)


@dataclass(frozen=True)
class RequestState:
    """One request in the engine for a live view: its counts and ages, never its text."""

    request_id: str
    state: str  # "queued" | "preempted" (waiting again) | "prefill" | "decode"
    num_prompt_tokens: int
    num_computed_tokens: int  # of prompt + output, with KV in the cache (prefill progress)
    num_cached_tokens: int  # prompt tokens found in the prefix cache (0 until admitted)
    num_output_tokens: int
    num_preemptions: int
    age_s: float  # since arrival
    output_tokens_per_s: float | None  # since the first token (None before the second)

    @classmethod
    def of(cls, req: Request, now: float) -> RequestState:
        if req.status == RequestStatus.WAITING:
            state = "queued"
        elif req.status == RequestStatus.PREEMPTED:
            state = "preempted"
        else:  # running: one token left to compute is a decode
            state = "decode" if req.num_tokens - req.num_computed_tokens <= 1 else "prefill"
        t = req.times
        n_out = req.num_output_tokens
        rate = None
        if n_out > 1 and t.first_token is not None and t.last_token is not None \
                and t.last_token > t.first_token:
            rate = (n_out - 1) / (t.last_token - t.first_token)
        return cls(req.request_id, state, req.num_prompt_tokens, req.num_computed_tokens,
                   max(req.num_cached_tokens, 0), n_out, req.num_preemptions,
                   now - t.arrival, rate)


class EngineClient(Protocol):
    model_info: ModelInfo

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def request_states(self) -> list[RequestState]:
        """Every request the engine holds, as of one moment between two steps."""
        ...

    @property
    def dead(self) -> bool: ...


@runtime_checkable
class ReplicaSet(Protocol):
    """An engine client over several engines (tandem.distributed): /metrics gives
    each its own samples, and ``stats()`` is their sum."""

    def replica_stats(self) -> dict[str, EngineStats | None]:
        """Each replica's last snapshot by name, in a fixed order (None: not yet seen)."""
        ...
