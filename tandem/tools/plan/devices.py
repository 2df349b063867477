"""Device presets and a probe of this machine, for the capacity planner.

Decode is memory-bandwidth bound and the KV cache is memory bound, so a device
is, to the planner, two numbers: how many bytes it holds and how many bytes per
second it reads. A third, the dense 16-bit compute peak, only bounds how far
batching keeps paying off and how fast prefill runs, so it is approximate.

Memory sizes of GPUs are the totals the driver reports (nvidia-smi's MiB),
because ``--gpu-memory-utilization`` is a fraction of exactly that number.
Bandwidths are the vendors' peak figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tandem.config import host_memory

GiB = 1024**3
MiB = 1024**2
GB = 1e9

DeviceKind = Literal["cpu", "gpu"]


@dataclass(frozen=True)
class Device:
    """What the planner needs to know about a device."""

    id: str
    name: str
    kind: DeviceKind
    memory_bytes: int
    bandwidth_bytes_s: float
    # Dense 16-bit tensor-core peak on GPUs, fp32 on CPUs (tandem computes in
    # fp32 there); None when unknown: the compute roof is then left out.
    peak_flops: float | None = None
    note: str = ""
    measured: bool = False
    # For a probed host: memory free right now (other processes hold the rest).
    available_bytes: int | None = None
    # A CPU's int8 matmul rate (VNNI), what tandem's int8 and int4 weights and a
    # quantized GGUF's run on; None: unknown, peak_flops stands in.
    peak_int8_ops: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bandwidth_gb_s"] = self.bandwidth_bytes_s / GB
        return d


DEVICES: dict[str, Device] = {
    d.id: d
    for d in (
        Device(
            "cpu-ddr5",
            "CPU, dual-channel DDR5-5600",
            "cpu",
            64 * GiB,
            90e9,
            1.0e12,
            "2 channels x 8 B x 5600 MT/s = 89.6 GB/s; 64 GiB system RAM assumed "
            "(2 x 32 GiB DIMMs), use --memory for another size; ~1 TFLOP/s fp32 "
            "assumed (8 modern cores, AVX-512)",
        ),
        Device("a10g", "NVIDIA A10G", "gpu", 23028 * MiB, 600e9, 70e12, "24 GB GDDR6"),
        Device("l40s", "NVIDIA L40S", "gpu", 46068 * MiB, 864e9, 362e12, "48 GB GDDR6"),
        Device(
            "rtx4090", "NVIDIA GeForce RTX 4090", "gpu", 24564 * MiB, 1008e9, 165e12,
            "24 GB GDDR6X",
        ),
        Device(
            "a100-80gb", "NVIDIA A100 80GB SXM", "gpu", 81920 * MiB, 2039e9, 312e12,
            "80 GB HBM2e",
        ),
        Device("h100-sxm", "NVIDIA H100 SXM", "gpu", 81559 * MiB, 3350e9, 989e12, "80 GB HBM3"),
        Device("h200", "NVIDIA H200", "gpu", 143771 * MiB, 4800e9, 989e12, "141 GB HBM3e"),
    )
}


def get_device(device_id: str) -> Device:
    """Look a preset up by id; the error lists the ids so a typo is fixable."""
    try:
        return DEVICES[device_id]
    except KeyError:
        raise ValueError(
            f"unknown device {device_id!r}; known: {', '.join(DEVICES)} "
            "(or give --memory and --bandwidth, or --measure)"
        ) from None


def measure_read_bandwidth(
    nbytes: int = 512 * MiB, runs: int = 5, device: str = "cpu"
) -> float:
    """Best-of-``runs`` bytes/s reading an ``nbytes`` fp32 tensor once, best of several probes.

    Reading every byte once and writing little is what a decode step does to
    the weights. On CUDA, a full reduction. On CPU, the best of a reduction,
    MKL's matrix-vector product and tandem's own (the decode step's matmul,
    when its kernels are built), each over torch's memory and over huge pages
    (where tandem keeps CPU weights): on our 2-core machines sum() reads ~22
    GB/s where the matmuls read 30-33, so a ceiling from sum() alone would
    understate decode speed by a third. The tensor is filled first so page
    faults are not timed, and it must be far larger than the last-level cache
    to measure DRAM, hence hundreds of MB by default; the best run is the
    least disturbed one.
    """
    import functools

    import torch

    cols = 1024
    rows = max(1, nbytes // 4 // cols)
    x = torch.empty(rows, cols, dtype=torch.float32, device=device).fill_(1.0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    probes = []
    if device.startswith("cuda"):
        probes.append(x.sum)
    else:
        from tandem.kernels import custom_ops
        from tandem.model.hugepages import HugePageArena

        v = torch.ones(1, cols)
        for w in (x, HugePageArena().copy(x)):
            probes += [w.sum, functools.partial(torch.mm, v, w.t())]
            if custom_ops.available():
                probes.append(functools.partial(torch.ops.tandem.matvec, v, w, None))
    best = min(_fastest(probe, sync, runs=runs) for probe in probes)
    return rows * cols * 4 / best


def _fastest(fn: Callable[[], object], sync: Callable[[], object] = lambda: None, *,
             runs: int = 1, seconds: float = 0.0) -> float:
    """The fastest of at least ``runs`` timed calls of ``fn`` made over at least
    ``seconds``, after one untimed (warm-up) call: the least disturbed run."""
    fn()
    sync()
    best, done, t_end = float("inf"), 0, time.perf_counter() + seconds
    while done < max(1, runs) or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        done += 1
    return best


def measure_matmul_flops(size: int = 1024, runs: int = 3, device: str = "cpu") -> float:
    """Best-of-``runs`` FLOP/s of a square matmul (fp32 on CPU, bf16 on GPU).

    Only the compute roof of the batching estimate and the prefill estimate
    use it, so a small, quick matmul is enough.
    """
    import torch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return 2 * size**3 / _fastest(lambda: a @ b, sync, runs=runs)


def matmul_rate(dtype: str, m: int = 128, n: int = 2048, seconds: float = 1.0
                ) -> float | None:
    """Best (FL)OP/s of an (m x n) @ (n x n) CPU matmul over ``seconds``: torch.mm for
    fp32 / bf16, torch._int_mm (oneDNN's VNNI / AMX) for int8; None if unsupported.
    M = 128 is a prefill chunk's or a batch's rows, where the weights are reused."""
    import torch

    if dtype == "int8":
        a = torch.randint(-127, 128, (m, n), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        fn = getattr(torch, "_int_mm", None)
    else:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        a, b = torch.randn(m, n, dtype=dt), torch.randn(n, n, dtype=dt)
        fn = torch.mm
    try:
        fn(a, b)
    except (RuntimeError, TypeError):
        return None
    return 2 * m * n * n / _fastest(lambda: fn(a, b), seconds=seconds)


def measure_host(
    nbytes: int = 512 * MiB, runs: int = 5, target: Literal["auto", "cpu", "cuda"] = "auto"
) -> Device:
    """Probe this machine: its memory size and read bandwidth, and a compute peak.

    ``auto`` probes the first CUDA GPU when torch sees one (that is where a
    model would be served), else the host's RAM and cores.
    """
    import torch

    use_cuda = target == "cuda" or (target == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError("--measure on cuda: torch sees no CUDA device")
        free, total = torch.cuda.mem_get_info()
        return Device(
            id="measured-gpu",
            name=torch.cuda.get_device_name(),
            kind="gpu",
            memory_bytes=int(total),
            bandwidth_bytes_s=measure_read_bandwidth(max(nbytes, 1024 * MiB), runs, "cuda"),
            peak_flops=measure_matmul_flops(4096, runs, "cuda"),
            note="probed: torch.cuda.mem_get_info, timed sum of a large tensor, bf16 matmul",
            measured=True,
            available_bytes=int(free),
        )
    total, available = host_memory()
    threads = torch.get_num_threads()
    return Device(
        id="measured-cpu",
        name=f"this machine's CPU ({os.cpu_count()} cores, torch using {threads} threads)",
        kind="cpu",
        memory_bytes=int(total),
        bandwidth_bytes_s=measure_read_bandwidth(nbytes, runs, "cpu"),
        peak_flops=measure_matmul_flops(1024, 3, "cpu"),
        peak_int8_ops=matmul_rate("int8", seconds=0.5),
        note="probed: /proc/meminfo (or cgroup limit), the fastest read of a "
        f"{nbytes / MiB:.0f} MiB fp32 tensor (sum, matrix-vector products), fp32 and int8 "
        "matmuls",
        measured=True,
        available_bytes=available,
    )
