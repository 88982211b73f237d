"""The context-parallelism benchmark (``benchmarks/context.py``): its smoke
run (tiny GPT, 2 ranks, fresh ranks per case) measures every side, starts
them all from the same loss and records what torch's ``context_parallel``
does on CPU; its summary judges the goals as it says; and the committed
full run (``benchmarks/results/context.json``) meets the goals — that test
reads the JSON and times nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _bench import load_benchmark, run_benchmark

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "context.json"
CPU_OP = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/context.py`` as a module (its ``_data`` and ``train`` beside it)."""
    return load_benchmark("context.py")


def check_row(row: dict, header: dict) -> None:
    """A run that measured: speed (not in the live pass), memory per rank, a
    loss per step."""
    assert "error" not in row, row
    live = row.get("pass") == "live"
    assert len(row["peak_rss_mib_per_rank"]) == row["cp"]
    assert row["peak_rss_mib"] == max(row["peak_rss_mib_per_rank"])
    tail = "_live" if live else ""
    activation = row[f"activation{tail}_mib_per_rank"]
    assert row[f"activation{tail}_mib"] == max(activation)  # Linux: VmHWM
    steps, fixed = row[f"step_memory{tail}_mib_per_rank"], row[f"fixed_memory{tail}_mib_per_rank"]
    assert [s - f for s, f in zip(steps, fixed, strict=True)] == activation
    assert len(activation) == row["cp"] and min(steps) > 0
    if live:  # started with every tensor of 128 KiB or more mapped on its own
        assert row["mmap_threshold"] == str(128 * 2**10) and "tokens_per_s" not in row
        assert len(row["losses"]) == header["warmup"]
    else:
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0
        assert len(row["losses"]) == header["warmup"] + header["steps"]


def check_probe(probe: dict, cp: int) -> None:
    """torch 2.13's context parallelism on CPU on ``cp`` ranks, as the module docstring says."""
    assert probe["ranks"] == cp
    cases = probe["cases"]
    tiny, long = (cases["math-backend"]["attention"][k] for k in ("2x2x32x8", "1x2x4096x64"))
    for name in ("as-shipped", "as-shipped-alltoall"):  # the CPU kernel has no CP rule
        assert not cases[name]["trains"]
        for found in cases[name]["attention"].values():
            assert not found["runs"] and found["error"].startswith("NotImplementedError")
            assert CPU_OP in found["error"]
    assert min(tiny["max_error"].values()) > 0.1  # head-tail rows, a mask cut as if contiguous
    assert cases["math-backend"]["max_loss_error"] > 1e-4
    # fp32 attention of unit-variance inputs over up to 4096 keys, merged in
    # another order: a few ulps of values near 1; losses near 6 likewise
    exact = ["cpu-kernel-bound", "cpu-kernel-bound-alltoall", "math-backend-no-load-balance"]
    for name in exact:
        case = cases[name]
        assert case["trains"] and case["max_loss_error"] < 1e-5, (name, case)
        for shape, found in case["attention"].items():
            if name.startswith("math") and shape == "1x2x4096x64" and cp == 4:
                # an unreduced Partial(sum) over the whole sequence, unwrapped by to_local()
                assert found["output_placement"] == "P(sum)" and "max_error" not in found
                assert found["output_local_shape"] == [1, 2, 4096, 64]
                continue
            assert found["runs"] and max(found["max_error"].values()) < 1e-5, (name, shape)
            assert found["output_placement"] == "S(2)"
    if cp == 2:
        assert min(long["max_error"].values()) > 0.1
    ring = cases["cpu-kernel-bound-alltoall"]["attention"]["2x2x32x8"]["collectives"]
    assert set(ring) == {"c10d_functional.all_to_all_single"}
    math = cases["math-backend"]["attention"]["2x2x32x8"]["collectives"]
    assert "c10d_functional.reduce_scatter_tensor" in math


