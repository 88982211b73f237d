"""The planner's benchmark (``benchmarks/plan.py``): its smoke run writes
well-formed JSON, its Spearman helper ranks as Spearman does, and the
committed full run (``benchmarks/results/plan.json``) meets issue 36's
acceptance criteria — that test reads the JSON and times nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _bench import load_benchmark, run_benchmark

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "plan.json"
REQUIRED = ["zero0", "zero1", "zero2", "zero3", "tp2", "zero3-remat", "zero3-opt-disk"]
"""The layouts issue 36 names (besides two pipeline schedules)."""


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/plan.py`` as a module (its ``_data`` beside it)."""
    return load_benchmark("plan.py")


def test_plan_benchmark_smoke(tmp_path):
    out = tmp_path / "plan.json"
    header, rows, summary = run_benchmark("plan.py", "--smoke", "--json", str(out), timeout=240)
    assert header["benchmark"] == "plan" and header["preset"] == "tiny"
    assert header["nproc"] == 2 and header["repeats"] == 1
    assert header["layouts"] == ["zero0", "zero3"]
    assert header["cluster_spec"] == "this-machine:2"
    assert header["run_configs"]["zero3"]["parallel"]["zero"] == 3
    assert header["run_configs"]["zero0"]["mesh"] == {"dp": 2}
    assert [(r["layout"], r["repeat"]) for r in rows] == [("zero0", 0), ("zero3", 0)]
    for r in rows:
        assert "error" not in r, r
        assert len(r["tokens_per_s_steps"]) == header["steps"]
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["step_s"] == pytest.approx(header["tokens_per_step"] / r["tokens_per_s"])
        assert r["peak_rss_mib"] == r["peak_rss_phases_mib"]["step"] > 0
        assert {"init", "step"} <= set(r["peak_rss_phases_mib"])
    stats = summary["summary"]
    assert list(stats) == ["zero0", "zero3"] and "failed" not in summary
    for layout, s in stats.items():
        (r,) = [r for r in rows if r["layout"] == layout]
        assert s["tokens_per_s"] == r["tokens_per_s"] and s["peak_rss_mib"] == r["peak_rss_mib"]
        assert s["repeats"] == 1 and s["tokens_per_s_spread"] == s["peak_rss_spread"] == 0
    assert summary["criteria"] == {"tokens_within": 0.25, "rss_within": 0.15, "spearman_min": 0.8}
    assert summary["criteria_hold"]["layouts"] is False  # 2 layouts of the 8 required
    assert summary["host"]["cpu_count"] >= 1 and len(summary["host"]["loadavg_end"]) == 3
    assert header["cluster"]["name"] == "this-machine"  # every layout predicted
    for s in stats.values():
        p = s["predicted"]
        assert p["tokens_per_s"] > 0 and p["peak_rss_mib"] > 0
        assert s["tokens_ratio"] == p["tokens_per_s"] / s["tokens_per_s"]
        assert s["rss_ratio"] == p["peak_rss_mib"] / s["peak_rss_mib"]
        json.dumps(p["breakdown"])
    result = json.loads(out.read_text())
    assert result["runs"] == rows and result["summary"] == stats


def test_spearman(bench):
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [9, 7, 5, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: x ranks 1, 2.5, 2.5, 4 against 1..4 → 4.5 / sqrt(4.5 · 5)
    assert bench.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / math.sqrt(10))
    assert bench.average_ranks([5, 1, 5, 5, 0]) == [4.0, 2.0, 4.0, 4.0, 1.0]
    # without ties, the textbook formula 1 - 6 Σd² / (n (n² - 1))
    x, y = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0], [2.0, 7.0, 1.0, 8.0, 2.5, 3.0]
    rx, ry = bench.average_ranks(x), bench.average_ranks(y)
    d2 = sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True))
    assert bench.spearman(x, y) == pytest.approx(1 - 6 * d2 / (6 * (36 - 1)))
    assert bench.spearman([1, 1, 1], [1, 2, 3]) is None  # no order on one side
    assert bench.spearman([1], [2]) is None
    with pytest.raises(ValueError, match="3 values against 2"):
        bench.spearman([1, 2, 3], [1, 2])


