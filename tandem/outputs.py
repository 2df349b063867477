"""What the engine hands back: per-step deltas and, at the end, the whole result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Phase timings of one request, in seconds, from one monotonic clock.

    queued: arrival -> first scheduled (waiting for a slot or KV blocks).
    prefill: first scheduled -> first token (the prompt's forward passes).
    decode: first token -> finished (time spent producing the rest).
    The prefill/decode token counts exclude prefix-cache hits, so the rates
    are the work actually done.
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    queued_s: float
    prefill_s: float
    decode_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int
    # Disaggregated prefill: moving the prompt's KV to the decode replica (export,
    # object store, import); None when prefill and decode ran in one engine.
    kv_transfer_s: float | None = None
    kv_transfer_bytes: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the decode time (the streaming speed)."""
        n = self.num_output_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # With SamplingParams.logprobs: per output token, {token id: logprob} of the
    # sampled token and the top logprobs (vLLM's LLM.generate shape).
    logprobs: list[dict[int, float]] | None = None
    index: int = 0  # which of a request's n sequences (LLM.generate with n > 1)
    # With logprobs: the sum of the sampled tokens' logprobs (vLLM's; None without).
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One step's news for one request.

    While streaming, ``new_token_ids`` / ``delta_text`` carry what this step
    added (delta_text may be empty while a UTF-8 character or a possible stop
    string is incomplete). When ``finished``, ``outputs[0]`` holds the whole
    completion and ``metrics`` the phase timings.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    time: float = 0.0  # monotonic time the step that produced this output ended
    new_logprobs: list[dict[int, float]] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt: str | None = None  # the prompt's text, when it was given as text
    # With SamplingParams.prompt_logprobs, on the first token's output and the
    # finished one: per prompt token, None for the first (nothing precedes it),
    # then {token id: logprob} of that token and the top ones (vLLM's shape).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None
