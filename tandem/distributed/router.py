"""PrefixRouter: which replica gets a request.

A replica that already holds a prompt's first blocks in its prefix cache skips
their prefill, so a request goes to the replica most likely to hold its
prefix: the router remembers, per chained block hash (the prefix cache's own,
``chain_block_hashes``), the replica it last sent that prefix to. It follows
that memory when the match covers at least ``min_match`` of the prompt (a short
shared head, such as a chat template's default system prompt, must not pull
every request onto one replica) and the replica is not overloaded (its waiting
queue or KV usage past a threshold); otherwise the least loaded replica wins.

Plain Python, no Ray: the client feeds it each replica's load and health.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.core.kv_cache_utils import chain_block_hashes


@dataclass
class ReplicaLoad:
    """What the router knows of one replica: its engine's last snapshot and the
    requests this client has in flight there (exact, unlike the snapshot)."""

    in_flight: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    max_num_seqs: int = 1
    healthy: bool = True
    routed: int = 0  # requests sent here so far: breaks ties, so idle replicas alternate


class PrefixRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        max_waiting: int = 4,
        max_kv_usage: float = 0.9,
        min_match: float = 0.5,
        max_prefix_blocks: int = 256,
        capacity: int = 1 << 16,
    ) -> None:
        """max_waiting / max_kv_usage: past either, a replica is overloaded and a
        prefix match no longer binds. max_prefix_blocks: the prompt's first blocks
        remembered; capacity: hashes remembered in all (least recently used go)."""
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.block_size = block_size
        self.max_waiting = max_waiting
        self.max_kv_usage = max_kv_usage
        self.min_match = min_match
        self.max_prefix_blocks = max_prefix_blocks
        self.capacity = capacity
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> replica
        self.num_prefix_routed = 0

    def hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's first full blocks as the prefix cache hashes them (its last
        token is never a hit, so a block ending there is not counted either)."""
        n = min((len(prompt_ids) - 1) // self.block_size, self.max_prefix_blocks)
        return chain_block_hashes(prompt_ids, self.block_size, max(n, 0))

    def overloaded(self, i: int) -> bool:
        r = self.replicas[i]
        waiting = max(r.num_waiting, r.in_flight - r.max_num_seqs)
        return waiting >= self.max_waiting or r.kv_cache_usage >= self.max_kv_usage

    def choose(self, prompt_ids: Sequence[int], exclude: Sequence[int] = ()) -> int:
        """The replica for this prompt (recorded as its prefix's owner); LookupError
        when no healthy replica is left outside ``exclude``."""
        candidates = [i for i, r in enumerate(self.replicas) if r.healthy and i not in exclude]
        if not candidates:
            raise LookupError("no healthy replica")
        hashes = self.hashes(prompt_ids)
        matched, owner = 0, None
        for n, h in enumerate(hashes, 1):  # the chain: a deeper hash implies the shorter ones
            i = self._owner.get(h)
            if i is None:
                break
            matched, owner = n, i
        if (owner in candidates and matched * self.block_size >= self.min_match * len(prompt_ids)
                and not self.overloaded(owner)):
            self.num_prefix_routed += 1
            choice = owner
        else:
            choice = min(candidates, key=self._load_key)
        self._remember(hashes, choice)
        return choice

    def _load_key(self, i: int) -> tuple:
        r = self.replicas[i]
        return (self.overloaded(i), r.in_flight, r.kv_cache_usage, r.routed)

    def _remember(self, hashes: list[int], replica: int) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = replica
            owner.move_to_end(h)
        while len(owner) > self.capacity:
            owner.popitem(last=False)
        self.replicas[replica].routed += 1

    # ---------------------------------------------------------- the client's news
    def started(self, i: int) -> None:
        self.replicas[i].in_flight += 1

    def finished(self, i: int) -> None:
        self.replicas[i].in_flight -= 1

    def update(self, i: int, num_waiting: int, kv_cache_usage: float, max_num_seqs: int) -> None:
        r = self.replicas[i]
        r.num_waiting, r.kv_cache_usage, r.max_num_seqs = num_waiting, kv_cache_usage, max_num_seqs

    def set_healthy(self, i: int, healthy: bool) -> None:
        self.replicas[i].healthy = healthy

    def forget(self, i: int) -> None:
        """A replica restarted with an empty cache: its prefixes are no longer there."""
        for h in [h for h, r in self._owner.items() if r == i]:
            del self._owner[h]
