"""``shardax launch --elastic MIN:MAX``: a lost rank's slot (and its host
memory) goes, the job restarts on the ranks that remain, ranks see the new
world; misuse is refused by name; nothing is left behind — no process, no
``/dev/shm`` folder — however the launcher ends.

The default run uses small scripts without torch (``scripts/elastic_rank.py``)
and one short torch job whose in-memory checkpoint survives a SIGKILLed
rank. The slow run trains ``examples/train_gpt.py`` on 4 ranks, kills one
mid-step, and checks that the loss curve after the restart on 3 equals an
uninterrupted run's resumed from the same step on 3 — from a disk
checkpoint and from host memory — and, on two emulated nodes of 2 ranks
(network namespaces, root), that losing a node continues on the other's 2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import shardax as sx
from shardax.errors import LaunchError
from shardax.launch._cli import launch_command
from shardax.launch._elastic import check_elastic, describe_lost, lost_ranks, parse_elastic
from shardax.launch._emulated import EmulatedCluster, unavailable
from shardax.launch._memory import SHM

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
RANK = str(SCRIPTS / "elastic_rank.py")
LIGHT = [sys.executable, str(SCRIPTS / "light_cli.py")]
TIMEOUT_S = 120.0


def _launch(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SHARDAX_MEMORY_DIR"}
    return subprocess.run(
        [*LIGHT, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def _seen(stdout: str) -> list[dict]:
    return [
        json.loads(line.split("SEEN ", 1)[1]) for line in stdout.splitlines() if "SEEN " in line
    ]


def _shm() -> set[str]:
    """What shardax keeps in /dev/shm now (host memory folders, segments)."""
    return (
        {p.name for p in SHM.iterdir() if p.name.startswith("shardax")} if SHM.is_dir() else set()
    )


# --- the rules, as pure functions --------------------------------------------------------


def test_what_loses_a_slot():
    peer = ["Traceback (most recent call last):", "RuntimeError: Connection reset by peer"]
    timed_out = ["shardax.errors.CollectiveTimeoutError: psum over dp ... did not arrive: [3]"]
    own = ["Traceback (most recent call last):", "ValueError: boom"]
    assert lost_ranks([(3, -9)], {}) == (3,)  # killed by a signal: lost
    assert lost_ranks([(3, -11), (0, 1)], {0: peer}) == (3,)  # rank 0 failed because of 3
    assert lost_ranks([(1, 1), (2, 1)], {1: own, 2: timed_out}) == (1,)
    assert lost_ranks([(2, 3)], {2: ["fatal: no shard 3"]}) == (2,)  # no traceback: its own
    assert lost_ranks([(0, 1)], {0: peer}) == ()
    assert lost_ranks([(3, -9), (0, -6)], {0: peer}) == (3,)  # aborted in teardown, after a peer
    assert describe_lost([(0, 1), (3, -9)], (3,)) == "rank 3 was lost (killed by SIGKILL)"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3:2", "MIN 3 is more than MAX 2"),
        ("0:2", "MIN must be at least 1, got 0"),
        ("two", "write MIN:MAX"),
        ("2-4", "write MIN:MAX"),
    ],
)
def test_bad_bounds_are_refused_by_name(value, message):
    with pytest.raises(LaunchError, match=message):
        parse_elastic(value)


def test_elastic_misuse_is_refused_by_name(tmp_path):
    assert check_elastic((2, 4), 4, 1) == parse_elastic("2:4")
    with pytest.raises(LaunchError, match=r"MAX is the number of ranks the job starts, which is 4"):
        check_elastic("2:8", 4, 1)
    with pytest.raises(LaunchError, match="give --max-restarts N"):
        check_elastic("2:4", 4, 0)
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=2\nb slots=2\n")
    runner = CliRunner()
    cases = {
        ("--elastic", "2:4", "--nproc-per-node", "3", "--max-restarts", "1"): "which is 3",
        ("--elastic", "2:4", "--nproc-per-node", "4"): "give --max-restarts N",
        ("--elastic", "5:4", "--nproc-per-node", "4", "--max-restarts", "1"): "MIN 5 is more",
        (
            "--elastic",
            "2:4",
            "--max-restarts",
            "1",
            "--hostfile",
            str(hosts),
            "--launcher",
            "ssh",
        ): "start one per node with --launcher none --elastic",
    }
    for args, message in cases.items():
        result = runner.invoke(launch_command, [*args, str(script)])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


# --- the launcher, with ranks that need no torch ---------------------------------------


def test_a_killed_rank_loses_its_slot_and_the_job_goes_on_with_the_rest():
    before = _shm()
    done = _launch("--nproc-per-node", "4", "--elastic", "2:4", "--max-restarts", "2",
                   RANK, "2", "sigkill")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (
        "shardax launch: rank 2 was lost (killed by SIGKILL); restarting on 3 rank(s) (restart 1 "
        "of 2, --elastic 2:4; slots 0,1,3 of 0-3)" in done.stderr
    )
    seen = _seen(done.stdout)
    first = sorted((s["rank"], s["world"]) for s in seen if s["restart"] == 0)
    second = sorted((s["rank"], s["world"], Path(s["memory"]).name, tuple(s["slots"]))
                    for s in seen if s["restart"] == 1)  # fmt: skip
    # the ranks of try 0 that printed before rank 2 died (the others may have been stopped first)
    assert (2, 4) in first and set(first) <= {(r, 4) for r in range(4)}
    left = ("slot-000", "slot-001", "slot-003")  # slot 2's host memory went with it
    assert second == [(r, 3, left[r], left) for r in range(3)]
    assert {s["elastic"] for s in seen} == {"2:4"}
    assert not Path(seen[0]["memory"]).parent.exists()  # the launcher removed its host memory
    assert _shm() <= before
    for s in seen:  # no rank outlives the launcher
        assert not Path(f"/proc/{s['pid']}").exists() or _zombie(s["pid"])


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_rank_that_failed_because_a_peer_went_away_keeps_its_slot():
    done = _launch("--nproc-per-node", "3", "--elastic", "1:3", "--max-restarts", "1",
                   RANK, "1", "peer")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rank 1 failed (exit code 1) because a peer went away: no slot was lost" in done.stderr
    assert "restarting on 3 rank(s)" in done.stderr
    assert sorted(s["world"] for s in _seen(done.stdout) if s["restart"] == 1) == [3, 3, 3]


def test_an_error_of_its_own_loses_the_slot_and_too_few_left_stops_the_job():
    done = _launch("--nproc-per-node", "3", "--elastic", "2:3", "--max-restarts", "3",
                   RANK, "0", "error", "2")  # fmt: skip
    # try 0: rank 0 raises (lost) -> 2 ranks; try 1: the new rank 0 raises -> 1 < MIN 2
    assert done.returncode == 1, done.stderr
    assert "rank 0 was lost (exit code 1); restarting on 2 rank(s)" in done.stderr
    assert (
        "rank 0 was lost (exit code 1); 1 rank(s) remain, fewer than --elastic 2:3's minimum of "
        "2: the job stopped" in done.stderr
    )
    assert "ValueError: rank 0: boom" in done.stderr  # the lost rank's traceback, each time


def test_without_elastic_restarts_keep_every_slot_and_their_host_memory():
    done = _launch("--nproc-per-node", "2", "--max-restarts", "1", RANK, "1", "sigkill")
    assert done.returncode == 0, done.stderr
    assert "restarting every rank (restart 1 of 1) because rank 1 failed" in done.stderr
    seen = [(s["restart"], s["rank"], Path(s["memory"]).name) for s in _seen(done.stdout)]
    assert sorted(x for x in seen if x[0] == 1) == [(1, 0, "slot-000"), (1, 1, "slot-001")]
    assert (0, 1, "slot-001") in seen  # try 0's rank 0 may have been stopped before it printed
    assert {s["elastic"] for s in _seen(done.stdout)} == {None}


def test_a_killed_launcher_leaves_no_host_memory_and_no_rank():
    proc = subprocess.Popen(
        [*LIGHT, "--nproc-per-node", "2", "--elastic", "1:2", "--max-restarts", "1", RANK, ""],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        lines = (line for line in proc.stdout if "SEEN " in line)  # both ranks up: an event
        seen = [json.loads(next(lines).split("SEEN ", 1)[1]) for _ in range(2)]
        root = Path(seen[0]["memory"]).parent
        assert root.is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S)
        deadline = time.monotonic() + 30  # a bound on the guard's work, not a guess at it
        while (root.exists() or not all(_zombie(s["pid"]) for s in seen)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert not root.exists(), root
        assert all(_zombie(s["pid"]) for s in seen)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


# --- a torch job whose in-memory checkpoint survives a killed rank --------------------

JOB = textwrap.dedent(
    """
    import json, os, signal, torch, shardax as sx
    sx.init(timeout=60)
    mesh = sx.Mesh({"dp": -1})
    memory = sx.ckpt.MemoryCheckpointManager(every=1)
    target = {"w": sx.shard(torch.zeros(12, 2), mesh, sx.P("dp")), "step": 0}
    found = memory.latest()
    if found is None:
        state = {"w": sx.shard(torch.arange(24.0).reshape(12, 2), mesh, sx.P("dp")), "step": 0}
    else:
        _, state = memory.restore(target)
    for step in range(state["step"] + 1, 5):
        state = {"w": state["w"].with_local(state["w"].local + 1), "step": step}
        memory.save(step, state)
        if step == 2 and mesh.rank == 2 and os.environ["SHARDAX_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # lost after its snapshot of step 2
    whole = sx.gather(state["w"])
    print("RESULT", json.dumps({"rank": mesh.rank, "world": mesh.world_size, "found":
          None if found is None else [found.step, found.world_size, list(found.from_peers)],
          "w": whole.flatten().tolist()}), flush=True)
    sx.shutdown()
    """
)


def test_in_memory_checkpoints_survive_a_killed_rank(tmp_path):
    """3 ranks snapshot every step; rank 2 is SIGKILLed after step 2's
    snapshot. The job restarts on 2: rank 2's slot is gone, so its shards
    come from its peer's copy (rank 0's slot), and the run ends with the
    values an uninterrupted run has."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    before = _shm()
    done = subprocess.run(
        [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", "3", "--elastic", "2:3",
         "--max-restarts", "1", str(script)],
        capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 2 was lost (killed by SIGKILL); restarting on 2 rank(s)" in done.stderr
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines()
            if "RESULT " in line]  # fmt: skip
    assert sorted(r["rank"] for r in rows) == [0, 1] and {r["world"] for r in rows} == {2}
    assert all(r["found"] == [2, 3, [2]] for r in rows), rows  # step 2, saved by 3, 2 from a peer
    expected = [v + 4.0 for v in range(24)]  # 4 steps of +1, whatever ranks made them
    assert all(r["w"] == expected for r in rows)
    assert _shm() <= before


