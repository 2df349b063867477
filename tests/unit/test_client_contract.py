"""The engine client contract is what the server (and any remote engine) sees
of an engine: importing it imports no torch, and none of the engine's insides."""

from __future__ import annotations

import subprocess
import sys

INSIDES = ("tandem.worker", "tandem.kernels", "tandem.engine.llm_engine",
           "tandem.engine.async_engine")


def test_client_contract_imports_no_torch():
    code = ("import sys, tandem.engine.client; print(' '.join(m for m in sys.modules "
            f"if m == 'torch' or m.startswith({INSIDES!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [], f"importing tandem.engine.client imports {out}"
