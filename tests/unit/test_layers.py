"""The layers' import rules (ARCHITECTURE.md): each folder may import the layers
below it and nothing above, the server sees the engine only through the client
contract, and the scheduler's side (core/) runs without torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tandem

ROOT = Path(tandem.__file__).parent

# folder -> the tandem packages it must not import (at any depth, lazily too)
FORBIDDEN = {
    "core": ("tandem.worker", "tandem.model", "tandem.kernels", "tandem.engine",
             "tandem.entrypoints", "tandem.tools"),
    "model": ("tandem.core", "tandem.worker", "tandem.engine", "tandem.entrypoints",
              "tandem.tools"),
    "kernels": ("tandem.core", "tandem.worker", "tandem.engine", "tandem.entrypoints",
                "tandem.tools"),
    "worker": ("tandem.engine", "tandem.entrypoints", "tandem.tools"),
    "engine": ("tandem.entrypoints", "tandem.tools", "tandem.distributed"),
    # Replicas on Ray: engines in other processes, behind the same client contract.
    "distributed": ("tandem.entrypoints", "tandem.tools"),
    # The server: the engine through the client contract only; of the model layer
    # only the torch-free GGUF header reader (the model's sampling defaults).
    "entrypoints/server": ("tandem.core", "tandem.worker", "tandem.kernels", "tandem.tools",
                           "tandem.distributed"),
}
ALLOWED = {"entrypoints/server": {"tandem.engine.client", "tandem.model.gguf_meta"}}


def _imports(folder: str) -> dict[str, set[str]]:
    """Module file -> every tandem module it imports, outside ``if TYPE_CHECKING``."""
    out = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        names, tree = set(), ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                node.body = []  # typing-only imports: the children are not walked yet
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[path.name] = names
    return out


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(folder):
    allowed = ALLOWED.get(folder, set())
    for name, mods in _imports(folder).items():
        bad = {m for m in mods if m.startswith(FORBIDDEN[folder]) and m not in allowed}
        assert not bad, f"{folder}/{name} imports {bad}"


def test_server_uses_the_engine_only_through_the_client_contract():
    for name, mods in _imports("entrypoints/server").items():
        engine = {m for m in mods if m.startswith("tandem.engine")}
        assert engine <= {"tandem.engine.client"}, f"server/{name} imports {engine}"


def test_core_runs_without_torch():
    """The scheduler and KV accounting are plain Python: testable and readable alone."""
    for name, mods in _imports("core").items():
        assert not any(m == "torch" or m.startswith("torch.") for m in mods), f"core/{name}"


def test_folders_walked_here_are_every_layer():
    """A new top-level package gets a rule, not a pass."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == {"core", "worker", "model", "kernels", "engine", "entrypoints", "tools",
                        "distributed"}
