"""The planner against the runs: ``shardax plan``'s tokens/s and peak memory, measured (issue 36).

``sx.plan.predict`` says, for a run config, a model and a cluster, the
tokens/s and the per-rank peak memory of a training run. This benchmark
trains the example GPT (``examples/train_gpt.py``, fp32 AdamW, the
``bench`` preset by default: 23.2M parameters, 256 tokens a sequence, a
global batch of 8 sequences) on 2 ranks under several layouts, each given
to the example as a run config (``--config``), and writes, per layout, what
was measured next to what the planner predicts for the same run config on
the ``this-machine`` cluster:

- ``zero0`` … ``zero3``: ``parallel.zero`` over ``mesh: {dp: 2}``;
- ``tp2``: ``mesh: {dp: 1, tp: 2}``, ``parallel.tp`` (Megatron);
- ``pp2-1f1b``, ``pp2-gpipe``: ``mesh: {dp: 1, pp: 2}``, ``parallel.pp``
  with that ``pp_schedule`` over 4 micro-batches;
- ``zero3-remat``: ZeRO-3 with ``memory.remat: save_nothing``;
- ``zero3-opt-disk``: ZeRO-3 with ``memory.offload_opt: "disk:<dir>"``
  (``--offload-dir``, default ``$SHARDAX_BENCH_OFFLOAD_DIR`` or the
  temporary folder: put it on a local disk, not tmpfs).

The size is chosen so that a step is compute-bound yet short on a 2-core
host: one step of the bench GPT on 2 ranks of one thread each takes about
1.3 s under ZeRO-3 (2048 tokens), long enough that the launcher, the
per-step Python and the timer's resolution do not matter, short enough for
9 layouts × 3 repeats in about 10 minutes.

Every (layout, repeat) runs in fresh processes, ``python -m shardax launch
--nproc-per-node 2 examples/train_gpt.py --config FILE --steps N
--log-every 1 --out DIR``, with ``train.py``'s environment (one thread per
rank on this host, glibc's mmap threshold at 4 MiB), layouts interleaved
across repeats (A B C, A B C, …: the host is noisy). No evaluation and no
sample (``eval_batches: 0``, ``sample_tokens: 0``); the one checkpoint the
example writes at the end is outside what is measured. A run's measured
tokens/s is the median of the per-step tokens/s in the example's
``loss.csv`` after ``--warmup`` steps; its peak RSS is the ``step`` phase of
the example's last line (``peak RSS per rank (MiB, the most of any rank):
init …, step …``): the training steady state, the most of any rank. Every
phase is kept in the row. So is how busy the host was: the 1-minute load
average before and after, and the run's CPU pressure (the share of its
wall time in which some task waited for a core, from
``/proc/pressure/cpu``: near 0 when the ranks had the cores to
themselves); a layout's ``cpu_pressure`` (``cpu`` in the table) is its
worst counted run's. Runs under pressure are slower than the machine is:
with ``--max-pressure P`` a run above it is marked ``busy``, left out of
the medians and run again (``--retries``, 2 by default).

Per layout: medians over repeats and their spread ((max − min) / median),
the prediction (``predict_row``), the ratios predicted / measured, and over
the layouts the Spearman rank correlation of predicted against measured
tokens/s. The acceptance criteria (``criteria``: every layout within
±25 % tokens/s and ±15 % peak RSS, Spearman ≥ 0.8) are evaluated into
``criteria_hold``; ``tests/test_plan_benchmark.py`` asserts them on the
committed ``benchmarks/results/plan.json``. Output: a JSON line for the
header, one per run, one for the summary; a table on stderr; ``--json``
writes everything into one file.

    python benchmarks/plan.py --repeats 3 --json benchmarks/results/plan.json
    python benchmarks/plan.py --layouts zero3,tp2 --repeats 1
    python benchmarks/plan.py --smoke        # tiny GPT, zero0 and zero3, 3 steps: seconds
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))  # this checkout's shardax, for the driver and (PYTHONPATH) ranks

from _data import model_facts, threads_per_rank  # noqa: E402  (beside this file)

CRITERIA = {"tokens_within": 0.25, "rss_within": 0.15, "spearman_min": 0.8}
"""Issue 36's acceptance: predicted / measured tokens/s within 1 ± 0.25 and
peak RSS within 1 ± 0.15 for every layout, and the layouts in the same
order (Spearman's rank correlation of tokens/s at least 0.8)."""
MIN_LAYOUTS = 8
SUMMARY_KEYS = (
    "summary", "spearman", "criteria", "criteria_hold", "failed", "busy_runs", "host", "wall_s",
)  # fmt: skip
"""The keys :func:`summarize` and the driver add after the runs."""
OFFLOAD = "<offload>"  # stands for the run's folder of optimizer state on disk

LAYOUTS: dict[str, dict[str, Any]] = {
    "zero0": {"mesh": {"dp": 2}, "parallel": {"zero": 0}},
    "zero1": {"mesh": {"dp": 2}, "parallel": {"zero": 1}},
    "zero2": {"mesh": {"dp": 2}, "parallel": {"zero": 2}},
    "zero3": {"mesh": {"dp": 2}, "parallel": {"zero": 3}},
    "tp2": {"mesh": {"dp": 1, "tp": 2}, "parallel": {"tp": "tp"}},
    "pp2-1f1b": {
        "mesh": {"dp": 1, "pp": 2},
        "parallel": {"pp": "pp", "pp_schedule": "1f1b", "pp_micro_batches": 4},
    },
    "pp2-gpipe": {
        "mesh": {"dp": 1, "pp": 2},
        "parallel": {"pp": "pp", "pp_schedule": "gpipe", "pp_micro_batches": 4},
    },
    "zero3-remat": {
        "mesh": {"dp": 2},
        "parallel": {"zero": 3},
        "memory": {"remat": "save_nothing"},
    },
    "zero3-opt-disk": {
        "mesh": {"dp": 2},
        "parallel": {"zero": 3},
        "memory": {"offload_opt": f"disk:{OFFLOAD}"},
    },
}
"""Each layout's part of the run config, over :data:`BASE`."""
SMOKE_LAYOUTS = ["zero0", "zero3"]

BASE: dict[str, Any] = {
    "optimizer": {
        "type": "adamw",
        "lr": 3e-3,
        "betas": [0.9, 0.95],
        "weight_decay": 0.1,
        "clip_global_norm": 1.0,
    },
    "schedule": {"type": "warmup_cosine", "warmup_steps": 1, "end_lr": 3e-4},
    "precision": {"params": "fp32"},
    "checkpoint": {"every": 0, "keep": 1, "async_save": False},
}
"""The run config every layout shares (the example's own defaults, written
out: with ``--config`` the example takes only what the file says)."""
EXAMPLE_OPTIONS = {"eval_batches": 0, "sample_tokens": 0, "progress": False}
"""The example's own options in every config file: nothing but training."""

PEAK_LINE = re.compile(r"peak RSS per rank \(MiB, the most of any rank\): (.*); peak in (\w+)")


# ---------------------------------------------------------------- layouts


def config_file_data(layout: str, args: argparse.Namespace, offload_dir: str) -> dict[str, Any]:
    """The ``--config`` file of ``layout``'s run: :data:`BASE` with the
    layout's sections over it, the global batch, and the example's options
    (the preset, no evaluation, no sample)."""
    data = copy.deepcopy(BASE)
    for key, value in LAYOUTS[layout].items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(copy.deepcopy(value))
        else:
            data[key] = value
    data["batch"] = {"global": args.batch}
    memory = data.get("memory", {})
    for key, value in memory.items():
        if isinstance(value, str):
            memory[key] = value.replace(OFFLOAD, offload_dir)
    return {**data, "preset": args.preset, **EXAMPLE_OPTIONS}


def example_argv(config: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The example's arguments for one run."""
    argv = ["--config", str(config), "--steps", str(args.steps), "--log-every", "1"]
    return [*argv, "--out", str(out)]


def example_run_config(layout: str, args: argparse.Namespace, offload_dir: str) -> Any:
    """The ``RunConfig`` the example makes of ``layout``'s file and flags
    (its own ``parse_args``): what the planner is given."""
    import train_gpt  # examples/, imported here only: it imports torch and shardax

    with tempfile.TemporaryDirectory(prefix="shardax-plan-bench-") as tmp:
        config = Path(tmp) / "run.json"
        config.write_text(json.dumps(config_file_data(layout, args, offload_dir)))
        return train_gpt.parse_args(example_argv(config, Path(tmp) / "out", args)).run


# ---------------------------------------------------------------- prediction


def predict_row(
    layout: str, cluster: Any, *, run: Any, preset: str, world_size: int
) -> dict[str, Any]:
    """What the planner predicts for ``layout``'s run config ``run`` (the
    example's, as it parsed it) on ``cluster``: tokens/s, step time, the
    most peak memory of any rank (MiB) and its breakdown."""
    import torch
    from gpt import GPT, PRESETS

    import shardax as sx

    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = GPT(cfg)
    est = sx.plan.predict(run, model, cluster, seq=cfg.seq_len, world_size=world_size)
    return {
        "layout": layout,
        "tokens_per_s": float(est.tokens_per_s),
        "step_s": float(est.step_time),
        "peak_rss_mib": float(est.peak_memory) / 2**20,
        "breakdown": est.breakdown(),
    }


# ---------------------------------------------------------------- measurement


def parse_peaks(output: str) -> dict[str, float]:
    """Each phase's peak RSS (MiB, the most of any rank) from the example's
    last line.

    >>> parse_peaks("[rank 0] peak RSS per rank (MiB, the most of any rank): "
    ...             "init 452, step 897, save 753; peak in step")
    {'init': 452.0, 'step': 897.0, 'save': 753.0}
    """
    found = PEAK_LINE.findall(output)
    if not found:
        return {}
    parts = (p.rsplit(" ", 1) for p in found[-1][0].split(", "))
    return {phase: float(value) for phase, value in parts}


def read_tokens_per_s(path: Path) -> list[float]:
    """Every step's tokens/s from the example's ``loss.csv``, in step order."""
    with path.open(newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["step"]))
    return [float(r["tokens_per_s"]) for r in rows]


def cpu_stall_s() -> float | None:
    """Seconds so far in which some runnable task waited for a CPU (Linux's
    pressure stall information, ``/proc/pressure/cpu``); None without it.
    Over a run, its increase per second of wall time is the run's CPU
    pressure: near 0 when the ranks had the cores to themselves."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def run_env(args: argparse.Namespace) -> dict[str, str]:
    """``train.py``'s environment: the cores shared out among the ranks,
    the mmap threshold ``sx.init()`` would set, this checkout importable."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_once(layout: str, repeat: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``layout`` on fresh ranks: its row."""
    row: dict[str, Any] = {"layout": layout, "repeat": repeat}
    offload_root = args.offload_dir or tempfile.gettempdir()
    with (
        tempfile.TemporaryDirectory(prefix="shardax-plan-bench-") as tmp,
        tempfile.TemporaryDirectory(prefix="shardax-plan-offload-", dir=offload_root) as offload,
    ):
        config, out = Path(tmp) / "run.json", Path(tmp) / "out"
        config.write_text(json.dumps(config_file_data(layout, args, offload)))
        argv = [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", str(args.nproc)]
        argv += ["--timeout", str(args.timeout), str(EXAMPLE)]
        argv += example_argv(config, out, args)
        started, stalled = time.perf_counter(), cpu_stall_s()
        row["loadavg_start"] = os.getloadavg()[0]
        try:
            done = subprocess.run(
                argv,
                cwd=ROOT,
                env=run_env(args),
                capture_output=True,
                text=True,
                timeout=args.timeout + 60,  # the launcher's own --timeout stops the ranks first
            )
        except subprocess.TimeoutExpired as err:
            row["error"] = f"no exit {args.timeout + 60:.0f} s after the start"
            row["output_tail"] = str(err.stdout or "")[-3000:]
            return row
        row["wall_s"] = time.perf_counter() - started
        row["loadavg_end"] = os.getloadavg()[0]
        if stalled is not None:
            row["cpu_pressure"] = (cpu_stall_s() - stalled) / row["wall_s"]
        loss_csv = out / "loss.csv"
        peaks = parse_peaks(done.stdout)
        if done.returncode != 0 or not loss_csv.is_file() or "step" not in peaks:
            row["error"] = f"exit code {done.returncode}" + (
                "" if "step" in peaks else "; no peak RSS line"
            )
            row["output_tail"] = (done.stdout + done.stderr)[-3000:]
            return row
        per_step = read_tokens_per_s(loss_csv)
    timed = per_step[args.warmup :]
    tokens_per_step = args.batch * args.seq_len
    row["tokens_per_s"] = statistics.median(timed)
    row["step_s"] = tokens_per_step / row["tokens_per_s"]
    row["peak_rss_mib"] = peaks["step"]
    row["peak_rss_phases_mib"] = peaks
    row["tokens_per_s_steps"] = per_step
    return row


def interleaved(layouts: Sequence[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every layout once per repeat, in order (A B C, A B C, …), each row
    printed as a JSON line as it comes. A run under more CPU pressure than
    ``--max-pressure`` (other jobs took the cores) is marked ``busy`` and
    run again, up to ``--retries`` times; the last try counts regardless."""
    rows = []
    for repeat in range(args.repeats):
        for layout in layouts:
            for attempt in range(args.retries + 1):
                rows.append(run_once(layout, repeat, args))
                pressure = rows[-1].get("cpu_pressure")
                busy = args.max_pressure is not None and pressure is not None
                busy = busy and pressure > args.max_pressure and attempt < args.retries
                if busy:
                    rows[-1]["busy"] = True
                print(json.dumps(rows[-1]), flush=True)
                if not busy:
                    break
    return rows


# ---------------------------------------------------------------- statistics


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``, ties sharing the mean of their ranks.

    >>> average_ranks([10.0, 30.0, 20.0, 30.0])
    [1.0, 3.5, 2.0, 3.5]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation of ``x`` and ``y``: the Pearson
    correlation of their average ranks (so ties count half-way); None
    where it is undefined (fewer than 2 pairs, or all of one side equal).

    >>> spearman([1, 2, 3], [10, 20, 30]), spearman([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    """
    if len(x) != len(y):
        raise ValueError(f"spearman needs pairs: {len(x)} values against {len(y)}")
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = math.fsum((a - mx) ** 2 for a in rx)
    syy = math.fsum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def spread(values: Sequence[float]) -> float:
    """(max − min) / median: how far the repeats of one layout disagree."""
    return (max(values) - min(values)) / statistics.median(values)


def summarize(
    rows: list[dict[str, Any]], layouts: Sequence[str], predicted: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Per layout, medians over repeats, the prediction and the ratios;
    Spearman over the layouts; the criteria and whether each holds (None
    where nothing was predicted)."""
    per_layout: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        ok = [r for r in rows if r["layout"] == layout and "error" not in r and "busy" not in r]
        if not ok:
            continue
        tokens = [r["tokens_per_s"] for r in ok]
        rss = [r["peak_rss_mib"] for r in ok]
        phases = sorted({p for r in ok for p in r["peak_rss_phases_mib"]})
        stats: dict[str, Any] = {
            "tokens_per_s": statistics.median(tokens),
            "tokens_per_s_spread": spread(tokens),
            "step_s": statistics.median(r["step_s"] for r in ok),
            "peak_rss_mib": statistics.median(rss),
            "peak_rss_spread": spread(rss),
            "peak_rss_phases_mib": {
                p: statistics.median(
                    r["peak_rss_phases_mib"][p] for r in ok if p in r["peak_rss_phases_mib"]
                )
                for p in phases
            },
            "repeats": len(ok),
            "cpu_pressure": max(
                (r["cpu_pressure"] for r in ok if "cpu_pressure" in r), default=None
            ),
            "predicted": predicted.get(layout),
        }
        if layout in predicted:
            pred = predicted[layout]
            stats["tokens_ratio"] = pred["tokens_per_s"] / stats["tokens_per_s"]
            stats["rss_ratio"] = pred["peak_rss_mib"] / stats["peak_rss_mib"]
        per_layout[layout] = stats
    compared = [s for s in per_layout.values() if "tokens_ratio" in s]
    rho = None
    if compared:
        rho = spearman(
            [s["predicted"]["tokens_per_s"] for s in compared],
            [s["tokens_per_s"] for s in compared],
        )
    holds: dict[str, bool | None] = {"tokens": None, "rss": None, "spearman": None}
    if compared and len(compared) == len(per_layout):
        holds["tokens"] = all(
            abs(s["tokens_ratio"] - 1) <= CRITERIA["tokens_within"] for s in compared
        )
        holds["rss"] = all(abs(s["rss_ratio"] - 1) <= CRITERIA["rss_within"] for s in compared)
        holds["spearman"] = rho is not None and rho >= CRITERIA["spearman_min"]
    holds["layouts"] = len(compared) >= MIN_LAYOUTS
    summary: dict[str, Any] = {
        "summary": per_layout,
        "spearman": rho,
        "criteria": CRITERIA,
        "criteria_hold": holds,
    }
    failed = sorted({r["layout"] for r in rows if "error" in r})
    if failed:
        summary["failed"] = failed
    busy = [r["layout"] for r in rows if "busy" in r]
    if busy:
        summary["busy_runs"] = busy  # run again: not in the medians
    return summary


def print_table(summary: dict[str, Any], file=sys.stderr) -> None:
    """The summary, readable."""
    head = f"{'layout':<16}{'tokens/s':>10}{'spread':>8}{'step ms':>9}{'step MiB':>10}"
    head += f"{'spread':>8}{'cpu':>6}{'pred tok/s':>12}{'ratio':>7}{'pred MiB':>10}{'ratio':>7}"
    print(head, file=file)
    for layout, s in summary["summary"].items():
        line = f"{layout:<16}{s['tokens_per_s']:>10.0f}{s['tokens_per_s_spread']:>8.1%}"
        line += f"{s['step_s'] * 1e3:>9.0f}{s['peak_rss_mib']:>10.0f}{s['peak_rss_spread']:>8.1%}"
        cpu = s["cpu_pressure"]
        line += f"{'-' if cpu is None else f'{cpu:.0%}':>6}"
        if s["predicted"] is not None:
            p = s["predicted"]
            line += f"{p['tokens_per_s']:>12.0f}{s['tokens_ratio']:>7.2f}"
            line += f"{p['peak_rss_mib']:>10.0f}{s['rss_ratio']:>7.2f}"
        print(line, file=file)
    rho = summary["spearman"]
    print(
        f"spearman {'-' if rho is None else f'{rho:.3f}'}; criteria {summary['criteria']}; "
        f"hold: {summary['criteria_hold']}",
        file=file,
    )
    if summary.get("failed"):
        print(f"FAILED: {', '.join(summary['failed'])}", file=file)


# ---------------------------------------------------------------- the driver


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layouts", help=f"comma list (default: all): {','.join(LAYOUTS)}")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--preset", default="bench", help="the example's model size")
    parser.add_argument("--batch", type=int, default=8, help="global batch, sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--repeats", type=int, default=3, help="runs per layout, interleaved")
    parser.add_argument(
        "--cluster", help="the planner's cluster (default: this-machine:NPROC, measured now)"
    )
    parser.add_argument(
        "--offload-dir",
        default=os.environ.get("SHARDAX_BENCH_OFFLOAD_DIR"),
        help="where zero3-opt-disk's state goes (default: $SHARDAX_BENCH_OFFLOAD_DIR or the "
        "temporary folder; a local disk, not tmpfs)",
    )
    parser.add_argument(
        "--max-pressure",
        type=float,
        help="run again a run whose CPU pressure (the share of its time some task waited for a "
        "core, /proc/pressure/cpu) is above this, e.g. 0.2: other jobs slowed it (default: off)",
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="tries more per run with --max-pressure"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", help="also write the header, every row and the summary here")
    parser.add_argument(
        "--predict",
        metavar="FROM",
        help="measure nothing: predict the layouts of an earlier --json anew and summarise its "
        "runs again (the planner changed; the cluster is measured now)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny GPT, zero0 and zero3, 3 steps, 1 repeat"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.steps, args.warmup, args.repeats = "tiny", 3, 1, 1
        args.layouts = args.layouts or ",".join(SMOKE_LAYOUTS)
    args.layouts = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; the layouts: {','.join(LAYOUTS)}")
    if args.retries < 0:
        parser.error("--retries must be at least 0")
    for name in ["nproc", "batch", "steps", "repeats"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps={args.steps})")
    args.cluster_given = args.cluster
    args.cluster = args.cluster or f"this-machine:{args.nproc}"
    args.threads = threads_per_rank(args.nproc)
    return args


def host_facts() -> dict[str, Any]:
    """What the numbers depend on, and how busy the host was."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": cores,
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
    }


def predictions(
    runs: dict[str, Any], args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The cluster (measured now) and each layout's prediction: the
    header's cluster fields, and the predictions by layout."""
    import shardax as sx

    started, stalled = time.perf_counter(), cpu_stall_s()
    cluster = sx.plan.Cluster.load(args.cluster)
    fields = {
        "cluster_spec": args.cluster,
        "cluster": cluster.to_dict(),
        "cluster_s": time.perf_counter() - started,
        "cluster_cpu_pressure": None,  # the measurement of the machine is as noisy as the runs
    }
    if stalled is not None:
        fields["cluster_cpu_pressure"] = (cpu_stall_s() - stalled) / fields["cluster_s"]
    predicted = {
        name: predict_row(name, cluster, run=run, preset=args.preset, world_size=args.nproc)
        for name, run in runs.items()
    }
    return fields, predicted


def repredict(args: argparse.Namespace) -> int:
    """``--predict FROM``: the runs of an earlier measurement, predicted
    anew (a changed planner, the cluster measured now), summarised again."""
    import shardax as sx

    result = json.loads(Path(args.predict).read_text())
    args.preset, args.nproc = result["preset"], result["nproc"]
    args.cluster = args.cluster_given or f"this-machine:{args.nproc}"
    runs = {
        name: sx.config.RunConfig.from_dict(data, f"{args.predict}: {name}")
        for name, data in result["run_configs"].items()
    }
    fields, predicted = predictions(runs, args)
    header = {k: v for k, v in result.items() if k not in ("runs", *SUMMARY_KEYS)}
    header.update(fields, predicted_from=args.predict)
    summary = summarize(result["runs"], result["layouts"], predicted)
    summary["host"], summary["wall_s"] = result["host"], result["wall_s"]
    print(json.dumps(header), flush=True)
    print(json.dumps(summary), flush=True)
    print_table(summary)
    if args.json:
        write_json(Path(args.json), {**header, "runs": result["runs"], **summary})
    return 1 if summary.get("failed") else 0


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.predict:
        return repredict(args)
    import torch  # after parse_args: --help stays quick
    from gpt import PRESETS, param_count

    if args.preset not in PRESETS:
        print(f"unknown preset {args.preset!r}; the presets: {sorted(PRESETS)}", file=sys.stderr)
        return 2
    cfg = PRESETS[args.preset]
    args.seq_len = cfg.seq_len
    started = time.perf_counter()
    host = {**host_facts(), "loadavg_start": list(os.getloadavg())}
    offload_root = args.offload_dir or tempfile.gettempdir()
    runs = {name: example_run_config(name, args, offload_root) for name in args.layouts}
    fields, predicted = predictions(runs, args)
    header = {
        "benchmark": "plan",
        "preset": args.preset,
        "model": model_facts(cfg, param_count(cfg)),
        "nproc": args.nproc,
        "global_batch": args.batch,
        "tokens_per_step": args.batch * cfg.seq_len,
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "layouts": args.layouts,
        "run_configs": {name: run.to_dict() for name, run in runs.items()},
        **fields,
        "offload_dir": offload_root,
    }
    print(json.dumps(header), flush=True)
    rows = interleaved(args.layouts, args)
    summary = summarize(rows, args.layouts, predicted)
    summary["host"] = {**host, "loadavg_end": list(os.getloadavg())}
    summary["wall_s"] = time.perf_counter() - started
    print(json.dumps(summary), flush=True)
    print_table(summary)
    if args.json:
        write_json(Path(args.json), {**header, "runs": rows, **summary})
    return 1 if summary.get("failed") or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
