"""What the benchmarks' smoke tests share: running one as a user does and
reading its JSON lines, and the checks every training benchmark's rows
share (``train.py``, ``pipeline.py``, ``moe.py``: one row per mode and
repeat)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str, timeout: float) -> tuple[dict, list[dict], dict]:
    """``python benchmarks/<script> *args`` from the repository root, which
    must succeed: its first JSON line (the header), the rows, the last (the
    summary)."""
    argv = [sys.executable, f"benchmarks/{script}", *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return lines[0], lines[1:-1], lines[-1]


def load_benchmark(script: str) -> ModuleType:
    """``benchmarks/<script>`` as a module of its own (named
    ``<stem>_benchmark``), its siblings (``_data``, ``train``) importable
    while it loads."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        name = f"{Path(script).stem}_benchmark"
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def check_training_row(row: dict, header: dict, nproc: int = 2) -> None:
    """A mode that ran and measured: no error, positive speed, a peak RSS
    per rank (the row's peak their max), a loss for every step."""
    assert "error" not in row, row
    assert row["tokens_per_s"] > 0 and row["step_s"] > 0
    assert len(row["peak_rss_mib_per_rank"]) == nproc
    assert row["peak_rss_mib"] == max(row["peak_rss_mib_per_rank"])
    assert len(row["losses"]) == header["warmup"] + header["steps"]
