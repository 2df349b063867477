"""``tandem serve``'s scale-out flags and what they ask for; no Ray (or torch) import."""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """How many replicas of each role, and what each actor gets."""

    replicas: int = 0  # colocated: prefill and decode on the same replica
    prefill_replicas: int = 0
    decode_replicas: int = 0
    num_cpus: float = 1.0  # per actor (Ray's resource; also its torch threads)
    max_restarts: int = 3
    ray_address: str | None = None  # None: a local Ray instance; "auto": the running cluster

    def __post_init__(self) -> None:
        pd = (self.prefill_replicas, self.decode_replicas)
        if self.replicas < 0 or min(pd) < 0:
            raise ValueError("--replicas, --prefill-replicas and --decode-replicas must be >= 0")
        if self.replicas and any(pd):
            raise ValueError("give either --replicas N or --prefill-replicas P "
                             "--decode-replicas D, not both")
        if not self.replicas and (not pd[0] or not pd[1]):
            raise ValueError("disaggregation needs both --prefill-replicas and "
                             "--decode-replicas (at least 1 each)")
        if self.num_cpus <= 0:
            raise ValueError(f"--num-cpus-per-replica must be positive, got {self.num_cpus}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")

    @property
    def roles(self) -> list[str]:
        if self.replicas:
            return [f"replica-{i}" for i in range(self.replicas)]
        return ([f"prefill-{i}" for i in range(self.prefill_replicas)]
                + [f"decode-{i}" for i in range(self.decode_replicas)])

    @property
    def disaggregated(self) -> bool:
        return not self.replicas


def add_scale_out_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out (Ray; docs/scale-out.md)")
    g.add_argument("--replicas", type=int, default=0,
                   help="engine replicas as Ray actors behind this server, each request "
                        "routed to the replica holding its prompt's prefix (default 0: one "
                        "engine in this process, Ray not used)")
    g.add_argument("--prefill-replicas", type=int, default=0,
                   help="disaggregation: replicas that run prompts and hand the KV on")
    g.add_argument("--decode-replicas", type=int, default=0,
                   help="disaggregation: replicas that take the KV and decode")
    g.add_argument("--ray-address", default=None,
                   help="a running Ray cluster ('auto' after `ray start`); default: start "
                        "a local one")
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="Ray CPUs per replica actor, also its torch threads unless --threads "
                        "(default 1)")
    g.add_argument("--max-restarts", type=int, default=3,
                   help="times Ray restarts a replica that died (default 3)")


def spec_from_args(a: argparse.Namespace) -> ReplicaSpec | None:
    """The replicas asked for, or None for one engine in this process."""
    if not (a.replicas or a.prefill_replicas or a.decode_replicas):
        if a.ray_address is not None:
            raise ValueError("--ray-address needs --replicas or --prefill-replicas/"
                             "--decode-replicas")
        return None
    return ReplicaSpec(a.replicas, a.prefill_replicas, a.decode_replicas,
                       a.num_cpus_per_replica, a.max_restarts, a.ray_address)
