"""The repository root holds one importable package, `shardax`, and nothing
else: a module at the root would shadow an installed distribution of the same
name whenever Python runs from the checkout (`python -m pytest`, a notebook),
as a root-level `kernels/` once shadowed the `kernels` package that
transformers imports."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_SUFFIXES = tuple(importlib.machinery.all_suffixes())  # .py, .pyc, .so, ...


def _importable(entry: Path) -> bool:
    if entry.is_file():
        return entry.name.endswith(MODULE_SUFFIXES)
    return entry.is_dir() and any((entry / f"__init__{s}").exists() for s in MODULE_SUFFIXES)


def test_the_root_holds_no_module_but_shardax():
    importable = sorted(e.name for e in ROOT.iterdir() if _importable(e))
    assert importable == ["shardax"], (
        f"the repository root {ROOT} holds importable modules {importable}; only the shardax "
        "package may live there (move the others into shardax/, tests/, examples/ or benchmarks/)"
    )


def test_transformers_and_shardax_import_from_the_root():
    """transformers imports the `kernels` distribution; from the checkout's root
    it must get that one, not a folder of ours."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util, transformers, shardax\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(spec and spec.origin)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert not done.stdout.strip().startswith(str(ROOT / "kernels")), done.stdout  # None: absent
