"""RayEngineClient: N engine replicas as Ray actors behind the one engine contract.

The HTTP server talks to it as to a local AsyncEngine (``tandem.engine.client``):
``generate`` picks a replica with the PrefixRouter and streams the actor's
outputs back (a Ray streaming generator); ``stats`` sums the replicas'
snapshots, which a poller thread refreshes (``replica_stats`` keeps them apart
for the ``replica`` label in /metrics).

With prefill and decode replicas (disaggregation) a request runs in two
halves: a prefill replica runs the prompt and samples the first token (streamed
to the client at once) and exports the prompt's KV blocks into Ray's object
store; a decode replica fetches them into its pool as prefix-cache blocks and
decodes from the second token on. The KV moves between the replicas' object
stores, never through this process.

Faults: a replica that dies before a request's first output gets the request
retried on another replica; one that dies mid-stream ends it with an
EngineDeadError (the server's clean error event). Either way the router stops
sending to it until Ray has restarted it (``max_restarts``) and it answers the
poller again, with an empty prefix cache the router then forgets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tandem.config import EngineConfig
from tandem.distributed.config import ReplicaSpec
from tandem.distributed.replica import EngineReplica, KVTransfer, Prefilled
from tandem.distributed.router import PrefixRouter
from tandem.engine.client import EngineDeadError, EngineStats, ModelInfo, RequestState
from tandem.model.loader import resolve_model
from tandem.outputs import RequestMetrics, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
POLL_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 600.0


class RayEngineClient:
    def __init__(self, config: EngineConfig, spec: ReplicaSpec) -> None:
        """Start (or join) Ray, start the replicas and wait until each has loaded
        the model. Bad flags and a cluster too small fail here with a ValueError."""
        try:
            import ray
        except ModuleNotFoundError:
            raise ValueError("serving replicas needs Ray: pip install 'tandem[ray]'") from None
        self._ray = ray
        self.spec = spec
        self._stopped = threading.Event()
        files = resolve_model(config.model, config.load_format)  # a bad path fails here
        self._tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_dir(files.dir)
        self._ray_thread: threading.Thread | None = None
        if not ray.is_initialized():
            self._ray_thread = _start_ray(ray, spec.ray_address, self._stopped)
        names = spec.roles
        have = ray.cluster_resources().get("CPU", 0.0)
        if len(names) * spec.num_cpus > have:
            self.shutdown()
            raise ValueError(f"{len(names)} replicas x {spec.num_cpus:g} CPUs do not fit the "
                             f"Ray cluster's {have:g} CPUs; lower --num-cpus-per-replica or "
                             "the replica count, or add a machine (docs/scale-out.md)")
        if config.adaptive_threads:  # one torch thread per CPU Ray gives the actor
            config = dataclasses.replace(config, num_threads=max(1, int(spec.num_cpus)),
                                         adaptive_threads=False)
        if spec.disaggregated:  # KV hand-off moves every layer's KV in one block table
            config = dataclasses.replace(config, disable_hybrid_kv_cache_manager=True)
        actor = ray.remote(EngineReplica)
        self.names = names
        self.actors = [actor.options(num_cpus=spec.num_cpus, max_restarts=spec.max_restarts,
                                     max_task_retries=0).remote(config) for _ in names]
        try:
            infos: list[ModelInfo] = ray.get([a.model_info.remote() for a in self.actors],
                                             timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            self.shutdown()
            raise ValueError(f"a replica failed to start: {_cause(e)}") from None
        pd = spec.disaggregated
        self.prefill_set = list(range(spec.prefill_replicas)) if pd else list(range(len(names)))
        self.decode_set = (list(range(spec.prefill_replicas, len(names))) if pd
                           else self.prefill_set)
        self.model_info = dataclasses.replace(
            infos[0], model_dir=str(files.dir),
            max_num_seqs=sum(infos[i].max_num_seqs for i in self.decode_set))
        self.router = PrefixRouter(len(names), config.block_size)
        for i, info in enumerate(infos):
            self.router.update(i, 0, 0.0, info.max_num_seqs)
        self._lock = threading.Lock()  # the router: event loop and poller both use it
        self._stats: list[EngineStats | None] = [None] * len(names)
        self._incarnation: list[str | None] = [None] * len(names)
        self._streams: dict[str, Any] = {}  # request id -> its actor call (for abort)
        self._ids = itertools.count()
        self.num_retries = 0
        self._poll_once()
        self._poller = threading.Thread(target=self._poll, name="tandem-ray-poll", daemon=True)
        self._poller.start()
        logger.info("%d replicas on Ray (%s), %g CPUs each", len(names), ", ".join(names),
                    spec.num_cpus)

    # ------------------------------------------------------------ the contract
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids")
            ids = self._tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        rid = request_id if request_id is not None else f"ray-{next(self._ids)}"
        if self.spec.disaggregated:
            stream = self._disaggregated(ids, params, rid)
        else:
            stream = self._stream(self.prefill_set, ids, rid,
                                  lambda a: a.generate.options(num_returns="streaming").remote(
                                      ids, params, rid))
        async with _closing(stream):
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        call = self._streams.pop(request_id, None)
        if call is not None:
            self._ray.cancel(call)

    def stats(self) -> EngineStats:
        return merge_stats([s for s in self._stats if s is not None])

    def replica_stats(self) -> dict[str, EngineStats | None]:
        """Each replica's last snapshot by name (the ``replica`` label of /metrics)."""
        return dict(zip(self.names, self._stats))

    async def request_states(self) -> list[RequestState]:
        healthy = [a for a, r in zip(self.actors, self.router.replicas) if r.healthy]
        results = await asyncio.gather(*(a.request_states.remote() for a in healthy),
                                       return_exceptions=True)
        return [s for r in results if isinstance(r, list) for s in r]

    @property
    def dead(self) -> bool:
        """True when stopped or no replica answers (then /health is 503)."""
        return self._stopped.is_set() or not any(r.healthy for r in self.router.replicas)

    def shutdown(self) -> None:
        for a in getattr(self, "actors", []):
            self._ray.kill(a, no_restart=True)
        self._stopped.set()  # the thread that started Ray shuts it down and ends
        if self._ray_thread is not None:
            self._ray_thread.join(timeout=60)

    # ------------------------------------------------------------- streaming
    async def _stream(self, pool: list[int], ids: Sequence[int], rid: str, call
                      ) -> AsyncIterator[Any]:
        """One actor call's items, on a replica of ``pool`` the router picks; retried
        on another while the replica dies before its first item."""
        ray = self._ray
        tried: list[int] = []
        while True:
            i = self._choose(pool, ids, tried)
            gen = call(self.actors[i])
            self._streams[rid] = gen
            started = ended = False
            try:
                async for ref in gen:
                    item = await ref
                    started = True
                    yield item
                ended = True
                return
            except ray.exceptions.RayTaskError as e:  # raised in the actor: bad input or a step
                ended = True
                cause = e.cause
                raise cause if isinstance(cause, (ValueError, EngineDeadError)) else \
                    EngineDeadError(f"replica {self.names[i]}: {_cause(e)}") from None
            except ray.exceptions.TaskCancelledError:  # abort(request_id)
                ended = True
                raise EngineDeadError(f"request {rid} was aborted") from None
            except ray.exceptions.RayActorError as e:
                ended = True
                self._down(i, e)
                if started:
                    raise EngineDeadError(f"replica {self.names[i]} died mid-stream; the "
                                          "request was ended") from None
                tried.append(i)
                self.num_retries += 1
                logger.warning("replica %s died before request %s started: retrying it on "
                               "another replica", self.names[i], rid)
            finally:
                with self._lock:
                    self.router.finished(i)
                if self._streams.get(rid) is gen:
                    del self._streams[rid]
                if not ended:  # the consumer left: cancelling makes the actor abort it
                    ray.cancel(gen)

    async def _disaggregated(self, ids: list[int], params: SamplingParams, rid: str
                             ) -> AsyncIterator[RequestOutput]:
        arrival = time.monotonic()

        pre: Prefilled = await _only(self._stream(
            self.prefill_set, ids, rid,
            lambda a: a.prefill.options(num_returns="streaming").remote(ids, params, rid)))
        first = pre.output
        first.time = time.monotonic()
        if pre.kv is None:  # the first token finished it
            yield first
            return
        yield dataclasses.replace(first, finished=False, outputs=[], metrics=None)
        token = first.new_token_ids[0]
        transfer: KVTransfer | None = None
        decode = self._stream(
            self.decode_set, [], rid, lambda a: a.decode.options(num_returns="streaming").remote(
                ids, params, rid, token, pre.kv, pre.export_s))
        async with _closing(decode):
            async for item in decode:
                if isinstance(item, KVTransfer):
                    transfer = item
                    continue
                item.time = time.monotonic()
                if item.finished and item.metrics is not None and transfer is not None:
                    item.metrics = _joined(arrival, first, item, transfer)
                yield item

    # ---------------------------------------------------------------- routing
    def _choose(self, pool: list[int], ids: Sequence[int], tried: list[int]) -> int:
        exclude = [i for i in range(len(self.actors)) if i not in pool] + tried
        with self._lock:
            try:
                i = self.router.choose(ids, exclude)
            except LookupError:
                raise EngineDeadError("no replica is available (all died or restarting); "
                                      "retry shortly") from None
            self.router.started(i)
        return i

    def _down(self, i: int, e: BaseException) -> None:
        """No requests go to replica i, and /metrics leaves it out, until it answers."""
        with self._lock:
            if self.router.replicas[i].healthy:
                logger.error("replica %s is down (%s): %s\nNo requests go there until Ray "
                             "has restarted it (at most --max-restarts %d times in all)",
                             self.names[i], type(e).__name__, str(e).strip(),
                             self.spec.max_restarts)
            self.router.set_healthy(i, False)
            self._stats[i] = None

    def _poll(self) -> None:
        while not self._stopped.wait(POLL_INTERVAL_S):
            self._poll_once()

    def _poll_once(self) -> None:
        """Every replica's stats; one that does not answer is down, one that answers
        under a new incarnation was restarted: its prefix cache is empty."""
        ray = self._ray
        refs = [a.stats.remote() for a in self.actors]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=POLL_TIMEOUT_S)[0])
        for i, ref in enumerate(refs):
            try:
                if ref not in ready:
                    raise TimeoutError(f"no stats in {POLL_TIMEOUT_S:g} s")
                incarnation, stats = ray.get(ref)
            except (ray.exceptions.RayActorError, TimeoutError) as e:
                self._down(i, e)
                continue
            with self._lock:
                if self._incarnation[i] not in (None, incarnation):
                    logger.warning("replica %s was restarted: routing to it again",
                                   self.names[i])
                    self.router.forget(i)
                self._incarnation[i] = incarnation
                self._stats[i] = stats
                r = self.router.replicas[i]
                self.router.update(i, stats.num_waiting + stats.num_pending,
                                   stats.kv_cache_usage, r.max_num_seqs)
                self.router.set_healthy(i, True)


