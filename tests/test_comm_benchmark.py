"""The communication benchmark runs end to end (``--smoke``: the tiny GPT on
2 + 2 emulated ranks joined by a 1gbit link, every layout once), and its
numbers add up: every layout has a row, what crosses the link is what the
traffic log says it should (by the benchmark's own table), the 1-bit
optimizers' traffic is what their schedules say each timed step sends, the
layouts made to cross less do, and the summary's medians and ratios are its
rows'.
Nothing here depends on timing. Where the emulated cluster cannot be made
(not root, no iproute2) the smoke run is skipped with the reason; the
layout table is checked anyway."""

from __future__ import annotations

import collections
import importlib.util
import json
import math

import pytest
import torch
from _bench import ROOT, load_benchmark, run_benchmark

import shardax as sx
from shardax.launch._emulated import unavailable

comm = load_benchmark("comm.py")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
WHY = unavailable()
PENDING = {"zero-one-adam"}
"""Layouts added after the committed run (``benchmarks/results/comm.json``):
its goals are checked once a rerun has them."""


def test_every_layout_plans_on_its_mesh():
    """Each shardax layout's rules place the tiny GPT on its 2 × 2 mesh: ZeRO-3
    splits every parameter over 4 ranks (HSDP over the node's 2)."""
    from gpt import GPT, PRESETS

    with torch.device("meta"):
        params = sx.params_of(GPT(PRESETS["tiny"]))
    for name, layout in comm.LAYOUTS.items():
        mesh = sx.AbstractMesh(dict(layout.mesh))
        assert mesh.world_size == comm.NODES * comm.NPROC_PER_NODE, name
        text = str(sx.explain(params, mesh, layout.rules()))
        assert "on each of 4 ranks" in text, (name, text)


def test_the_formula_counts_each_collective_by_where_it_crosses():
    size = 1000.0
    assert comm.across_formula({"all_gather:node,local": size}) == 750.0
    assert comm.across_formula({"psum_scatter:node,local": size, "all_gather:local": size}) == size
    assert comm.across_formula({"psum:replicate": size, "psum_scatter:fsdp": size}) == 2 * size
    assert comm.across_formula({"ragged_all_to_all:node": size}) == 2 * size  # both ranks send
    assert comm.across_formula({"all_to_all:dp": size, "all_gather:dp": size}) == 1750.0
    assert comm.across_formula({"reduce:node": size}) is None  # not in the table


def _zero_one_sent(n: int, **schedule) -> list[str]:
    """What ``sx.optim.zero_one_adam`` did on each of n steps, at world size
    1: ``none`` where a local step left its learning rates summed, ``psum``
    where the variance changed, ``onebit`` otherwise."""
    mesh = sx.Mesh({"dp": 1})
    opt = sx.optim.zero_one_adam(0.1, **schedule)
    params = {"w": sx.shard(torch.ones(3), mesh, sx.P())}
    state, out = opt.init(params), []
    torch.manual_seed(0)
    for _ in range(n):
        grad = sx.Sharded(torch.randn(3), sx.Layout(mesh, sx.P(), partial="dp"), (3,))
        nu = state.nu["w"].local.clone()
        updates, state = opt.update({"w": grad}, state, params)
        params = sx.optim.apply_updates(params, updates)
        if float(state.lrs) > 0:
            out.append("none")
        else:
            out.append("psum" if not torch.equal(nu, state.nu["w"].local) else "onebit")
    return out


@pytest.mark.parametrize(
    "schedule",
    [
        comm.ZERO_ONE,
        {"var_freeze_step": 30, "var_update_scaler": 2, "local_step_scaler": 3,
         "local_step_clipper": 8},
    ],
)  # fmt: skip
def test_the_zero_one_schedule_is_the_optimizers(schedule):
    """The benchmark's account of 0/1 Adam's steps (DeepSpeed's counters on
    ``ds = t + 1``) is what the optimizer does, the variance's doubling
    interval and the local interval's included."""
    assert comm.zero_one_adam_sends(80, **schedule) == _zero_one_sent(80, **schedule)


def test_the_timed_steps_of_zero_one_adam():
    """With ``ZERO_ONE``, the default run's timed steps (3..7) are after the
    freeze and sync twice; the smoke's (2..4) send each kind once."""
    sends = comm.SENDS["zero-one-adam"](15)
    assert sends[:2] == ["psum", "psum"]  # the variance's steps
    assert sends[2:] == ["onebit", "none", "none", "none"] * 3 + ["onebit"]  # H = 4 (1, 2 first)
    assert sends[2:7] == ["onebit", "none", "none", "none", "onebit"]  # --warmup 2 --steps 5
    assert sends[1:4] == ["psum", "onebit", "none"]  # --smoke: --warmup 1 --steps 3
    assert comm.SENDS["onebit-adam"](4) == ["psum", "psum", "onebit", "onebit"]