def test_context_benchmark_smoke(tmp_path):
    out = tmp_path / "context.json"
    header, rows, summary = run_benchmark("context.py", "--smoke", "--out", str(out), timeout=300)
    assert header["benchmark"] == "context" and header["cp"] == [2]
    assert header["modes"] == ["single", "torch", "torch-alltoall", "shardax"]
    assert header["skipped"] == {}
    assert header["cases"] == [
        "single-s256", "torch-cp2-s256", "torch-alltoall-cp2-s256", "shardax-cp2-s256",
        "single-s512", "torch-cp2-s512", "torch-alltoall-cp2-s512", "shardax-cp2-s512",
    ]  # fmt: skip
    timed = [r for r in rows if r.get("pass") != "live"]
    assert [r["mode"] for r in timed] == header["cases"]  # one repeat, in order
    live = [r for r in rows if r.get("pass") == "live"]
    assert [r["mode"] for r in live] == header["cases"]  # then the live memory pass
    for r in rows:
        check_row(r, header)
    assert "failed" not in summary and "warning" not in summary
    # every side from the same weights and batch: fp32 losses near 6, summed in another order
    assert summary["first_loss_spread"] <= 1e-4
    stats = summary["summary"]
    assert set(stats) == set(header["cases"])
    for c in summary["comparisons"]:
        ours = stats[f"shardax-cp2-s{c['seq']}"]
        theirs = [stats[f"{m}-cp2-s{c['seq']}"] for m in ("torch", "torch-alltoall")]
        assert c["tokens_per_s_vs_torch"] == ours["tokens_per_s"] / theirs[0]["tokens_per_s"]
        assert c["activation_vs_torch"] == ours["activation_mib"] / theirs[0]["activation_mib"]
        best = max(t["tokens_per_s"] for t in theirs)
        assert c["tokens_per_s_vs_torch_best"] == ours["tokens_per_s"] / best
        for key in ("activation", "activation_live"):
            least = min(t[f"{key}_mib"] for t in theirs)
            assert c[f"{key}_vs_torch_best"] == ours[f"{key}_mib"] / least
            single = stats[f"single-s{c['seq']}"][f"{key}_mib"]
            assert c[f"shardax_{key}_vs_single"] == (
                ours[f"{key}_mib"] / single if single else None
            )
        # tiny sizes: the live pass's tensors are mostly below its 128 KiB
        # threshold, in the heap, so only the as-trained share is surely positive
        assert c["shardax_activation_vs_single"] > 0
        assert c["ideal_activation_vs_single"] == 0.5
    assert set(summary["criteria"]) >= {"tokens_per_s_ge_torch", "activation_le_torch"}
    check_probe(summary["torch_cp_on_cpu"]["cp2"], 2)
    assert summary["memory_search"] == {"skipped": "--smoke"}
    result = json.loads(out.read_text())
    assert result["runs"] == rows and result["summary"] == stats


def test_summary_judges_each_criterion(bench):
    def row(
        mode: str, tokens: float, activation: float, first: float = 6.0, live: float | None = None
    ) -> list[dict]:
        """A timed run, and a run of the live memory pass."""
        name = f"{mode}-s4096" if mode == "single" else f"{mode}-cp2-s4096"
        timed = {
            "mode": name, "tokens_per_s": tokens, "step_s": 4096 / tokens, "peak_rss_mib": 500.0,
            "activation_mib": activation, "losses": [first, 5.9],
        }  # fmt: skip
        found = activation if live is None else live
        return [timed, {"mode": name, "pass": "live", "activation_live_mib": found}]

    cases = bench.cases_of(["single", "torch", "torch-alltoall", "shardax"], [2], [4096])
    names = ["single-s4096", "torch-cp2-s4096", "torch-alltoall-cp2-s4096", "shardax-cp2-s4096"]
    assert [c.name for c in cases] == names
    anchors = [*row("single", 100, 400), *row("torch", 150, 260), *row("torch-alltoall", 155, 250)]
    good = bench.summarize([*anchors, *row("shardax", 160, 240)], cases)
    (c,) = good["comparisons"]
    assert c["tokens_per_s_vs_torch"] == pytest.approx(160 / 150)
    assert c["tokens_per_s_vs_torch_best"] == pytest.approx(160 / 155)
    assert c["activation_vs_torch_best"] == pytest.approx(240 / 250)
    assert c["shardax_activation_vs_single"] == pytest.approx(0.6)  # ≤ 1.25 / 2
    assert good["criteria"] == {
        "tokens_per_s_ge_torch": True, "activation_le_torch": True,
        "activation_about_1_over_cp": True, "activation_about_1_over_cp_as_trained": True,
        "activation_slack": 1.25,
    }  # fmt: skip
    # the ≈ 1/cp goal is the live measure's; ≤ torch's is both measures'
    holes = bench.summarize([*anchors, *row("shardax", 160, 255, live=240)], cases)["criteria"]
    assert holes["activation_about_1_over_cp"] is True
    assert holes["activation_about_1_over_cp_as_trained"] is False  # 255 / 400 > 0.625
    assert holes["activation_le_torch"] is False  # 255 > 250 as trained
    live = bench.summarize([*anchors, *row("shardax", 160, 240, live=255)], cases)["criteria"]
    assert live["activation_le_torch"] is False and live["activation_about_1_over_cp"] is False
    # faster than torch's default and its memory, not than all-to-all's
    bad = bench.summarize([*anchors, *row("shardax", 152, 255)], cases)
    assert bad["comparisons"][0]["tokens_per_s_vs_torch"] > 1
    assert bad["criteria"]["tokens_per_s_ge_torch"] is False
    assert bad["criteria"]["activation_le_torch"] is False
    assert bad["criteria"]["activation_about_1_over_cp"] is False  # 255 / 400 > 0.625
    assert "warning" not in bad
    off = bench.summarize([*anchors, *row("shardax", 160, 240, first=6.1)], cases)
    assert "6.1" in off["warning"]  # first losses 0.1 apart