def _start_ray(ray, address: str | None, stopped: threading.Event) -> threading.Thread:
    """``ray.init`` in a thread that lives until ``stopped``, then shuts Ray down.

    A local Ray's processes (raylet, object store, GCS) are started with
    PR_SET_PDEATHSIG, which Linux fires when the *thread* that forked them exits,
    not the process. ``tandem serve`` loads in a thread that ends once the model is
    loaded: started there, the raylet was killed a moment after start-up, and the
    first ``ray.put`` (a prefill replica exporting its KV) killed the actor with
    "connection to the plasma store failed". Replicas that never touch the object
    store kept answering, over direct actor calls, until they were restarted.
    """
    started = threading.Event()
    failure: list[BaseException] = []

    def hold() -> None:
        try:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)
            return
        finally:
            started.set()
        stopped.wait()
        ray.shutdown()

    thread = threading.Thread(target=hold, name="tandem-ray", daemon=True)
    thread.start()
    started.wait()
    if failure:
        raise failure[0]
    return thread


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """The cluster as one engine: counts and counters summed, KV usage over all blocks."""
    if not stats:
        return EngineStats(**{f.name: (None if f.name == "num_threads" else 0)
                              for f in dataclasses.fields(EngineStats)})
    out: dict[str, Any] = {}
    blocks = sum(s.num_kv_blocks for s in stats)
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name == "kv_cache_usage":
            out[f.name] = sum(s.kv_cache_usage * s.num_kv_blocks for s in stats) / max(blocks, 1)
        elif any(v is None for v in values):
            out[f.name] = None
        else:
            out[f.name] = sum(values)
    return EngineStats(**out)