def _schedule_traffic(stats: dict, steps: int) -> dict[str, dict[str, float]]:
    """What the 1-bit layouts' traffic logs should say per step, by their
    ``sends``: each ``psum`` step ``zero0``'s gradient all-reduce, each
    ``onebit`` step one of ``onebit-adam``'s 1-bit averages, ``none``
    nothing, every step the loss's pmean."""
    one = stats["onebit-adam"]
    averages = one["sends"].count("onebit")
    onebit = {op: one["traffic_bytes"][op] * steps / averages
              for op in ("all_to_all:dp", "all_gather:dp")}  # fmt: skip
    zero0 = stats["zero0"]["traffic_bytes"]
    per_kind = {"psum": {"psum:dp": zero0["psum:dp"]}, "onebit": onebit, "none": {}}
    out = {}
    for name in comm.SENDS:
        expected = collections.Counter({"pmean:dp": zero0["pmean:dp"]})
        assert len(stats[name]["sends"]) == steps, name
        for kind in stats[name]["sends"]:
            for op, size in per_kind[kind].items():
                expected[op] += size / steps
        out[name] = dict(expected)
    return out


@pytest.mark.skipif(WHY is not None, reason=f"no emulated cluster here: {WHY}")
def test_comm_benchmark_smoke(tmp_path):
    out = tmp_path / "comm.json"
    header, rows, summary = run_benchmark("comm.py", "--smoke", "--json", str(out), timeout=300)
    assert header["benchmark"] == "comm" and header["speeds"] == ["1gbit"]
    assert header["nodes"] == header["nproc_per_node"] == 2 and header["repeats"] == 1
    assert header["model"]["params"] > 0
    speed = "1gbit"
    by_layout = {r["layout"]: r for r in rows}
    assert len(rows) == len(by_layout) == len(comm.ALL_LAYOUTS)  # one row per layout and speed
    assert set(by_layout) == set(comm.ALL_LAYOUTS) and all(r["speed"] == speed for r in rows)
    assert "failed" not in summary and "warning" not in summary, summary
    stats = summary["summary"][speed]
    tokens_per_step = header["tokens_per_step"]
    for name, r in by_layout.items():
        assert "error" not in r, r
        if "skipped" in r:  # DeepSpeed that could not start here: the reason, not a number
            assert name in comm.DEEPSPEED and r["skipped"].strip(), r
            assert summary["skipped"][name] == r["skipped"] and name not in stats
            assert "tokens_per_s" not in r
            continue
        assert r["bytes_across"] > 0 and r["bytes_across"] == max(r["bytes_across_per_node"])
        assert len(r["step_s_all"]) == header["steps"]
        assert r["tokens_per_s"] == pytest.approx(
            tokens_per_step * header["steps"] / sum(r["step_s_all"]), rel=1e-9
        )
        assert len(r["losses"]) == header["warmup"] + header["steps"]
        assert all(math.isfinite(v) for v in r["losses"]) and r["last_loss"] == r["losses"][-1]
        s = stats[name]  # one repeat: the medians are the row's
        assert s["repeats"] == 1 and s["bytes_across"] == r["bytes_across"]
        assert s["tokens_per_s"] == r["tokens_per_s"] and s["last_loss"] == r["last_loss"]
        assert s["tokens_per_s_vs_zero3"] == pytest.approx(
            r["tokens_per_s"] / by_layout["zero3"]["tokens_per_s"]
        )
        assert s["bytes_across_vs_zero3"] == pytest.approx(
            r["bytes_across"] / by_layout["zero3"]["bytes_across"]
        )
        assert r["traffic_bytes"], r  # what the ranks sent, by collective
        if name in comm.LAYOUTS:
            # what crossed is what the traffic log says should: at least that, and no more
            # than TCP/IP's headers (about 4 % of full frames) and the barriers around it
            formula = comm.across_formula(r["traffic_bytes"])
            assert formula and r["across_formula"] == pytest.approx(formula)
            assert formula <= r["bytes_across"] <= 1.1 * formula + 64 * 2**10, (name, r)
    traffic = {name: set(stats[name]["traffic_bytes"]) for name in comm.LAYOUTS}
    assert "all_gather:local" in traffic["zero3-hpz"] and "all_gather:local" in traffic["zeropp"]
    assert "psum_scatter:node,local" not in traffic["zeropp"] | traffic["zero3-qgz"]
    assert "all_gather:local" not in traffic["zero3"] | traffic["zero3-qwz"]
    assert {"psum:replicate", "all_gather:fsdp", "psum_scatter:fsdp"} <= traffic["hsdp"]
    across = {name: s["bytes_across"] for name, s in stats.items()}
    assert across["zero3-qwz-hpz"] < across["zero3-qwz"] < across["zero3"], across
    assert across["zero3-qwz-hpz"] < across["zero3-hpz"] < across["zero3"], across
    assert across["zeropp"] < across["zero3-qwz-hpz"] and across["zero3-qgz"] < across["zero3"]
    assert across["onebit-adam"] < across["zero0"], across
    assert across["zero-one-adam"] < across["onebit-adam"], across
    # each timed step sends what the 1-bit schedules say, a local step nothing
    assert "none" in stats["zero-one-adam"]["sends"]
    for name, expected in _schedule_traffic(stats, header["steps"]).items():
        assert stats[name]["traffic_bytes"] == pytest.approx(expected, rel=1e-9), name
    assert (
        "all_to_all:dp" in traffic["onebit-adam"] and "ragged_all_to_all:node" in traffic["zeropp"]
    )
    assert across["hsdp"] < across["zero3"], across
    assert across["zero3-persist"] < across["zero3"], across  # the tiny GPT: every leaf kept
    assert across["zero3-keep"] < across["zero3"], across  # no backward gathers
    assert stats["zero3-keep"]["traffic_bytes"]["all_gather:node,local"] == pytest.approx(
        stats["zero3"]["traffic_bytes"]["all_gather:node,local"] / 2
    )
    # the exact layouts start from the same weights and batch: the same first loss
    firsts = [s["first_loss"] for name, s in stats.items() if comm.exact(name)]
    assert max(firsts) - min(firsts) <= comm.EXACT_FIRST
    for name, anchor in comm.COUNTERPARTS.items():
        if anchor in stats:
            assert stats[name][f"tokens_per_s_vs_{anchor}"] == pytest.approx(
                stats[name]["tokens_per_s"] / stats[anchor]["tokens_per_s"]
            )
        else:
            assert f"tokens_per_s_vs_{anchor}" not in stats[name]
    if not HAS_DEEPSPEED:
        assert all("deepspeed is not installed" in summary["skipped"][m] for m in comm.DEEPSPEED)
    written = json.loads(out.read_text())
    assert written["summary"] == summary["summary"] and len(written["runs"]) == len(rows)


