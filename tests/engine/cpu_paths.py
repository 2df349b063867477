"""Run an engine through each of tandem's CPU compute paths in turn."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tandem.engine.llm_engine import LLMEngine

# The one-call C++ decode step, the per-op fused kernels, torch alone (what
# runs where the kernels cannot be built).
CPU_PATHS = ("decode-step", "per-op-kernels", "torch-reference")


@contextmanager
def cpu_path(engine: LLMEngine, path: str) -> Iterator[None]:
    model, runner = engine.model, engine.runner
    step = runner.decode_step
    # Built here (test_custom_ops says why if not); an MoE model has no decode step.
    assert model.fused and (step is not None or path != "decode-step")
    model.fused = path != "torch-reference"
    runner.decode_step = step if path == "decode-step" else None
    try:
        yield
    finally:
        model.fused, runner.decode_step = True, step
