"""tandem: a self-hosted LLM serving engine.

Import-time environment: OpenMP's default spin-wait makes torch threads fight
the HTTP server and tokenizer for our two cores (measured 2.7x slower under
contention); a passive wait policy halves that loss. It must be set before
torch loads its OpenMP runtime, so it lives here, before any torch import.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "AsyncEngine", "EngineConfig", "__version__"]

_LAZY = {
    "LLM": "tandem.llm",
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
