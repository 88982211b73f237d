"""Checks every training benchmark's JSON rows share (``train.py``,
``pipeline.py``: one row per mode and repeat)."""

from __future__ import annotations


def check_training_row(row: dict, header: dict, nproc: int = 2) -> None:
    """A mode that ran and measured: no error, positive speed, a peak RSS
    per rank (the row's peak their max), a loss for every step."""
    assert "error" not in row, row
    assert row["tokens_per_s"] > 0 and row["step_s"] > 0
    assert len(row["peak_rss_mib_per_rank"]) == nproc
    assert row["peak_rss_mib"] == max(row["peak_rss_mib_per_rank"])
    assert len(row["losses"]) == header["warmup"] + header["steps"]
