"""AsyncEngine: the step loop in a background thread, one async stream per request.

Many callers (HTTP handlers, tasks) overlap: each ``generate`` call validates
and tokenizes its request in the caller's thread, hands it to the engine thread
and awaits its deltas. The engine thread alone touches the scheduler and the
KV cache; new requests and aborts reach it through a lock-protected inbox that
it drains between steps. torch releases the GIL inside its ops, so the event
loop stays responsive while a step runs.

Per step the engine thread hands each event loop one batch of token outputs
(one cross-thread call, not one per request); detokenization and stop strings
run there (``process_output``), overlapping the next step's forward pass.

Abort on disconnect: if the consumer stops iterating (client gone, task
cancelled), the generator's ``finally`` aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.core.output_processor import EngineCoreOutput, process_output
from tandem.core.request import Request, RequestStatus
from tandem.engine.client import (
    EngineDeadError,
    EngineStats,
    RequestFailedError,
    RequestState,
)
from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer
from tandem.worker.thread_tuner import ThreadTuner

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 **kwargs) -> None:
        """Load the model in the engine thread itself, and wait for it.

        Every parallel torch op should run on one thread: when a second thread
        starts OpenMP teams of its own, libgomp sees more threads than cores and
        stops spin-waiting between ops, which halves decode speed. So the
        engine is built where it runs.
        Construction errors (bad flags, missing model) are re-raised here.
        """
        self._cond = threading.Condition()
        # New requests (a Request) and aborts ((id, status)) in the order they came:
        # an id a stop string freed may come back at once, and its abort must
        # reach the engine before the new request does (and a new request's own
        # abort after it).
        self._inbox: list[Request | tuple[str, RequestStatus]] = []
        self._num_new = 0  # the Requests in _inbox
        # Functions of the engine to run on its thread between two steps (see call).
        self._calls: list[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = []
        # request id -> (event loop, queue) of the awaiting caller
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.tuner: ThreadTuner | None = None  # CPU threads adapted to what is free
        self.engine: LLMEngine = engine  # type: ignore[assignment]
        built = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            if self.engine is None:
                try:
                    self.engine = LLMEngine(config, **kwargs)
                except BaseException as e:  # handed to the constructing thread
                    failure.append(e)
                    return
                finally:
                    built.set()
            else:
                built.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="tandem-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._stopped = True
            raise failure[0]
        self.model_info = self.engine.model_info()
        # The pool's pages, faulted in beside the engine thread before requests
        # need them (a syscall that holds no GIL and no thread team).
        self._commit = threading.Thread(target=self.engine.commit_kv_pool,
                                        name="tandem-kv-commit", daemon=True)
        self._commit.start()

    # ------------------------------------------------------------ caller side
    async def generate(
        self,
        prompt: str | Sequence[int] | Request,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as steps produce them; the last has finished=True.

        Raises ValueError at once for bad input (before anything is queued). A
        ``Request`` already made by ``engine.make_request`` is taken as it is.
        """
        if isinstance(prompt, Request):
            req = prompt
        elif params is not None and params.structured_outputs is not None:
            # Compiling a grammar can take a while (a huge one): off the loop.
            req = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.make_request, prompt, params, request_id)
        else:
            req = self.engine.make_request(prompt, params, request_id)
        rid = req.request_id
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            if self.dead:  # shut down, or its thread died: nothing would answer
                raise EngineDeadError("the engine is shut down")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            self._inbox.append(req)
            self._num_new += 1
            self._cond.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        with self._cond:
            self._streams.pop(request_id, None)  # nobody listens from now on
            self._inbox.append((request_id, status))
            self._cond.notify()

    @property
    def num_pending(self) -> int:
        """Requests handed over but not yet seen by the engine thread."""
        return self._num_new

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """The engine's counters (LLMEngine.stats, read from the caller's thread
        while it steps) with the requests still in the inbox and the threads a
        step runs on now."""
        return dataclasses.replace(self.engine.stats(), num_pending=self.num_pending,
                                   num_threads=self.num_threads)

    async def request_states(self) -> list[RequestState]:
        """Taken on the engine thread between two steps (``call``), and only when
        asked: a live view's once a second costs the step loop nothing in between."""
        try:
            return await self.call(lambda engine: [
                RequestState.of(r, time.monotonic()) for r in engine.requests.values()])
        except EngineDeadError:
            return []

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread between two steps, its result or exception
        back here: what must touch the KV pool outside a step (the KV export and
        import of disaggregated prefill)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.dead:
                raise EngineDeadError("the engine is shut down")
            self._calls.append((fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    @property
    def num_threads(self) -> int | None:
        """The CPU threads a step runs on now (None on a GPU)."""
        if self.engine.device.type != "cpu":
            return None
        return self.tuner.threads if self.tuner is not None else self.engine.config.num_threads

    @property
    def dead(self) -> bool:
        """True once the step loop has stopped (shut down or crashed): /health turns 503."""
        return self._stopped or not self._thread.is_alive()

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _on_outputs(self, batch: list[tuple[asyncio.Queue, EngineCoreOutput]]) -> None:
        """One step's outputs for this event loop: text, stop strings, then the queues."""
        for queue, core in batch:
            out, stopped_by_string = process_output(core)
            if out is None:  # produced after a stop string ended the request
                continue
            if core.status is RequestStatus.FINISHED_ERROR:
                queue.put_nowait(RequestFailedError(core.request.error))
                continue
            if stopped_by_string:  # its stream ends here; the engine lets it go next
                self.abort(out.request_id, RequestStatus.FINISHED_STOPPED)
            queue.put_nowait(out)

    # ------------------------------------------------------------ engine side
    def _deliver_batch(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand each caller's event loop its share of one step, in one call."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cond:
            for core in outputs:
                rid = core.request.request_id
                entry = self._streams.pop(rid, None) if core.status else self._streams.get(rid)
                if entry is not None:
                    batches.setdefault(entry[0], []).append((entry[1], core))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(self._on_outputs, batch)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

    def _deliver(self, rid: str, item: RequestOutput | BaseException, last: bool) -> None:
        entry = self._streams.pop(rid, None) if last else self._streams.get(rid)
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

    def _loop(self) -> None:
        """The engine thread: steps until shut down. However it ends (an exception
        outside a step included), every caller still waiting gets EngineDeadError."""
        try:
            self._steps()
        finally:
            try:
                for rid in list(self.engine.requests):
                    self.engine.abort_request(rid)
            finally:
                self._fail_waiting()

    def _fail_waiting(self) -> None:
        """EngineDeadError to every caller still waiting: those whose requests were in
        the engine, and those handed over but never added."""
        with self._cond:
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError("the engine is shut down"), True)
            for _, future in self._calls:
                future.set_exception(EngineDeadError("the engine is shut down"))

    def _steps(self) -> None:
        engine = self.engine
        if engine.device.type == "cpu" and engine.config.adaptive_threads:
            self.tuner = ThreadTuner(engine.config.num_threads, torch.set_num_threads)
        step = self.tuner.step if self.tuner is not None else (lambda run: run())
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._calls
                           or engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopped:
                    break
                inbox, self._inbox, self._num_new = self._inbox, [], 0
                calls, self._calls = self._calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn(engine))
                except Exception as e:  # the caller's to handle
                    future.set_exception(e)
            for item in inbox:
                if not isinstance(item, Request):
                    engine.abort_request(*item)
                    continue
                try:
                    engine.add_request(item)
                except ValueError as e:  # its caller's to hear; the loop goes on
                    self._deliver(item.request_id, e, True)
            try:
                outputs = step(engine.step_core)
            except Exception as e:  # fail what is in flight, keep serving new requests
                logger.exception("engine step failed")
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                    self._deliver(rid, EngineDeadError(f"engine step failed: {e}"), True)
                continue
            self._deliver_batch(outputs)

