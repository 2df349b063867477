"""EngineReplica: one AsyncEngine in its own process, as a Ray actor.

Its methods are what RayEngineClient calls: ``generate`` streams outputs (a
Ray streaming generator), ``prefill`` and ``decode`` are the two halves of a
disaggregated request. The class itself does not import Ray (the client wraps
it with ``ray.remote``); only ``prefill`` puts its KV into Ray's object store.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.client import EngineStats, ModelInfo, RequestState
from tandem.engine.kv_handoff import KVBlocks
from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams


@dataclass
class Prefilled:
    """A prefill replica's half of a request: its first output and, unless that
    finished the request, a reference to the exported KV in the object store."""

    output: RequestOutput
    kv: list[Any] | None  # [ObjectRef of PackedKV]: nested, so Ray does not fetch it here
    export_s: float = 0.0


@dataclass
class PackedKV:
    """KVBlocks as flat byte arrays for the object store: Ray keeps numpy arrays out
    of band, so ``ray.put`` is one copy and the decode replica reads them in place
    (a pickled tensor costs a copy more on each side). Bytes, not the tensors'
    dtype, because numpy has no bfloat16."""

    token_ids: list[int]
    block_size: int
    arrays: list[np.ndarray]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]

    @classmethod
    def pack(cls, kv: KVBlocks) -> PackedKV:
        return cls(kv.token_ids, kv.block_size,
                   [t.reshape(-1).view(torch.uint8).numpy() for t in kv.tensors],
                   [t.dtype for t in kv.tensors], [tuple(t.shape) for t in kv.tensors])

    def unpack(self) -> KVBlocks:
        with warnings.catch_warnings():  # read-only views of the object store: only read
            warnings.simplefilter("ignore", UserWarning)
            tensors = [torch.from_numpy(a).view(dtype).reshape(shape)
                       for a, dtype, shape in zip(self.arrays, self.dtypes, self.shapes)]
        return KVBlocks(self.token_ids, self.block_size, tensors)


@dataclass
class KVTransfer:
    """What moving one request's KV cost, as the decode replica saw it."""

    num_bytes: int
    num_tokens: int  # prompt tokens whose KV arrived (whole blocks)
    export_s: float  # copy out of the prefill pool + put into the object store
    fetch_s: float  # object store -> this process
    import_s: float  # into this pool

    @property
    def total_s(self) -> float:
        return self.export_s + self.fetch_s + self.import_s


class EngineReplica:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = AsyncEngine(config)
        # A restarted actor is a new incarnation: its prefix cache starts empty.
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"

    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    def stats(self) -> tuple[str, EngineStats]:
        return self.incarnation, self.engine.stats()

    async def request_states(self) -> list[RequestState]:
        return await self.engine.request_states()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(prompt_ids, params, request_id):
            yield out

    async def prefill(self, prompt_ids: Sequence[int], params: SamplingParams,
                      request_id: str) -> AsyncIterator[Prefilled]:
        """Run the prompt (chunked, as any prompt) and sample the first token; then
        export the prompt's KV blocks. min_tokens 1 for this half keeps the first
        token from ending a request that asked for more (the sampler masks EOS).
        One item, streamed like ``generate`` so the client handles both alike."""
        import ray

        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        async for out in self.engine.generate(prompt_ids, first, request_id):
            if out.finished:
                break
        wanted = params.max_tokens is None or params.max_tokens > 1
        if out.finish_reason != "length" or not wanted:
            yield Prefilled(out, None)
            return
        t0 = time.monotonic()
        kv: KVBlocks = await self.engine.call(lambda e: e.export_kv(prompt_ids))
        ref = ray.put(PackedKV.pack(kv))
        yield Prefilled(out, [ref], time.monotonic() - t0)

    async def decode(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str,
                     first_token: int, kv: list[Any], export_s: float
                     ) -> AsyncIterator[KVTransfer | RequestOutput]:
        """Take the KV a prefill replica exported into this pool (prefix-cache
        blocks), then admit the request with its first token as output: the
        scheduler finds the prompt's whole blocks cached and computes only the
        rest (under one block, plus the first token). Yields the transfer's
        cost, then the outputs from the second token on."""
        t0 = time.monotonic()
        blocks = (await kv[0]).unpack()
        t1 = time.monotonic()
        await self.engine.call(lambda e: e.import_kv(blocks))
        yield KVTransfer(blocks.nbytes, len(blocks.token_ids), export_s, t1 - t0,
                         time.monotonic() - t1)
        req = continued_request(self.engine.engine, prompt_ids, params, request_id, first_token)
        async for out in self.engine.generate(req):
            yield out


def continued_request(engine: LLMEngine, prompt_ids: Sequence[int], params: SamplingParams,
                      request_id: str, first_token: int):
    """The request as it stands after its first token elsewhere: that token is its
    first output (counted by max_tokens, min_tokens, penalties), consumed by its
    grammar if constrained, and already text (its detokenizer has seen it, the
    client has its delta)."""
    req = engine.make_request(prompt_ids, params, request_id)
    req.append_token(first_token)
    if req.structured_output_request is not None:
        req.structured_output_request.accept(first_token)
    req.times.first_token = req.times.last_token = time.monotonic()
    if req.detokenizer is not None:
        req.detokenizer.add_token(first_token)
        req.detokenizer.take_delta(finished=False)
    return req
