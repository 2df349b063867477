"""Request: one generation's tokens, progress, blocks and timestamps.

Invariants (kept by the scheduler and KV cache manager):
* ``token_ids`` = prompt + output; ``num_computed_tokens`` of them have KV in
  the cache. A request samples a token exactly when a step brings
  ``num_computed_tokens`` up to ``num_tokens``.
* ``block_ids`` holds ceil(num_computed_tokens / block_size) blocks or more
  (the blocks for the tokens scheduled in the current step); with sliding-window
  KV cache groups, ``group_block_ids`` holds the other groups' as many, NULL_BLOCK
  where a block slid out of the group's window.
* Preemption resets ``num_computed_tokens`` to 0 and frees the blocks, but keeps
  the output: the request is re-prefilled as prompt + output, never lost.
* Every timestamp comes from ``time.monotonic()``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tandem.core.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request could not go on (``Request.error`` says why); others did

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestTimes:
    """One monotonic clock for everything the Ollama counters, the metrics and
    the bench derive: queue = first_scheduled - arrival, prefill (TTFT after
    queueing) = first_token - first_scheduled, decode = finished - first_token."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def queued_s(self) -> float:
        return (self.first_scheduled or self.arrival) - self.arrival

    @property
    def prefill_s(self) -> float:
        if self.first_token is None or self.first_scheduled is None:
            return 0.0
        return self.first_token - self.first_scheduled

    @property
    def decode_s(self) -> float:
        if self.first_token is None:
            return 0.0
        return (self.finished or self.last_token or self.first_token) - self.first_token


class Request:
    """A generation in flight. Plain attributes: the step loop reads them often."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        generator: torch.Generator | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        # Kept beside token_ids (appended together) so the sampler can read the
        # output without a per-step slice.
        self.output_token_ids: list[int] = []
        # Per output token when sampling_params.logprobs is set: {token id: logprob}.
        self.logprobs: list[dict[int, float]] = []
        # With sampling_params.prompt_logprobs: entry i for prompt token i + 1, filled
        # chunk by chunk as the prompt is computed (a recompute adds nothing twice).
        self.prompt_logprobs: list[dict[int, float]] = []
        self.prompt: str | None = None  # the prompt's text, when it came as text
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # already capped by the context window
        self.generator = generator
        self.detokenizer = detokenizer
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.group_block_ids: list[list[int]] = []  # KV cache groups past the first
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled lazily
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        # (id, generation) of the cached block standing for the prefix through
        # block num_cached_blocks - 1 (its own or an equal one; (-1, 0): none yet,
        # None: a collision broke the chain).
        self.cached_tail: tuple[int, int] | None = (-1, 0)
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 = not yet
        self.num_preemptions = 0
        # The grammar state of a constrained request (worker/structured_output.py's
        # StructuredOutputRequest, opaque here): it has consumed exactly output_token_ids.
        self.structured_output_request: Any = None
        self.error: str | None = None  # why it ended FINISHED_ERROR
        self.times = RequestTimes() if arrival_time is None else RequestTimes(arrival=arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the prompt must run
        through the model (a prefix-cache hit would skip the positions they need)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