# --- the training example, killed mid-step (slow) ---------------------------------------

TRAIN = ["examples/train_gpt.py", "--preset", "tiny", "--steps", "8", "--log-every", "1",
         "--eval-batches", "0", "--sample-tokens", "0", "--keep", "10"]  # fmt: skip
# 12 sequences a step: micro 1 x accumulation 3 on 4 ranks, 4 on 3, 6 on 2
BATCH = "batch: {global: 12, micro: 1}\nmesh: {dp: -1}\n"


def _metrics(path: Path, killed: int = 6) -> list[list[dict]]:
    """The metrics lines of the try before the kill (steps 1 .. ``killed`` -
    1) and those of the try after it."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [rows[: killed - 1], rows[killed - 1 :]]


def _config(tmp_path: Path, extra: str = "") -> Path:
    config = tmp_path / "run.hjson"
    config.write_text(BATCH + extra)
    return config


def _resume_from(stdout: str) -> int:
    line = next(ln for ln in stdout.splitlines() if "resumed from" in ln)
    return int(line.split(" at step ")[1].split()[0].rstrip(";"))


def _reference(tmp_path: Path, checkpoint: Path, nproc: int, config: Path) -> list[dict]:
    """An uninterrupted run resumed from ``checkpoint`` on ``nproc`` ranks."""
    out, metrics = tmp_path / "reference", tmp_path / "reference.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", str(nproc), *TRAIN,
         "--config", str(config), "--out", str(out), "--metrics", str(metrics),
         "--resume", str(checkpoint)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _same_curve(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):  # the same ranks, batch split and order: 1e-5
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


def _check_left_nothing(out: Path, before: set[str]) -> None:
    for step in sorted(out.glob("step-*")):
        assert sx.ckpt.verify(step) == [], step  # no checkpoint on disk is corrupted
    assert _shm() <= before
    stray = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
    assert not stray.strip(), stray  # no orphan rank


@pytest.mark.slow
@pytest.mark.parametrize("where", ["disk", "memory"])
def test_train_gpt_goes_on_after_a_rank_is_killed_mid_step(tmp_path, where):
    """4 ranks; rank 3 SIGKILLs itself in step 6, after its gradients.
    Disk: checkpoints every 2 steps, in the background, so the restart
    resumes from step 2 or 4 — whichever was committed. Memory: a snapshot
    every step, so the restart resumes from step 5 in host memory, rank 3's
    shards rebuilt from its peer's copy (its own slot is gone); a disk save
    of every step, synchronous, keeps that state on disk for the reference.
    Either way the loss curve on 3 ranks equals an uninterrupted run's
    resumed from the same checkpoint on 3."""
    before = _shm()
    out, metrics = tmp_path / "run", tmp_path / "run.jsonl"
    if where == "disk":
        config, saving = _config(tmp_path), ["--save-every", "2"]
    else:
        config = _config(tmp_path, "checkpoint: {async_save: false}\n")
        saving = ["--save-every", "1", "--memory-ckpt-every", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", "4", "--elastic", "3:4",
         "--max-restarts", "1", *TRAIN, "--config", str(config), "--out", str(out),
         "--metrics", str(metrics), "--elastic", "--kill-at", "6:3", *saving],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 3 was lost (killed by SIGKILL); restarting on 3 rank(s)" in done.stderr
    start = _resume_from(done.stdout)
    tries = _metrics(metrics)
    assert [r["step"] for r in tries[0]] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in tries[1]] == list(range(start + 1, 9))
    if where == "memory":
        assert start == 5 and "resumed from host memory at step 5" in done.stdout
        assert "the shards of rank(s) [3] rebuilt from their peers' copies" in done.stdout
    else:
        assert start in (2, 4) and f"resumed from {out / f'step-{start:08d}'}" in done.stdout
    checkpoint = tmp_path / "saved"  # the state at that step, as the run saved it on disk
    shutil.copytree(out / f"step-{start:08d}", checkpoint)
    assert "global batch 12 x 64 tokens in 4 micro-steps" in done.stdout  # 1 x 4 x 3 ranks
    _same_curve(tries[1], _reference(tmp_path, checkpoint, 3, config))
    _check_left_nothing(out, before)


@pytest.mark.slow
@pytest.mark.skipif(unavailable() is not None, reason=f"emulated nodes: {unavailable()}")
@pytest.mark.parametrize("where", ["disk", "memory"])
def test_losing_a_node_of_two_ranks_goes_on_with_the_other_two(tmp_path, where):
    """2 + 2 ranks on two emulated nodes; in step 6 rank 3 kills its node's
    launcher and itself: node 1 is lost. Node 0's launcher waits for node 1
    (--rejoin-timeout), then restarts alone on its 2 ranks, resuming from
    disk (node 1's files are on the shared disk) or from host memory (node
    1's shards from the copies node 0's ranks keep); the curve equals an
    uninterrupted run's resumed there on 2 ranks."""
    before = _shm()
    out, metrics = tmp_path / "run", tmp_path / "run.jsonl"
    config = _config(tmp_path, "checkpoint: {async_save: false}\n")
    saving = ["--save-every", "2"] if where == "disk" else ["--save-every", "1",
                                                             "--memory-ckpt-every", "1"]  # fmt: skip
    argv = ["--elastic", "2:4", "--max-restarts", "1", "--rejoin-timeout", "5",
            *TRAIN, "--config", str(config), "--out", str(out), "--metrics", str(metrics),
            "--elastic", "--kill-at", "6:3", "--kill-node", *saving]  # fmt: skip
    with EmulatedCluster("1gbit") as cluster:
        node0, node1 = cluster.launch(argv, nproc_per_node=2, env={"SHARDAX_TIMEOUT": "60"},
                                      timeout=600)  # fmt: skip
    assert node1.returncode == -signal.SIGKILL, node1.stdout + node1.stderr
    assert node0.returncode == 0, node0.stdout + node0.stderr
    assert "node 0 rejoins with 2 rank(s)" in node0.stderr
    assert "node(s) [1] did not rejoin within 5 s: lost; going on with 2 rank(s)" in node0.stderr
    start = _resume_from(node0.stdout)
    tries = _metrics(metrics)
    assert [r["step"] for r in tries[1]] == list(range(start + 1, 9))
    if where == "memory":  # a snapshot every step: step 5; node 1's ranks from their peers
        assert start == 5 and "resumed from host memory at step 5" in node0.stdout
        assert "the shards of rank(s) [2, 3] rebuilt from their peers' copies" in node0.stdout
    else:
        assert start == 4 and f"resumed from {out / 'step-00000004'}" in node0.stdout
    # the checkpoint at that step (synchronous saves): what the reference resumes from
    checkpoint = tmp_path / "saved"
    shutil.copytree(out / f"step-{start:08d}", checkpoint)
    _same_curve(tries[1], _reference(tmp_path, checkpoint, 2, config))
    _check_left_nothing(out, before)


@pytest.mark.slow
def test_elastic_benchmark_smoke(tmp_path):
    out = tmp_path / "elastic.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/elastic.py", "--smoke", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["benchmark"] == "elastic" and result["nproc"] == 2
    rows = {r["checkpoint"]: r for r in result["rows"]}
    assert rows["memory"]["resumed_from"] == "memory" and rows["memory"]["steps_lost"] == 0
    assert rows["disk"]["resumed_from"] == "disk" or rows["disk"]["resumed_step"] == 0
    for row in rows.values():
        assert 0 < row["kill_to_restart_s"] < row["kill_to_first_step_s"]
        assert 0 <= row["steps_lost"] <= result["kill_step"] - 1
