"""The mesh is the bottom layer: it knows axes, ranks and process groups, and
imports nothing of the layers above it — not ``shardax.collectives`` (which
builds on the mesh's groups), not even lazily inside a function or under
``TYPE_CHECKING``. What collectives keep per process group they attach
through the mesh's ``GroupSetup``."""

from __future__ import annotations

import ast
from pathlib import Path

import shardax.mesh

MESH = Path(shardax.mesh.__file__).parent
ALLOWED = ("shardax.mesh", "shardax.errors")  # the mesh's own modules, and the typed errors


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, wherever it sits,
    relative ones resolved (``from ..x import y`` in shardax/mesh → shardax.x,
    and shardax.x.y where y may be a module)."""
    package = ["shardax", "mesh"]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_the_mesh_imports_nothing_above_it():
    files = sorted(MESH.glob("*.py"))
    assert len(files) >= 5, files  # the walk sees the package
    bad = [
        f"{path.name}:{line} imports {module}"
        for path in files
        for line, module in _imports(path)
        if (module == "shardax" or module.startswith("shardax."))
        and not any(module == a or module.startswith(a + ".") for a in ALLOWED)
    ]
    assert not bad, "the mesh layer imports from above it:\n" + "\n".join(bad)


def test_the_walk_sees_lazy_and_type_checking_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..collectives._backend import Comm\n"
        "def f():\n    from .. import collectives\n"
    )
    modules = [m for _, m in _imports(probe)]
    assert "shardax.collectives._backend" in modules and "shardax.collectives" in modules
