"""The scheduler: one step's plan under a token budget (vLLM V1 semantics).

Every step has ``max_num_batched_tokens``. Running requests take it first, in
order: a decode costs 1 token, an unfinished prefill chunk up to the rest of
the budget. Then waiting requests are admitted FCFS while budget, the sequence
cap and free blocks allow; the last admitted one may be chunked. Prefill
chunks and decodes go through the model in one forward pass, so a long prompt
never stalls running streams for a whole prefill. With
``max_prefill_tokens_with_decodes`` set, a step in which any stream decodes
gives prompts at most that many tokens (a chunk delays every decoding stream
by its cost); such a step may then chunk a running prompt too.

When a prompt is in progress and more than one prompt wants a step's prompt
tokens (the running prompts, and while seats are free the queue's head and
its shortest request), they go fewest tokens left first (``_prompt_shares``),
after the oldest of them by arrival has half: a short request waits out
neither a long prompt's prefill nor a long prompt queued ahead of it, and a
stream of short ones at most halves the oldest prompt's pace. A queued
request with a share is admitted first, out of FCFS order; a share it cannot
take (no blocks) goes back to the running prompts.

When a running request cannot get a block, the newest running request is
preempted by recompute: its blocks are freed, its progress reset, and it goes
back to the *front* of the waiting queue with its output kept. It is never
failed or lost. A step that preempted admits nothing new. Admission keeps one
free block per running request in reserve, so new arrivals do not push running
requests straight into preemption.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """Which requests run this step and how many new tokens each."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_prefill_tokens_with_decodes: int | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests left waiting at the last step because the KV pool could not
        # take them (a failed allocation or a preemption), not for the step's
        # token budget: what the server's admission counts as no free slot.
        self.num_waiting_for_kv = 0
        # Cumulative, for a live view of step composition (two adds per step).
        self.num_scheduled_tokens = 0
        self.num_prefill_tokens = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = prefill = self.max_num_batched_tokens
        cap = self.max_prefill_tokens_with_decodes
        # A running request with one token left to compute is decoding.
        if cap is not None and any(r.num_tokens - r.num_computed_tokens == 1
                                   for r in self.running):
            prefill = min(cap, budget)
        budget_start, prefill_start = budget, prefill
        kv = self.kv
        shares = self._prompt_shares(budget, prefill)

        # 1. Running requests first, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if left == 1:
                n = 1
            else:
                n = min(left, budget, prefill)
                if shares is not None:
                    n = min(n, shares.get(req.request_id, 0))
            if n == 0:  # a prompt, and this step's prompt tokens are spent
                i += 1
                continue
            while not kv.allocate_slots(req, n):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_scheduled_tokens.append(n)
                budget -= n
                if left > 1:
                    prefill -= n
                i += 1
                continue
            break  # req itself was preempted: nothing older is left to try

        # 2. Waiting requests: those with a share first, then FCFS; none if this
        # step had to preempt.
        first = [] if shares is None else [r for r in self.waiting if shares.get(r.request_id)]
        kv_full = bool(out.preempted)
        while (
            not out.preempted
            and self.waiting
            and min(budget, prefill) > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = first.pop(0) if first else self.waiting[0]
            hits, num_hit = kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            most = min(budget, prefill)
            if shares is not None:
                most = min(most, shares.get(req.request_id, most))
            if n > most:
                if not self.enable_chunked_prefill:
                    break
                n = most
            if not kv.allocate_slots(req, n, hits, reserve_blocks=len(self.running)):
                kv_full = True
                break
            self.waiting.remove(req)
            # A prompt scored for its logprobs never looks: no query (a scoring load
            # would read as a 0% hit rate).
            if not req.prompt_logprobs_pending:
                kv.prefix_cache_queries += req.num_tokens
            kv.prefix_cache_hits += num_hit
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_scheduled_tokens.append(n)
            budget -= n
            prefill -= n
        self.num_waiting_for_kv = len(self.waiting) if kv_full else 0
        if shares is not None and min(budget, prefill) > 0:
            # A queued request with a share was not admitted (blocks, a preemption):
            # the running prompts take its tokens back.
            bs = kv.block_size
            for j, req in enumerate(out.requests):
                if req.request_id not in shares:
                    continue
                n = out.num_scheduled_tokens[j]
                more = min(req.num_tokens - req.num_computed_tokens - n, budget, prefill)
                while more > 0:  # a block at a time, while the pool has one
                    step = min(more, bs - (req.num_computed_tokens + n) % bs)
                    if not kv.allocate_slots(req, n + step):
                        break
                    n, more, budget, prefill = n + step, more - step, budget - step, prefill - step
                out.num_scheduled_tokens[j] = n
        self.num_scheduled_tokens += budget_start - budget
        self.num_prefill_tokens += prefill_start - prefill
        return out

    def _prompt_shares(self, budget: int, prefill: int) -> dict[str, int] | None:
        """Each candidate prompt's tokens this step (by request id), or None when
        no prompt is in progress or only one wants tokens (the usual step: plain
        order then).

        The candidates: the running prompts and, while seats are free, the
        queue's head and its shortest request. The oldest of them by arrival
        has max(1, tokens // 2) first (so the head, older than every request
        admitted past it, is never starved), then fewest tokens left first.
        Fewest-left-first ends the most prompts soonest: chunking one prompt at
        a time, a short request waited out a long prompt's whole prefill, and a
        long prompt at the head of the queue held every short one behind it.
        O(running + waiting) on steps with a prompt in progress.
        """
        # Every step pays this line (inlined, no call per request); the rest only
        # steps with a prompt in progress.
        prompts = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        tokens = min(prefill, budget - (len(self.running) - len(prompts)))  # decodes go first
        if not prompts or tokens <= 0:
            return None

        def left(r: Request) -> int:
            return r.num_tokens - r.num_computed_tokens

        candidates = list(prompts)
        seats = self.max_num_seqs - len(self.running)
        if seats > 0 and self.waiting:
            head, shortest = self.waiting[0], min(self.waiting, key=left)
            candidates.append(head)
            if shortest is not head and seats > 1:
                candidates.append(shortest)
        if len(candidates) < 2:
            return None
        oldest = min(candidates, key=lambda r: r.times.arrival)
        shares = {oldest.request_id: min(left(oldest), max(1, tokens // 2))}
        tokens -= shares[oldest.request_id]
        for r in sorted(candidates, key=left):
            if tokens <= 0:
                break
            have = shares.get(r.request_id, 0)
            more = min(left(r) - have, tokens)
            shares[r.request_id] = have + more
            tokens -= more
        return shares

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.warning(
            "Sequence group %s is preempted by PreemptionMode.RECOMPUTE mode because there "
            "is not enough KV cache space. total_num_cumulative_preemption=%d",
            req.request_id, self.num_preemptions,
        )

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
