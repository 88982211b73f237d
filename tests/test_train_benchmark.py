"""The training benchmark runs end to end (``--smoke``: tiny GPT, fresh ranks
per mode), every mode starts from the same loss, and the example model's
docstring examples hold."""

from __future__ import annotations

import doctest
import importlib.util
import json
from pathlib import Path

import pytest
from _bench import check_training_row, run_benchmark

ROOT = Path(__file__).resolve().parents[1]
# By default the anchors and one mode of each kind (ZeRO, tensor parallelism);
# the other modes — the same code on other rules, whose training the suite
# checks elsewhere — and the same steps in other environments (the check's
# cost, glibc's malloc) with pytest -m slow.
SMOKE_MODES = {"limit", "ddp", "fsdp2", "shardax3", "shardax-tp"}
OTHER_MODES = {"fsdp2-script", "shardax0", "shardax1", "shardax2", "shardax-tp-sp"}
OTHER_MODES |= {"shardax-tp-whole"}
OTHER_MODES |= {"shardax-ulysses"}
VARIANTS = {"shardax3-unchecked", "shardax3-gloo", "shardax3-gloo-unchecked", "fsdp2-glibc"}


def test_gpt_docstring_examples():
    spec = importlib.util.spec_from_file_location("gpt", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def _smoke(tmp_path, modes: set[str]) -> tuple[dict, list[dict], dict, dict]:
    out = tmp_path / "train.json"
    header, rows, summary = run_benchmark(
        "train.py", "--smoke", "--json", str(out), "--modes", ",".join(sorted(modes)), timeout=400
    )
    assert header["benchmark"] == "train" and header["nproc"] == 2
    assert set(header["modes"]) == modes and header["skipped"] == {}
    return header, rows, summary, json.loads(out.read_text())


@pytest.mark.slow
def test_train_benchmark_variants_smoke(tmp_path):
    """The modes that run another mode's step in another environment: the
    signature check's cost on each backend, FSDP2 with glibc's malloc."""
    _, rows, summary, _ = _smoke(tmp_path, VARIANTS | {"shardax3", "fsdp2"})
    assert all("error" not in r for r in rows)
    stats = summary["summary"]
    assert set(summary["collective_check_cost"]) == {"shardax3", "shardax3-gloo"}
    for variant in ("shardax3-unchecked", "shardax3-gloo", "shardax3-gloo-unchecked"):
        assert stats[variant]["first_loss"] == stats["shardax3"]["first_loss"], variant
    assert stats["fsdp2-glibc"]["first_loss"] == stats["fsdp2"]["first_loss"]


def _check(header: dict, rows: list[dict], summary: dict, result: dict) -> dict:
    """Every mode ran (one repeat, in order), measured and started from the
    same loss; each mode's own checks. The summary's per-mode stats."""
    assert [r["mode"] for r in rows] == header["modes"]  # one repeat, in order
    for r in rows:
        check_training_row(r, header)
        if r["mode"].startswith("shardax"):
            assert r["comm_per_step"], r["mode"]  # one step's collectives, by op
        if r["mode"] in ("shardax-tp", "shardax-tp-sp", "shardax-tp-whole"):
            check = r["megatron"]  # the activation collectives: Megatron's count and bytes
            assert check["matches"], check
            ops = r["comm_per_step"]
            if r["mode"] == "shardax-tp":
                assert "psum over tp" in ops and "all_gather over tp" not in ops
            elif r["mode"] == "shardax-tp-whole":  # the head's logits gathered
                assert "psum over tp" in ops and "all_gather over tp" in ops
            else:
                assert "all_gather over tp" in ops and "psum_scatter over tp" in ops
        if r["mode"] == "shardax-ulysses":
            assert "all_to_all over sp" in r["comm_per_step"]
    stats = summary["summary"]
    assert set(stats) == set(header["modes"])
    assert "warning" not in summary, summary["warning"]
    assert summary["first_loss_spread"] <= 1e-4
    assert stats["fsdp2"]["tokens_per_s_vs_fsdp2"] == 1.0
    assert stats["limit"]["of_limit"] == 1.0 and all("of_limit" in s for s in stats.values())
    assert result["summary"] == stats and len(result["runs"]) == len(rows)
    return stats


def test_train_benchmark_smoke(tmp_path):
    _check(*_smoke(tmp_path, SMOKE_MODES))


@pytest.mark.slow
def test_train_benchmark_other_modes_smoke(tmp_path):
    header, rows, summary, result = _smoke(tmp_path, OTHER_MODES | {"limit", "fsdp2"})
    _check(header, rows, summary, result)
    assert summary["fsdp2_vs_plain_script"] > 0
