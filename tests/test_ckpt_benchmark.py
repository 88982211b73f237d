"""The checkpoint benchmark runs end to end (``--smoke``: tiny GPT, 2 ranks,
1 repeat), writes one row per (lib, op) and a summary, and every checkpoint
either library wrote loads back bit for bit on every rank. Nothing here
depends on timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBS = {"shardax", "dcp"}
OPS = ["save", "load", "save_async"]
OFFLINE = {("shardax", "reshard"), ("shardax", "consolidate"), ("dcp", "consolidate")}
OFFLINE |= {("shardax", "consolidate_params")}


def test_ckpt_benchmark_smoke(tmp_path):
    out = tmp_path / "ckpt.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/ckpt.py", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    header, rows, summary = lines[0], lines[1:-1], lines[-1]
    offline = [r for r in rows if r.get("offline")]
    rows = [r for r in rows if not r.get("offline")]
    assert {(r["lib"], r["op"]) for r in offline} == OFFLINE and len(offline) == len(OFFLINE)
    for r in offline:  # in fresh processes, on the 2-rank job's checkpoints
        assert "error" not in r, r
        assert r["nproc"] == 2 and r["offline_ok"] is True  # the two consolidated files agree
        assert r["time_s"] > 0 and r["out_bytes"] >= r["state_bytes"] > 0
        assert r["GBps"] == r["state_bytes"] / r["time_s"] / 1e9
    params_only = next(r for r in offline if r["op"] == "consolidate_params")
    assert params_only["state_bytes"] < rows[0]["state_bytes"] / 2  # no optimizer state
    assert header["benchmark"] == "ckpt" and header["preset"] == "tiny"
    assert header["nproc"] == [2] and header["repeats"] == 1
    assert "warm" in header["cache"] and Path(header["dir"]).is_absolute()
    # one row per (lib, op), each op for both libraries before the next op
    assert [r["op"] for r in rows] == [op for op in OPS for _ in LIBS]
    assert {(r["lib"], r["op"]) for r in rows} == {(lib, op) for lib in LIBS for op in OPS}
    state_bytes = rows[0]["state_bytes"]
    saved = rows[0]["saved_digest"]
    assert len(saved) == 2 and saved[0] != saved[1]  # each rank holds its own shards
    for r in rows:
        assert "error" not in r, r
        assert r["nproc"] == 2 and r["repeat"] == 0 and r["state_bytes"] == state_bytes
        assert r["roundtrip_ok"] is True, r
        assert r["saved_digest"] == saved
        assert r["time_s"] > 0 and r["GBps"] == state_bytes / r["time_s"] / 1e9
        assert len(r["peak_rss_mib_per_rank"]) == 2
        assert r["peak_rss_mib"] == max(r["peak_rss_mib_per_rank"])
        assert r["rss_increase_mib"] == max(r["rss_increase_mib_per_rank"])
        if r["op"] == "load" or r["op"] == "save_async":  # what came back is what was saved
            assert r["loaded_digest"] == saved, r
        if r["op"] != "load":  # every global tensor is on disk, plus headers and indexes
            assert r["disk_bytes"] >= state_bytes and r["files"] >= 2
        if r["op"] == "save_async":
            assert 0 < r["return_s"] <= r["time_s"]
    assert summary["roundtrip_ok"] is True and "failed" not in summary
    assert summary["offline_ok"] is True
    by_op = {e["op"]: e for e in summary["offline"]}
    assert set(by_op) == {"reshard", "consolidate", "consolidate_params"}
    assert (
        by_op["consolidate"]["ratio"]
        == by_op["consolidate"]["dcp_s"] / by_op["consolidate"]["shardax_s"]
    )
    entries = {(e["nproc"], e["op"]): e for e in summary["summary"]}
    assert set(entries) == {(2, op) for op in OPS}
    for e in entries.values():
        assert e["ratio"] == e["dcp_s"] / e["shardax_s"]
        assert e["shardax_repeats"] == e["dcp_repeats"] == 1
    async_entry = entries[(2, "save_async")]
    assert (
        async_entry["return_ratio"] == async_entry["dcp_return_s"] / async_entry["shardax_return_s"]
    )
    assert "ratio" in done.stderr and "shardax s" in done.stderr  # the readable table
    result = json.loads(out.read_text())
    assert result["summary"] == summary["summary"]
    assert len(result["runs"]) == len(rows) + len(offline)
    assert result["benchmark"] == "ckpt" and result["roundtrip_ok"] is True
