"""The layers' import rules (ARCHITECTURE.md): each folder may import the layers
below it and nothing above, the server sees the engine only through the client
contract, the scheduler's side (core/) and the rules (diagnosis/) run without
torch, and no module imports another package's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tandem

ROOT = Path(tandem.__file__).parent

# folder -> the tandem packages it must not import (at any depth, lazily too)
FORBIDDEN = {
    "core": ("tandem.worker", "tandem.model", "tandem.kernels", "tandem.engine",
             "tandem.entrypoints", "tandem.tools", "tandem.diagnosis"),
    "model": ("tandem.core", "tandem.worker", "tandem.engine", "tandem.entrypoints",
              "tandem.tools", "tandem.diagnosis"),
    # The kernels are the bottom layer: the model calls them, never the reverse.
    "kernels": ("tandem.core", "tandem.worker", "tandem.model", "tandem.engine",
                "tandem.entrypoints", "tandem.tools", "tandem.diagnosis"),
    "worker": ("tandem.engine", "tandem.entrypoints", "tandem.tools", "tandem.diagnosis"),
    "engine": ("tandem.entrypoints", "tandem.tools", "tandem.distributed",
               "tandem.diagnosis"),
    # Replicas on Ray: engines in other processes, behind the same client contract.
    "distributed": ("tandem.entrypoints", "tandem.tools"),
    # The rules: pure functions of figures, shared by the dashboard and the doctor.
    "diagnosis": ("tandem.core", "tandem.worker", "tandem.model", "tandem.kernels",
                  "tandem.engine", "tandem.entrypoints", "tandem.tools",
                  "tandem.distributed"),
    # The server: the engine through the client contract only; of the model layer
    # only the torch-free GGUF header reader (the model's sampling defaults).
    "entrypoints/server": ("tandem.core", "tandem.worker", "tandem.kernels", "tandem.tools",
                           "tandem.distributed"),
    # Tools are clients: of servers over HTTP, of the engine (plan's check, and its
    # KV grouping and sizing: one policy, the planner's too), of the kernels (the
    # bandwidth probe times the decode matmul) and of the rules; never of the
    # server's insides or the runner's.
    "tools": ("tandem.entrypoints", "tandem.distributed", "tandem.worker"),
}
ALLOWED = {"entrypoints/server": {"tandem.engine.client", "tandem.model.gguf_meta"}}
TORCH_FREE = ("core", "diagnosis")


def _tree(path: Path) -> ast.Module:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []  # typing-only imports: the children are not walked yet
    return tree


def _imports(folder: str) -> dict[str, set[str]]:
    """Module file (under ``folder``, subfolders too) -> every module it imports,
    outside ``if TYPE_CHECKING``."""
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[str(path.relative_to(ROOT / folder))] = names
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


@pytest.mark.parametrize("folder", TORCH_FREE)
def test_runs_without_torch(folder):
    """The scheduler, KV accounting and the rules are plain Python: testable alone."""
    for name, mods in _imports(folder).items():
        assert not any(m == "torch" or m.startswith("torch.") for m in mods), f"{folder}/{name}"


def _package_dir(module: str) -> Path | None:
    """The folder holding ``module``'s code (a package's own folder for a package)."""
    path = ROOT.parent.joinpath(*module.split("."))
    if path.is_dir():
        return path
    return path.parent if path.with_suffix(".py").exists() else None


def test_no_private_names_cross_packages():
    """``from tandem.x.y import _name`` only inside the folder that defines it: a private
    name is free to change, which it is not once another package depends on it."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("tandem")):
                continue
            private = [a.name for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__")]
            if private and _package_dir(node.module) != path.parent:
                bad.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert not bad, bad


def test_folders_walked_here_are_every_layer():
    """A new top-level package gets a rule, not a pass."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == {"core", "worker", "model", "kernels", "engine", "entrypoints", "tools",
                        "distributed", "diagnosis"}
