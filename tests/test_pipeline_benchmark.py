"""The pipeline benchmark runs end to end (``--smoke``: tiny GPT, fresh ranks
per mode), each torch schedule trains the same tied model as DDP, and a
schedule whose first loss is off DDP's fails the run."""

from __future__ import annotations

import json
from pathlib import Path

from _bench import check_training_row, load_benchmark, run_benchmark

ROOT = Path(__file__).resolve().parents[1]
# DDP, torch and shardax with a stage per rank and two in a V (the tied
# head on the embedding's rank); pytest -m slow is not needed for the others:
# `python benchmarks/pipeline.py --smoke` runs them all in about 35 s.
MODES = ["ddp", "torch-zbv", "shardax-zbv"]
# fp32 losses near 6 differ by a few ulps (4.8e-7 here) between DDP's mean of
# ranks' means and the pipelines' mean of micro-batch means; 1e-4 is the
# benchmark's own check. A head that does not share the embedding's gradient
# moves the loss by about lr (3e-4) times the gradient's size from step 2 on.
TOLERANCE = 1e-4


def test_pipeline_benchmark_smoke(tmp_path):
    out = tmp_path / "pipeline.json"
    header, rows, summary = run_benchmark(
        "pipeline.py", "--smoke", "--out", str(out), "--modes", ",".join(MODES), timeout=120
    )
    assert header["benchmark"] == "pipeline" and header["nproc"] == 2
    assert header["modes"] == MODES and header["micro_batches"] == 4
    assert [r["mode"] for r in rows] == MODES  # one repeat, in order
    ddp = rows[0]
    for r in rows:
        check_training_row(r, header)
        assert r["first_loss"] == r["losses"][0] and r["last_loss"] == r["losses"][-1]
        for mine, reference in zip(r["losses"], ddp["losses"], strict=True):
            assert abs(mine - reference) <= TOLERANCE, (r["mode"], r["losses"], ddp["losses"])
    stats = summary["summary"]
    assert list(stats) == MODES and summary["first_loss_check"] == "ok"
    assert stats["ddp"]["tokens_per_s_vs_ddp"] == 1.0 and stats["ddp"]["peak_rss_vs_ddp"] == 1.0
    assert all(abs(s["first_loss_vs_ddp"]) <= TOLERANCE for s in stats.values())
    result = json.loads(out.read_text())
    assert result["summary"] == stats and result["runs"] == rows


def test_first_loss_mismatch_fails_the_summary(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its train.py and _data.py, later too
    pipeline = load_benchmark("pipeline.py")

    def row(mode: str, first: float) -> dict:
        return {
            "mode": mode,
            "tokens_per_s": 100.0,
            "step_s": 1.0,
            "peak_rss_mib": 2.0,
            "peak_rss_mib_per_rank": [1.0, 2.0],
            "losses": [first, 5.0],
        }

    summary = pipeline.summarize_vs_ddp(
        [row("ddp", 6.0), row("torch-gpipe", 6.0 + 3e-4)], ["ddp", "torch-gpipe"]
    )
    assert summary["first_loss_check"] == "failed"
    assert list(summary["first_loss_mismatch"]) == ["torch-gpipe"]
    assert summary["summary"]["torch-gpipe"]["peak_rss_mib_per_rank"] == [1.0, 2.0]
