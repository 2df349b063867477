"""tandem: a self-hosted LLM serving engine.

OpenMP's wait policy is left at libgomp's default (spin briefly, then sleep).
OMP_WAIT_POLICY=PASSIVE was measured here on 2 cores: it halves batch-1 decode
(every parallel op pays a thread wake-up, ~100 us) and lost 20% aggregate
throughput through the HTTP server at 16 streams. What does hurt is parallel
torch work from two threads (see AsyncEngine), so the engine keeps to one.
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "AsyncEngine", "EngineConfig", "__version__"]

_LAZY = {
    "LLM": "tandem.entrypoints.llm",
    "SamplingParams": "tandem.sampling_params",
    "AsyncEngine": "tandem.engine.async_engine",
    "EngineConfig": "tandem.config",
}


def __getattr__(name: str):
    """Lazy exports: `tandem --help` should not pay for importing torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