def test_summary_judges_each_criterion(bench):
    def row(layout: str, tokens: float, rss: float) -> dict:
        return {
            "layout": layout,
            "repeat": 0,
            "tokens_per_s": tokens,
            "step_s": 1.0,
            "peak_rss_mib": rss,
            "peak_rss_phases_mib": {"init": 100.0, "step": rss},
        }

    layouts = [f"l{i}" for i in range(8)]
    rows = [row(name, 100.0 * (i + 1), 1000.0) for i, name in enumerate(layouts)]

    def predicted(tokens_scale: float, rss: float) -> dict:
        return {
            name: {"tokens_per_s": 100.0 * (i + 1) * tokens_scale, "peak_rss_mib": rss}
            for i, name in enumerate(layouts)
        }

    def holds(summary: dict) -> list:  # tokens, rss, spearman, layouts
        return [summary["criteria_hold"][k] for k in ("tokens", "rss", "spearman", "layouts")]

    good = bench.summarize(rows, layouts, predicted(1.2, 1140.0))
    assert good["spearman"] == pytest.approx(1.0) and holds(good) == [True] * 4
    bad = bench.summarize(rows, layouts, predicted(0.7, 1160.0))  # 30 % slow, 16 % over
    assert holds(bad) == [False, False, True, True]
    none = bench.summarize(rows, layouts, {})
    assert none["spearman"] is None and none["summary"]["l0"]["predicted"] is None
    assert holds(none) == [None, None, None, False]


@pytest.fixture(scope="module")
def committed():
    """The committed full run of ``python benchmarks/plan.py --repeats 3
    --max-pressure 0.3 --json benchmarks/results/plan.json`` (``this-machine``,
    2 ranks), checked whole: at least 8 layouts, two pipeline schedules,
    every one run and predicted; and its ratios, recomputed from the values."""
    assert RESULTS.is_file(), f"no {RESULTS.relative_to(ROOT)}: run the full benchmark"
    result = json.loads(RESULTS.read_text())
    assert result["benchmark"] == "plan" and result["nproc"] == 2
    assert result["cluster_spec"].split(":")[0] == "this-machine"
    assert "failed" not in result, f"layouts that did not run: {result.get('failed')}"
    stats = result["summary"]
    assert len(stats) >= 8 and set(REQUIRED) <= set(stats), sorted(stats)
    schedules = {
        result["run_configs"][name]["parallel"]["pp_schedule"]
        for name in stats
        if result["run_configs"][name]["parallel"]["pp"] is not None
    }
    assert len(schedules) >= 2, f"pipeline schedules measured: {schedules}"
    missing = [name for name, s in stats.items() if s["predicted"] is None]
    assert not missing, f"layouts without a prediction: {missing}"
    assert result["criteria"] == {"tokens_within": 0.25, "rss_within": 0.15, "spearman_min": 0.8}
    tokens = {n: s["predicted"]["tokens_per_s"] / s["tokens_per_s"] for n, s in stats.items()}
    rss = {n: s["predicted"]["peak_rss_mib"] / s["peak_rss_mib"] for n, s in stats.items()}
    return result, tokens, rss


def test_committed_tokens_per_s_are_predicted_within_25_percent(committed):
    """Issue 36, acceptance point 1: every layout's predicted tokens/s within
    ±25 % of the measured median (the test reads the JSON; it times nothing)."""
    result, tokens, _ = committed
    within = result["criteria"]["tokens_within"]
    off = {n: round(r, 3) for n, r in tokens.items() if abs(r - 1) > within}
    assert not off, f"predicted / measured tokens/s outside 1 ± {within}: {off}"


def test_committed_peak_rss_within_15_percent_and_the_order_holds(bench, committed):
    """Issue 36, acceptance point 1: every layout's predicted peak memory
    within ±15 % of the measured ``step``-phase peak RSS, and the layouts
    in the same order by tokens/s (Spearman ≥ 0.8)."""
    result, _, rss = committed
    within = result["criteria"]["rss_within"]
    off = {n: round(r, 3) for n, r in rss.items() if abs(r - 1) > within}
    stats = result["summary"]
    rho = bench.spearman(
        [s["predicted"]["tokens_per_s"] for s in stats.values()],
        [s["tokens_per_s"] for s in stats.values()],
    )
    assert not off, f"predicted / measured peak RSS outside 1 ± {within}: {off}"
    assert rho is not None and rho >= result["criteria"]["spearman_min"], f"Spearman {rho}"