@pytest.fixture(scope="module")
def committed():
    """The committed full run of ``python benchmarks/context.py --repeats 5``
    (cp 2 and 4, sequences 4096–16384, the memory search), checked whole:
    every case counted in every repeat, the same first loss everywhere,
    torch's CP on CPU as the docstring says."""
    assert RESULTS.is_file(), f"no {RESULTS.relative_to(ROOT)}: run the full benchmark"
    result = json.loads(RESULTS.read_text())
    assert result["benchmark"] == "context" and result["repeats"] >= 3
    assert result["cp"] == [2, 4] and result["seqs"] == [4096, 8192, 16384]
    assert result["modes"] == ["single", "torch", "torch-alltoall", "shardax"]
    assert "failed" not in result and "warning" not in result
    assert result["first_loss_spread"] <= 1e-4
    assert all(s["repeats"] == result["repeats"] for s in result["summary"].values())
    for cp in result["cp"]:
        check_probe(result["torch_cp_on_cpu"][f"cp{cp}"], cp)
    assert len(result["comparisons"]) == 6
    return result


def _each(committed: dict, key: str) -> dict[tuple[int, int], float]:
    return {(c["cp"], c["seq"]): c[key] for c in committed["comparisons"]}


def test_committed_activation_falls_toward_1_over_cp_as_trained(committed):
    """As trained, a rank's heap holes (about the same whatever the rank
    count) weigh on the share of one process's activation at short lengths:
    shardax's share falls with the length, and is within 1.25/cp at the
    longest — the live measure's goal, as trained too."""
    share = _each(committed, "shardax_activation_vs_single")
    for cp in committed["cp"]:
        mine = [share[cp, seq] for seq in committed["seqs"]]
        assert mine == sorted(mine, reverse=True), (cp, mine)
        assert mine[-1] <= committed["criteria"]["activation_slack"] / cp, (cp, mine)


def test_committed_longer_sequences_in_a_memory_limit(committed):
    """In the same per-rank memory cgroup shardax trains longer sequences
    than one process, the more so the more ranks, with parameters
    replicated (ZeRO-0) as with them sharded over the ring (ZeRO-3); every
    try completed or was killed by the kernel for memory, and left nothing
    behind."""
    search = committed["memory_search"]
    assert "skipped" not in search, search
    assert search["search"]["zero"] == [0, 3]
    single = search["single"]["longest"]
    for tail in ("", "-zero3"):
        longest = [search[f"shardax-cp{cp}{tail}"]["longest"] for cp in committed["cp"]]
        assert single < longest[0] < longest[1], (tail, single, longest)
    keys = ["single"] + [f"shardax-cp{cp}{t}" for t in ("", "-zero3") for cp in committed["cp"]]
    tries = [t for key in keys for t in search[key]["tries"]]
    assert all(t["ok"] or t["oom_kills"] for t in tries)
    assert not any(t["leftover_processes_killed"] or t["shm_files_removed"] for t in tries)