def test_the_committed_run_meets_the_goals():
    """``benchmarks/results/comm.json``: ZeRO++ with all three options is at
    least twice plain ZeRO-3's tokens/s where the link dominates (100mbit)
    and sends at most 0.15 of its bytes; every shardax layout sends what its
    formula says (within TCP/IP's headers); DeepSpeed's ZeRO++ and 1-bit
    Adam, which cannot start on CPU, carry the reason; no loss warning.
    Once the run has 0/1 Adam (:data:`PENDING` until then): it sends no
    more than 1-bit Adam, trains at least as fast as ZeRO-3 at 100mbit,
    its traffic is its schedule's, and DeepSpeed's carries the reason."""
    run = json.loads((ROOT / "benchmarks" / "results" / "comm.json").read_text())
    assert "warning" not in run and "failed" not in run
    slow = run["summary"]["100mbit"]
    assert slow["zeropp"]["tokens_per_s_vs_zero3"] >= 2.0
    assert slow["zeropp"]["bytes_across_vs_zero3"] <= 0.15
    assert slow["onebit-adam"]["bytes_across"] <= 0.1 * slow["zero0"]["bytes_across"]
    ran = set(run["layouts"])
    assert set(comm.LAYOUTS) - PENDING <= ran, "a rerun is missing layouts"
    for speed in run["speeds"]:
        for name in comm.LAYOUTS:
            if name not in ran:  # pending: the run predates it
                continue
            assert 1.0 <= run["summary"][speed][name]["across_vs_formula"] <= 1.1, (speed, name)
    assert {"deepspeed-zeropp", "deepspeed-onebit-adam"} <= set(run["skipped"])
    assert all(reason.strip() for reason in run["skipped"].values())
    if "zero-one-adam" in ran:
        assert slow["zero-one-adam"]["bytes_across"] <= slow["onebit-adam"]["bytes_across"]
        assert slow["zero-one-adam"]["tokens_per_s"] >= slow["zero3"]["tokens_per_s"]
        assert "deepspeed-zero-one-adam" in run["skipped"]
        for speed in run["speeds"]:
            stats = run["summary"][speed]
            for name, expected in _schedule_traffic(stats, run["steps"]).items():
                assert stats[name]["traffic_bytes"] == pytest.approx(expected, rel=1e-9), name
