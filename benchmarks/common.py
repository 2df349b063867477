"""Helpers shared by the benchmark scripts (2 torch threads, like our CI machines)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from tandem.tools.plan.devices import measure_read_bandwidth

TANDEM = str(Path(sys.executable).parent / "tandem")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    """Until ``tandem serve`` at ``url`` answers /health with 200."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError("tandem serve exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("tandem serve did not become ready")


def set_threads(n: int = 2) -> None:
    torch.set_num_threads(n)


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """This machine's memory read bandwidth in GB/s: the planner's probe
    (tandem.tools.plan.devices.measure_read_bandwidth, the best of a reduction and
    two matrix-vector products, in torch's memory and in huge pages) over a
    tensor far larger than any cache, so a ceiling computed from it is not
    flattered by a slow probe.
    """
    return measure_read_bandwidth(mib * 2**20, repeats) / 1e9