# The goals, judged on the committed run (2026-12-07, this 2-core host).


def test_committed_tokens_per_s_at_least_torchs(committed):
    """Shardax's tokens/s ≥ the faster of torch's rotate methods' at every cp and length."""
    assert committed["criteria"]["tokens_per_s_ge_torch"], _each(
        committed, "tokens_per_s_vs_torch_best"
    )


def test_committed_activation_at_most_torchs(committed):
    """Per-rank activation memory ≤ the smaller of torch's rotate methods',
    as trained and live, at every cp and length."""
    assert committed["criteria"]["activation_le_torch"], (
        _each(committed, "activation_vs_torch_best"),
        _each(committed, "activation_live_vs_torch_best"),
    )


def test_committed_activation_about_1_over_cp(committed):
    """Per-rank activation memory ≤ 1.25/cp of one process's (live: the
    tensors alive, without the heap's holes) at every cp and length."""
    assert committed["criteria"]["activation_about_1_over_cp"], _each(
        committed, "shardax_activation_live_vs_single"
    )
    assert all(s["live_repeats"] >= 3 for s in committed["summary"].values())


def test_committed_longest_sequence_cp_times_one_process(committed):
    """In the same per-rank memory cgroup shardax trains at least cp times
    the sequence one process can, its parameters and optimizer state
    sharded over the ring (ZeRO-3 over cp, as a long-context run shards
    them)."""
    search = committed["memory_search"]
    found = {cp: search[f"shardax-cp{cp}-zero3"] for cp in committed["cp"]}
    assert all(f["holds"] for f in found.values()), {
        cp: f["longest_vs_single"] for cp, f in found.items()
    }


@pytest.mark.slow
@pytest.mark.timeout(900)  # a dozen one-step trainings under a memory limit, some OOM-killed
def test_context_benchmark_memory_search_smoke(tmp_path, bench):
    """The cgroup search on the tiny GPT: where this process may make memory
    cgroups (root), one process and cp=2 each find a longest sequence, the
    failures are the kernel's OOM kills, and nothing is left behind;
    elsewhere the search is skipped with the reason."""
    argv = ["--smoke", "--memory-search", "--memory-limit-mib", "384", "--no-probe"]
    argv += ["--search-start", "1024", "--search-step", "256", "--search-max", "65536"]
    base, why = bench.cgroup_base()
    before = set(Path(base).glob("shardax-context-*")) if base is not None else set()
    _, _, summary = run_benchmark(
        "context.py", *argv, "--out", str(tmp_path / "c.json"), timeout=900
    )
    search = summary["memory_search"]
    if base is None:
        assert search == {"skipped": why}
        return
    assert search["limit_mib_per_rank"] == 384 and search["per_rank"]
    single, cp2 = search["single"], search["shardax-cp2"]
    assert single["longest"] and cp2["longest"] and cp2["longest_vs_single"] > 1
    for found in (single, cp2):
        assert found["longest"] % 256 == 0 and found["first_failure"] - found["longest"] <= 256
        failed = [t for t in found["tries"] if not t["ok"]]
        assert failed and all(t["oom_kills"] for t in failed)
        assert all(max(t["peak_mib_per_rank"]) <= 384 for t in found["tries"])
    # every cgroup it made removed (another run's may exist meanwhile)
    assert set(Path(base).glob("shardax-context-*")) <= before


def test_a_crashed_probe_is_tried_again_and_the_crash_kept(bench, monkeypatch):
    """torch's CP on CPU once died of heap corruption in CI: the probe runs
    again, once, and its row says so; two crashes are the error."""
    outcomes = []

    def launch_run(argv, env, args, result, row):
        kind = outcomes.pop(0)
        row.update({"error": "ranks exited with code 134"} if kind == "crash" else {"ranks": 2})
        return row

    monkeypatch.setattr(bench, "launch_run", launch_run)
    args = bench.parse_args(["--smoke"])
    outcomes[:] = ["crash", "ok"]
    assert bench.run_probe(args, 2) == {"ranks": 2, "crashed": ["ranks exited with code 134"]}
    outcomes[:] = ["ok"]
    assert bench.run_probe(args, 2) == {"ranks": 2}
    outcomes[:] = ["crash", "crash"]
    assert bench.run_probe(args, 2) == {"error": "ranks exited with code 134"}
