"""The memory benchmark runs end to end (``--smoke``: tiny GPT, fresh ranks
per mode): ZeRO-3 with the blocks rematerialised and with the optimizer
state on disk measure, and every mode's losses are the in-memory run's."""

from __future__ import annotations

import json

from _bench import check_training_row, run_benchmark


def test_memory_benchmark_smoke(tmp_path):
    out = tmp_path / "memory.json"
    modes = ["shardax3", "shardax3-remat-offload"]
    header, rows, summary = run_benchmark(
        "memory.py", "--smoke", "--json", str(out), "--modes", ",".join(modes), timeout=300
    )
    assert header["benchmark"] == "memory" and header["nproc"] == 2
    assert [r["mode"] for r in rows] == modes
    for r in rows:
        check_training_row(r, header)
    assert rows[0]["losses"] == rows[1]["losses"]  # remat and disk state change no number
    stats = summary["summary"]
    assert stats["shardax3-remat-offload"]["tokens_per_s_vs_shardax3"] > 0
    assert json.loads(out.read_text())["summary"] == stats
