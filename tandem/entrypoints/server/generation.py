"""One API request as a set of engine requests, merged into one stream of outputs.

The engine runs n=1 requests; ``n`` choices and lists of prompts fan out into
one engine request each (seed + i for choice i, so a seeded n=2 is
reproducible and its choices differ). Each engine request is pumped by its
own task into one queue; the handler reads (choice index, RequestOutput)
pairs from it.

Every output passes the pump, so metrics and the per-request log line are
recorded even if the client stops reading. Closing the Generation (client
gone, handler done, error) cancels the pumps; cancelling a pump closes its
engine stream, which aborts the request in the engine and frees its KV
blocks — whether it was running or still queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from tandem.engine.client import EngineDeadError, ReplicaSet
from tandem.entrypoints.server.errors import APIError
from tandem.entrypoints.server.state import ServerState
from tandem.entrypoints.server.streaming import unless_disconnected
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.entrypoints.server.structured import Constraint

logger = logging.getLogger("tandem.entrypoints.server")


INT64 = (-(2**63), 2**63 - 1)  # OpenAI's seed range (torch takes up to 2**64 - 1 for seed + i)
# Stop strings and ids are checked at every generated token: bounded, like the
# rest of the work one request can cause (OpenAI allows 4 stop strings).
MAX_STOPS = 64
MAX_STOP_CHARS = 1024


def make_sampling_params(state: ServerState, max_tokens: int | None, **given) -> SamplingParams:
    """SamplingParams from API fields, or a 400 naming the field.

    A field left out (None) gets the server's sampling default (see
    tandem.entrypoints.server.defaults); ``max_tokens`` is always explicit, None meaning
    until the model stops or the context is full. The model's extra
    end-of-generation ids (e.g. <|endoftext|> besides <|im_end|>) become stop
    ids, as vLLM does with generation_config.json.
    """
    fields = state.defaults.apply(given)
    fields["max_tokens"] = max_tokens
    _check_bounds(state, fields)
    if state.has_tokenizer and not fields.get("ignore_eos"):
        tok = state.tokenizer
        extra = [t for t in tok.stop_token_ids if t != tok.eos_token_id]
        if extra:
            fields["stop_token_ids"] = list(fields.get("stop_token_ids") or []) + extra
    try:
        return SamplingParams(**fields)
    except ValueError as e:  # its messages start with the field's name
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=field if field in fields else None) from None


def given_max_tokens(value: int | None, field: str, minimum: int = 1) -> int | None:
    """A token limit sent under another name than ``max_tokens`` (``max_completion_tokens``,
    ``max_output_tokens``), checked here so its 400 names the field the client sent.
    ``minimum``: the API's own floor (16 for the Responses API's, as OpenAI's)."""
    if value is not None and value < minimum:
        raise APIError(400, f"{field} must be at least {minimum}, got {value}", param=field)
    return value


def _check_bounds(state: ServerState, fields: dict) -> None:
    """The ranges SamplingParams leaves open, which a server must close."""
    seed = fields.get("seed")
    if isinstance(seed, int) and not INT64[0] <= seed <= INT64[1]:
        raise APIError(400, f"seed must be a 64-bit signed integer (-2**63 to 2**63-1), "
                            f"got {seed}", param="seed")
    min_tokens = fields.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > state.card.max_model_len:
        raise APIError(400, f"min_tokens ({min_tokens}) exceeds the context window of "
                            f"{state.card.max_model_len} tokens", param="min_tokens")
    stop = fields.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    ids = fields.get("stop_token_ids")
    ids = ids if isinstance(ids, list) else []
    for name, values in (("stop", stops), ("stop_token_ids", ids)):
        if len(values) > MAX_STOPS:
            raise APIError(400, f"at most {MAX_STOPS} stop strings and {MAX_STOPS} stop token "
                                f"ids, got {len(values)} in {name}", param=name)
    if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop strings may have at most {MAX_STOP_CHARS} characters",
                       param="stop")
    vocab = state.engine.model_info.vocab_size
    bad = [t for t in ids if isinstance(t, int) and not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary "
                            f"[0, {vocab})", param="stop_token_ids")


def open_ended_max_tokens(state: ServerState, prompt_len: int, window: int | None = None
                          ) -> int | None:
    """max_tokens for a chat or Ollama request that sets no limit: None (until the
    model stops or the context window is full) under the model's max_new_tokens."""
    cap = state.defaults.values.get("max_tokens")
    room = (window or state.card.max_model_len) - prompt_len
    return None if cap is None or room < 1 else min(cap, room)


