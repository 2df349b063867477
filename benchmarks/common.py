"""Helpers shared by the benchmark scripts (2 torch threads, like our CI machines)."""

from __future__ import annotations

import functools
import time

import torch

from tandem import _custom_ops
from tandem.model.hugepages import HugePageArena


def set_threads(n: int = 2) -> None:
    torch.set_num_threads(n)


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """This machine's memory read bandwidth, the best of several probes.

    Over a tensor far larger than any cache, in torch's memory and in huge
    pages (where tandem keeps CPU weights, tandem.model.hugepages): a full
    reduction, MKL's matrix-vector product and tandem's own (the decode step's
    matmul, torch.ops.tandem.matvec, when built). The highest figure is taken,
    so a ceiling computed from it is not flattered by a slow probe (here sum()
    read ~22 GB/s, MKL's GEMV ~30-31, tandem's ~32 in huge pages).
    """
    plain = torch.ones(mib * 2**20 // 4 // 1024, 1024, dtype=torch.float32)
    x = torch.ones(1, 1024)
    probes = []
    for w in (plain, HugePageArena().copy(plain)):
        probes += [w.sum, functools.partial(torch.mm, x, w.t())]
        if _custom_ops.AVAILABLE:
            probes.append(functools.partial(torch.ops.tandem.matvec, x, w, None))
    best = float("inf")
    for probe in probes:
        probe()
        for _ in range(repeats):
            t = time.perf_counter()
            probe()
            best = min(best, time.perf_counter() - t)
    return plain.numel() * 4 / best / 1e9