def _joined(arrival: float, first: RequestOutput, last: RequestOutput, t: KVTransfer
            ) -> RequestMetrics:
    """One request's timings across both halves, on this process's clock: queue and
    prefill from the prefill replica, the transfer, decode from the decode replica."""
    p, d = first.metrics, last.metrics
    return RequestMetrics(
        arrival_time=arrival, first_scheduled_time=arrival + p.queued_s,
        first_token_time=first.time, finished_time=last.time,
        queued_s=p.queued_s, prefill_s=p.prefill_s, decode_s=d.decode_s,
        num_prompt_tokens=p.num_prompt_tokens, num_cached_tokens=p.num_cached_tokens,
        num_output_tokens=d.num_output_tokens,
        num_preemptions=p.num_preemptions + d.num_preemptions,
        kv_transfer_s=t.total_s, kv_transfer_bytes=t.num_bytes,
    )


async def _only(stream: AsyncIterator[Any]) -> Any:
    async with _closing(stream):
        async for item in stream:
            return item
    raise EngineDeadError("the replica returned nothing")


class _closing:
    """``async with``: close an async generator on the way out (cancels its actor call)."""

    def __init__(self, gen) -> None:
        self.gen = gen

    async def __aenter__(self):
        return self.gen

    async def __aexit__(self, *exc) -> None:
        await self.gen.aclose()


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause) else ''}"
