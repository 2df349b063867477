"""Helpers shared by the benchmark scripts (2 torch threads, like our CI machines)."""

from __future__ import annotations

import time

import torch


def set_threads(n: int = 2) -> None:
    torch.set_num_threads(n)


def read_bandwidth_gbs(mib: int = 512, repeats: int = 7) -> float:
    """This machine's memory read bandwidth: best of a few large reductions."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9
