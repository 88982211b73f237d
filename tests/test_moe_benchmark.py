"""The MoE benchmark runs end to end (``--smoke``: tiny GPT with 4 experts,
fresh ranks per mode): with a capacity some pairs drop and the shardax
stages agree, dropless drops none and — with DeepSpeed where it is
installed — starts from the same loss as DeepSpeed's MoE; where DeepSpeed
is absent (CI) its modes are skipped with the reason."""

from __future__ import annotations

import importlib.util
import json

from _bench import check_training_row, run_benchmark

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def test_moe_benchmark_smoke(tmp_path):
    out = tmp_path / "moe.json"
    modes = ["shardax1", "shardax3-dropless", "deepspeed1-dropless"]
    header, rows, summary = run_benchmark(
        "moe.py", "--smoke", "--json", str(out), "--modes", ",".join(modes), timeout=300
    )
    assert header["benchmark"] == "moe" and header["nproc"] == header["ep"] == 2
    assert header["model"]["experts"] == 4 and header["model"]["params"] > 0
    ran = modes if HAS_DEEPSPEED else modes[:2]
    assert [r["mode"] for r in rows] == ran
    if not HAS_DEEPSPEED:
        assert "deepspeed is not installed" in summary["skipped"]["deepspeed1-dropless"]
    for r in rows:
        check_training_row(r, header)
    stats = summary["summary"]
    assert 0 < stats["shardax1"]["dropped_fraction"] < 0.5  # capacity factor 1.0
    assert stats["shardax3-dropless"]["dropped_fraction"] == 0
    # ZeRO-1 with a capacity and ZeRO-3 dropless: the same weights and batch, close losses
    assert abs(stats["shardax1"]["first_loss"] - stats["shardax3-dropless"]["first_loss"]) < 1e-2
    if HAS_DEEPSPEED:  # DeepSpeed's MoE from the same weights: the same first loss
        assert summary["dropless_first_loss_spread"] <= 1e-4
        assert stats["deepspeed1-dropless"]["dropped_fraction"] == 0
    assert json.loads(out.read_text())["summary"] == stats
