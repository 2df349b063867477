"""The fast tier (`make test-unit`, under a minute): no model is loaded here.

Kernels, sampler, KV accounting, config, CLI, GGUF parsing and the layer rules
are tested on tensors and tiny inputs; anything that needs weights belongs in
tests/engine/ or tests/server/. The fixture below holds this tier to that.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tests/unit loads no model: move this test to tests/engine/")

    monkeypatch.setattr("tandem.model.loader.load_model", refuse)
    monkeypatch.setattr("tandem.engine.llm_engine.load_model", refuse)
