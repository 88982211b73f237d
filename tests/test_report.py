"""``shardax report``: valid JSON on a machine with no GPU, no CuPy and no
compiler; a probe that breaks becomes a line, never a crash; a small
/dev/shm is flagged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardax import report


def test_report_json_without_gpu_cupy_or_compiler(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "PATH")}
    env["PATH"] = str(tmp_path)  # an empty directory: no c++, g++ or clang++
    env["SHARDAX_TEST_MARK"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "shardax", "report", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["kernels"]["compiler"]["found"] is False
    assert "no C++ compiler" in " ".join(data["warnings"])
    assert data["gpus"]["count"] == 0 and data["gpus"]["why_none"]
    assert data["collectives"]["transports"]["gloo"] == {"usable": True}
    assert data["collectives"]["transports"]["nccl"]["usable"] is False
    assert data["environment"]["SHARDAX_TEST_MARK"] == "1"
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert data["cupy"]["installed"] is False and "cupy" in data["cupy"]["why"]


def test_a_failing_probe_is_a_line_not_a_crash(monkeypatch):
    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setitem(report._PROBES, "gpus", broken)
    data = report.collect()
    assert data["gpus"] == {"error": "RuntimeError: driver exploded"}
    assert "the gpus probe failed: RuntimeError: driver exploded" in data["warnings"]
    text = report.format_report(data)
    assert "error: RuntimeError: driver exploded" in text
    json.dumps(data)


def test_a_small_dev_shm_is_flagged(monkeypatch):
    monkeypatch.setitem(
        report._PROBES,
        "shm",
        lambda: {"present": True, "size_gib": 0.06, "free_gib": 0.06, "small": True},
    )
    warnings = report.collect()["warnings"]
    assert any("/dev/shm is 0.06 GiB" in w and "--shm-size" in w for w in warnings)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux")
def test_the_shm_probe_measures_dev_shm():
    shm = report._shm()
    assert shm["present"] and shm["size_gib"] > 0
    assert shm["small"] == (shm["size_gib"] * 2**30 < report.SHM_WARN_BYTES)
