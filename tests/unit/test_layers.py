"""The layers' import rules (ARCHITECTURE.md): the server sees the engine only
through the client contract, and the model knows nothing of the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import tandem

ROOT = Path(tandem.__file__).parent


def _imports(folder: str) -> dict[str, set[str]]:
    """Module file -> every tandem module it imports (at any depth, lazily too)."""
    out = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[path.name] = {n for n in names if n.startswith("tandem.")}
    return out


def test_server_uses_the_engine_only_through_the_client_contract():
    for name, mods in _imports("server").items():
        engine = {m for m in mods if m.startswith("tandem.engine")}
        assert engine <= {"tandem.engine.client"}, f"server/{name} imports {engine}"


def test_model_imports_nothing_from_the_engine():
    for name, mods in _imports("model").items():
        assert not any(m.startswith("tandem.engine") for m in mods), f"model/{name}: {mods}"
