"""What the benchmarks' smoke tests share: running one as a user does and
reading its JSON lines, and the checks every training benchmark's rows
share (``train.py``, ``pipeline.py``, ``moe.py``: one row per mode and
repeat)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def check_training_row(row: dict, header: dict, nproc: int = 2) -> None:
    """A mode that ran and measured: no error, positive speed, a peak RSS
    per rank (the row's peak their max), a loss for every step."""
    assert "error" not in row, row
    assert row["tokens_per_s"] > 0 and row["step_s"] > 0
    assert len(row["peak_rss_mib_per_rank"]) == nproc
    assert row["peak_rss_mib"] == max(row["peak_rss_mib_per_rank"])
    assert len(row["losses"]) == header["warmup"] + header["steps"]
