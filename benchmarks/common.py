"""Helpers shared by the benchmark scripts (2 torch threads, like our CI machines)."""

from __future__ import annotations

import time

import torch


def set_threads(n: int = 2) -> None:
    torch.set_num_threads(n)


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """This machine's memory read bandwidth, the stricter of two probes.

    A full reduction and a matrix-vector product over a tensor far larger than
    any cache; the higher figure is taken, so a ceiling computed from it is not
    flattered by a slow probe (sum() read ~22 GB/s here where a GEMV read ~30).
    """
    w = torch.ones(mib * 2**20 // 4 // 1024, 1024, dtype=torch.float32)
    x = torch.ones(1, 1024)
    best = float("inf")
    for probe in (lambda: w.sum(), lambda: torch.mm(x, w.t())):
        probe()
        for _ in range(repeats):
            t = time.perf_counter()
            probe()
            best = min(best, time.perf_counter() - t)
    return w.numel() * 4 / best / 1e9
