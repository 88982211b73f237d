"""The import rules of docs/architecture.md, checked on the source: each
folder of the package is a layer that imports only layers below it (lazy
and ``TYPE_CHECKING`` imports included), no modules import each other at
load time, ``__init__.py`` files only re-export, and files and classes stay
small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardax"

# Lowest first: a unit may import only units of a lower level.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_tree", "_timing"),
    ("_bad_setting",),
    ("kernels",),
    ("mesh",),
    ("collectives",),
    ("shard",),
    ("moe",),
    ("rules", "optim", "data"),
    ("pipeline",),
    ("ckpt", "monitor", "report", "config", "testing"),
    ("plan",),
    ("launch",),
    ("cli",),
    ("__init__", "__main__"),
)
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}

MAX_FILE_LINES = 620
MAX_CLASS_LINES = 320


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported shardax module, line, at load time)`` for every import in
    ``module``: ``from .x import y`` counts as ``.x.y`` where that is a module."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if is_package else module.rpartition(".")[0]
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            targets = [n if n in MODULES else target for n in names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "shardax" and target != module:
                found.append((target, node.lineno, id(node) in top))
    return found


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units <= set(LEVEL), (
        f"add {sorted(units - set(LEVEL))} to LAYERS (and docs/architecture.md)"
    )


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for module in MODULES:
        mine = _unit(module)
        for target, line, _ in _imports(module):
            theirs = _unit(target)
            if theirs != mine and LEVEL[theirs] >= LEVEL[mine]:
                wrong.append(
                    f"{MODULES[module][0].relative_to(PACKAGE.parent)}:{line} ({mine}) imports {target} ({theirs})"
                )
    assert not wrong, "imports against the layers of docs/architecture.md:\n" + "\n".join(wrong)


def test_no_import_cycles_at_load_time():
    graph = {m: {t for t, _, top in _imports(m) if top and t in MODULES} for m in MODULES}
    # parents are imported first by Python: an edge into a package's own
    # __init__ from inside it is not a cycle of ours
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, stack: list[str]) -> bool:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle.extend([*stack[stack.index(t) :], m, t] if t in stack else [m, t])
                return True
            if t not in state and visit(t, [*stack, m]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if m not in state and visit(m, []):
            break
    assert not cycle, f"modules import each other at load time: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", sorted(m for m, (_, pkg) in MODULES.items() if pkg))
def test_init_files_only_reexport(module):
    path = MODULES[module][0]
    tree = ast.parse(path.read_text())
    imported: list[str] = []
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.level:
            assert all(a.asname == a.name for a in node.names), (
                f"{path}:{node.lineno}: re-export as `from .x import Name as Name`"
            )
            imported += [a.name for a in node.names]
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__all__"
        ]:
            exported = [e.value for e in node.value.elts]  # type: ignore[attr-defined]
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__version__"
        ]:
            continue
        raise AssertionError(f"{path}:{node.lineno}: __init__.py files only re-export")
    assert len(exported) == len(set(exported)), f"{path}: a name twice in __all__"
    assert len(imported) == len(set(imported)), f"{path}: a name imported twice"
    assert sorted(exported) == sorted(imported), (
        f"{path}: __all__ and the re-exports differ: {sorted(set(exported) ^ set(imported))}"
    )


def test_files_and_classes_stay_readable():
    long = []
    for path, _ in MODULES.values():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > MAX_CLASS_LINES:
                    long.append(
                        f"{path.relative_to(PACKAGE.parent)}: class {node.name}, {size} lines"
                    )
    assert not long, "split these (docs/architecture.md):\n" + "\n".join(long)