@dataclass
class Choice:
    """One engine request of an API request, and what it has produced so far."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0
    final: RequestOutput | None = None
    released: bool = False
    accepted: asyncio.Event = field(default_factory=asyncio.Event)  # first output, or error


class Generation:
    """Start with ``await start()``, read with ``async for index, out in gen``, then ``close()``."""

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
    ) -> None:
        self.state = state
        self.request_id = request_id
        multi = len(prompts) > 1
        self.choices = [
            Choice(i, f"{request_id}-{i}" if multi else request_id, ids, p)
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._error: BaseException | None = None
        self._closed = False

    async def start(self) -> Generation:
        """Admit (or 503), submit every engine request, surface bad input as a 400.

        The engine validates a request when its stream is first iterated, which
        happens in the pump task's first step: one ``sleep(0)`` lets every pump
        run up to its first wait, so a ValueError is known before any response
        byte is sent (streaming or not). A structured-output request's grammar is
        compiled off the event loop, and replicas (ReplicaSet) validate in another
        process, so their verdict is only known with the first output: start
        waits for that.
        """
        self.state.admission.acquire(len(self.choices))
        try:
            now = time.monotonic()
            for c in self.choices:
                c.arrival = now
                self._tasks.append(asyncio.create_task(self._pump(c)))
            await asyncio.sleep(0)
            if isinstance(self.state.engine, ReplicaSet) or any(
                    c.params.structured_outputs is not None for c in self.choices):
                await asyncio.gather(*(c.accepted.wait() for c in self.choices))
        except BaseException:
            self.close()
            raise
        if self._error is not None:
            self.close()
            raise to_api_error(self._error)
        return self

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.choices)
        while remaining:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise to_api_error(item)
            if item.finished:
                remaining -= 1
            yield index, item

    async def collect(self) -> list[list[RequestOutput]]:
        """Every output of every choice (for non-streaming responses)."""
        outs: list[list[RequestOutput]] = [[] for _ in self.choices]
        async for index, out in self:
            outs[index].append(out)
        return outs

    def close(self) -> None:
        """Abort what has not finished and give back its admission slots (idempotent, sync).

        Synchronous on purpose: it runs in ``finally`` blocks of cancelled
        handlers, where awaiting is not possible.
        """
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            if not t.done():
                t.cancel()
        for c in self.choices:
            self._release(c)

    # ------------------------------------------------------------ pump side
    async def _pump(self, c: Choice) -> None:
        stream = self.state.engine.generate(c.prompt_ids, c.params, request_id=c.request_id)
        try:
            async for out in stream:
                self._observe(c, out)
                self._queue.put_nowait((c.index, out))
                c.accepted.set()
        except asyncio.CancelledError:
            if c.final is None:
                self._aborted(c)
            raise
        except Exception as e:  # ValueError (bad input) or the engine failing
            if self._error is None:
                self._error = e
            self._release(c)
            self._queue.put_nowait((c.index, e))
            c.accepted.set()
        finally:
            await stream.aclose()

    def _observe(self, c: Choice, out: RequestOutput) -> None:
        m = self.state.metrics
        if out.new_token_ids:
            if c.first_token_time is None:
                c.first_token_time = out.time
                m.first_token(out.time - c.arrival)
            else:
                m.next_token(out.time - c.last_token_time)
            c.last_token_time = out.time
            c.num_tokens += len(out.new_token_ids)
        if out.finished:
            c.final = out
            self._release(c)
            m.finished(out.finish_reason or "stop", out.metrics)
            if out.metrics is not None and out.metrics.e2e_s is not None:
                self.state.admission.observe_latency(out.metrics.e2e_s)
            log_finished(c.request_id, out)

    def _aborted(self, c: Choice) -> None:
        if self._error is not None:  # a sibling's bad input or failure, not a client leaving
            logger.info("req %s cancelled after %d output tokens: another part of its "
                        "request failed (%s)", c.request_id, c.num_tokens, self._error)
            return
        self.state.metrics.aborted()
        logger.info("req %s aborted after %d output tokens (client gone or request failed)",
                    c.request_id, c.num_tokens)

    def _release(self, c: Choice) -> None:
        if not c.released:
            c.released = True
            self.state.admission.release(1)


async def start(request: Request, gen: Generation, constraint: Constraint | None) -> None:
    """gen.start(); with a constraint, a grammar the engine cannot compile is a 400 naming
    its request field, and a client leaving while the start waits for the verdict aborts."""
    if constraint is None:
        await gen.start()
        return
    try:
        await unless_disconnected(request, gen.start())
    except APIError as e:
        raise constraint.name_field(e) from None


def log_finished(request_id: str, out: RequestOutput) -> None:
    """One line per request: where its time went (queue, prefill, decode)."""
    m = out.metrics
    if m is None:
        return
    extra = f", {m.num_preemptions} preemptions" if m.num_preemptions else ""
    if m.kv_transfer_s is not None:
        extra += f", KV transfer {m.kv_transfer_s * 1e3:.0f} ms ({m.kv_transfer_bytes} bytes)"
    logger.info(
        "req %s finished (%s): prompt %d tokens (%d cached), output %d tokens | "
        "queue %.0f ms, prefill %.0f ms (%.0f tok/s), decode %.0f ms (%.1f tok/s)%s",
        request_id, out.finish_reason, m.num_prompt_tokens, m.num_cached_tokens,
        m.num_output_tokens, m.queued_s * 1e3, m.prefill_s * 1e3, m.prefill_tokens_per_s,
        m.decode_s * 1e3, m.decode_tokens_per_s, extra,
    )


def to_api_error(e: BaseException) -> APIError:
    """What a client is told about an exception; one that is no one's fault but the
    server's is logged (one line) and reported as a 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):  # a failed step, or the engine shut down
        return APIError(503, f"the engine could not run this request: {e}",
                        code="engine_unavailable", error_type="service_unavailable_error")
    logger.error("request failed: %s: %s", type(e).__name__, e)
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error")
