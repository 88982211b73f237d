"""Multi-node ``shardax launch``: two node launchers on loopback form one
world; a rank killed on one node stops both; the commands ssh, pdsh, srun
and mpirun would run (``--dry-run``) for hostfiles with include/exclude and
for a Slurm allocation; node detection from Slurm and MPI environments;
restarts; environment propagation; device slots."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardax.errors import LaunchError
from shardax.launch import free_port
from shardax.launch._emulated import wait_all
from shardax.launch._multinode import NodeCommand, NodeJob, node_commands, run_nodes
from shardax.launch._nodes import (
    Host,
    detect_node,
    expand_nodelist,
    parse_env_file,
    parse_hostfile,
    select_hosts,
    slurm_allocation,
)

SCRIPTS = Path(__file__).parent / "scripts"
LIGHT = [sys.executable, str(SCRIPTS / "light_cli.py")]
PY = sys.executable
TIMEOUT_S = 120.0

# A batch job's environment on its first node, and a job step's (srun -N 2
# --ntasks-per-node 1) on the second, as Slurm sets them (variable names and
# formats from the sbatch/srun "OUTPUT ENVIRONMENT VARIABLES" sections).
SLURM_BATCH = {
    "SLURM_JOB_ID": "31337",
    "SLURM_JOB_NAME": "train-gpt",
    "SLURM_JOB_NODELIST": "gpu-a[017-018]",
    "SLURM_NODELIST": "gpu-a[017-018]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_CPUS_ON_NODE": "64",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
    "SLURM_SUBMIT_DIR": "/home/ada/run",
    "SLURM_SUBMIT_HOST": "login01",
    "SLURM_CLUSTER_NAME": "hpc",
    "SLURMD_NODENAME": "gpu-a017",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
SLURM_STEP = {
    **SLURM_BATCH,
    "SLURMD_NODENAME": "gpu-a018",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu-a[017-018]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}


def cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``shardax launch`` in a subprocess with exactly ``env`` (plus HOME)."""
    return subprocess.run(
        [*LIGHT, *args],
        env={"HOME": str(cwd), **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts").write_text(
        "# the cluster\nworker-0 slots=2\nworker-1 slots=2  # same box type\n\nworker-2 slots=2\n"
    )
    return tmp_path


# --- two node launchers on loopback --------------------------------------------------


def start_node(rank: int, port: int, *target: str) -> subprocess.Popen:
    args = ["--launcher", "none", "--num-nodes", "2", "--node-rank", str(rank)]
    args += ["--nproc-per-node", "2", "--master-port", str(port), *target]
    return subprocess.Popen(
        [*LIGHT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    return [(d.returncode, d.stdout, d.stderr) for d in wait_all(procs, TIMEOUT_S)]


@pytest.mark.slow  # the conformance across nodes runs in tests/collectives/test_hierarchical.py
@pytest.mark.world_size(4)
def test_two_node_launchers_form_one_world_and_pass_conformance():
    port = free_port()
    procs = [start_node(n, port, "-m", "shardax.collectives.conformance") for n in (0, 1)]
    (code0, out0, err0), (code1, out1, err1) = finish(procs)
    assert code0 == 0 and code1 == 0, (err0, err1)
    assert "[rank 0] conformance: 12 checks" in out0
    assert "(4 ranks" in out0
    assert "[rank 2]" not in out0 and "[rank 0]" not in out1  # each node shows its ranks


@pytest.mark.world_size(4)
def test_a_rank_killed_on_one_node_stops_both_nodes():
    port = free_port()
    start = time.monotonic()
    script = str(SCRIPTS / "die_in_collectives.py")
    procs = [start_node(n, port, script, "3") for n in (0, 1)]
    (code0, _, err0), (code1, _, err1) = finish(procs)
    assert time.monotonic() - start < 60.0  # not the 600 s collective timeout
    assert code1 == 137 and "rank 3 failed first: killed by SIGKILL" in err1
    assert code0 != 0
    # node 0 names the dead rank (and rank 2 too, when its node stopped it first)
    assert re.search(r"Ranks that did not arrive: \[(2, )?3\]", err0), err0
    assert "a rank died or was stopped" in err0
    assert "traceback of rank" in err0  # torch's "[rank0]: " prefix is understood


def test_several_nodes_need_a_node_rank_and_a_shared_port(job_dir: Path):
    env = {"PATH": os.environ["PATH"]}
    result = cli("--launcher", "none", "--num-nodes", "2", "train.py", env=env, cwd=job_dir)
    assert result.returncode == 2 and "needs --node-rank" in result.stderr
    result = cli(
        "--launcher", "none", "--num-nodes", "2", "--node-rank", "1", "train.py",
        env=env, cwd=job_dir,
    )  # fmt: skip
    assert result.returncode == 2 and "needs --master-port" in result.stderr
    result = cli("--max-restarts", "1", "--no-ssh", "--num-nodes", "2", "--node-rank", "0",
                 "--master-port", "29500", "train.py", env=env, cwd=job_dir)  # fmt: skip
    assert result.returncode == 2 and "restarts the ranks of one node" in result.stderr


# --- dry runs: the exact commands ------------------------------------------------------


def node_argv(nodes: int, rank: str | None, nproc: int, addr: str, *extra: str) -> list[str]:
    argv = [PY, "-m", "shardax", "launch", "--launcher", "none", "--num-nodes", str(nodes)]
    if rank is not None:
        argv += ["--node-rank", rank]
    return [*argv, "--nproc-per-node", str(nproc), "--master-addr", addr, "--master-port",
            "29500", *extra]  # fmt: skip


def test_dry_run_ssh_with_include(job_dir: Path):
    env = {"PATH": "/usr/bin:/bin", "NCCL_DEBUG": "INFO", "LANG": "C"}
    (job_dir / ".shardax_env").write_text("HF_HOME=/data/hf\n")
    result = cli(
        "--hostfile", "hosts", "--launcher", "ssh", "--include", "worker-1:1@worker-2:1",
        "--env", "A=1 2", "--dry-run", "train.py", "--lr", "3e-4",
        env=env, cwd=job_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    shell_env = ["env", "A=1 2", "HF_HOME=/data/hf", "NCCL_DEBUG=INFO", "PATH=/usr/bin:/bin"]
    expected = []
    for rank, host in enumerate(("worker-1", "worker-2")):
        argv = node_argv(2, str(rank), 1, "worker-1", "--devices", "1", "--stop-on-stdin-eof")
        remote = f"cd {shlex.quote(str(job_dir))} && exec " + shlex.join(
            [*shell_env, *argv, "train.py", "--lr", "3e-4"]
        )
        expected.append(f"{host}: " + shlex.join(["ssh", "-o", "BatchMode=yes", host, remote]))
    assert result.stdout.splitlines() == expected


def test_dry_run_pdsh_with_exclude_and_num_nodes(job_dir: Path):
    result = cli(
        "--hostfile", "hosts", "--launcher", "pdsh", "--exclude", "worker-0",
        "--master-addr", "10.0.0.9", "--master-port", "29500", "--dry-run", "-m", "pkg.train",
        env={"PATH": "/bin"}, cwd=job_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = node_argv(2, "%n", 2, "10.0.0.9", "-m", "pkg.train")
    remote = f"cd {shlex.quote(str(job_dir))} && exec " + shlex.join(["env", "PATH=/bin", *argv])
    pdsh = ["pdsh", "-S", "-f", "1024", "-w", "worker-1,worker-2", remote]
    assert result.stdout.splitlines() == ["worker-1,worker-2: " + shlex.join(pdsh)]
    result = cli("--hostfile", "hosts", "--launcher", "ssh", "--num-nodes", "1", "--dry-run",
                 "train.py", env={"PATH": "/bin"}, cwd=job_dir)  # fmt: skip
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == ["worker-0"]


def test_dry_run_slurm_reads_the_allocation(job_dir: Path):
    env = {"PATH": "/bin", **SLURM_BATCH}
    result = cli("--launcher", "slurm", "--dry-run", "train.py", env=env, cwd=job_dir)
    assert result.returncode == 0, result.stderr
    argv = node_argv(2, None, 8, "gpu-a017", "--env", "PATH=/bin", "train.py")
    srun = ["srun", "--nodes=2", "--ntasks-per-node=1", "--nodelist=gpu-a017,gpu-a018",
            f"--chdir={job_dir}", "--kill-on-bad-exit=1", *argv]  # fmt: skip
    assert result.stdout.splitlines() == ["gpu-a017,gpu-a018: " + shlex.join(srun)]
    outside = cli("--launcher", "slurm", "--dry-run", "train.py", env={"PATH": "/bin"}, cwd=job_dir)
    assert outside.returncode == 2 and "inside a Slurm allocation" in outside.stderr


def test_dry_run_of_the_node_launcher_in_a_slurm_step(job_dir: Path):
    """What srun starts on the second node: node 1 of 2 from SLURM_NODEID,
    the master from the step's node list, the allocation's GPUs narrowed
    by position (never replaced)."""
    env = {"PATH": "/bin", **SLURM_STEP}
    result = cli("--launcher", "none", "--nproc-per-node", "2", "--devices", "6,7",
                 "--dry-run", "train.py", env=env, cwd=job_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 2 (node 1)", "rank 3 (node 1)"]
    assert "MASTER_ADDR=gpu-a017 MASTER_PORT=29500" in lines[0]
    assert "RANK=2" in lines[0] and "WORLD_SIZE=4" in lines[0] and "NODE_RANK=1" in lines[0]
    assert "CUDA_VISIBLE_DEVICES=6,7" in lines[0]
    assert "GLOO_SOCKET_IFNAME" not in lines[0]  # not a loopback rendezvous


def test_dry_run_mpirun_for_both_mpis():
    job = NodeJob(target=("t.py",), nproc_per_node=4, master_addr="n0", master_port=29500,
                  cwd="/w", python="py", env={"NCCL_DEBUG": "INFO"})  # fmt: skip
    hosts = (Host("n0", range(4)), Host("n1", range(4)))
    tail = ["py", "-m", "shardax", "launch", "--launcher", "none", "--num-nodes", "2",
            "--nproc-per-node", "4", "--master-addr", "n0", "--master-port", "29500",
            "--env", "NCCL_DEBUG=INFO", "t.py"]  # fmt: skip
    (open_mpi,) = node_commands("mpirun", job, hosts, mpi="openmpi")
    assert list(open_mpi.argv) == [
        "mpirun", "-n", "2", "--map-by", "ppr:1:node", "--host", "n0,n1", "--wdir", "/w", *tail
    ]  # fmt: skip
    (mpich,) = node_commands("mpirun", job, hosts, mpi="mpich")
    assert list(mpich.argv) == ["mpirun", "-n", "2", "-ppn", "1", "-hosts", "n0,n1", "-wdir", "/w",
                                *tail]  # fmt: skip


def test_bad_node_selections_are_clear_errors(job_dir: Path):
    env = {"PATH": "/bin"}
    cases = [
        (["--include", "worker-9"], "host 'worker-9' is not in the hostfile"),
        (["--include", "worker-0:5"], "has slots [0, 1], not [5]"),
        (["--include", "worker-0", "--exclude", "worker-1"], "cannot be combined"),
        (["--exclude", "worker-0@worker-1@worker-2"], "leaves no host to run on"),
        (["--include", "worker-0:0@worker-1"], "nodes have different slot counts"),
        (["--num-nodes", "4"], "only 3 host(s) are selected"),
        (["--node-rank", "1"], "--node-rank and --devices describe one node"),
    ]
    for args, message in cases:
        result = cli("--hostfile", "hosts", "--launcher", "ssh", *args, "--dry-run", "train.py",
                     env=env, cwd=job_dir)  # fmt: skip
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    result = cli("--include", "worker-0", "train.py", env=env, cwd=job_dir)
    assert result.returncode == 2 and "--launcher none runs this node only" in result.stderr


# --- the pure parts ----------------------------------------------------------------


def test_hostfiles_and_selections():
    hosts = parse_hostfile("a slots=4\n# b slots=4\nc slots=2 # small\n")
    assert hosts == (Host("a", (0, 1, 2, 3)), Host("c", (0, 1)))
    assert select_hosts(hosts, exclude="a:0,1@c") == (Host("a", (2, 3)),)
    for text, message in [
        ("a slots=2\na slots=2\n", "already listed on line 1"),
        ("a slots=0\n", "positive integer"),
        ("a\n", "is not 'HOST slots=N'"),
        ("# nothing\n", "lists no hosts"),
    ]:
        with pytest.raises(LaunchError, match=message):
            parse_hostfile(text)
    with pytest.raises(LaunchError, match="names host 'a' twice"):
        select_hosts(hosts, include="a@a")


def test_slurm_and_mpi_environments():
    batch = slurm_allocation(SLURM_BATCH)
    assert batch.hosts == ("gpu-a017", "gpu-a018")
    assert batch.gpus_per_node == 8 and batch.tasks_per_node == (1, 1)
    assert detect_node(SLURM_BATCH) is None  # the batch script is no step of one task per node
    node = detect_node(SLURM_STEP)
    assert (node.node_rank, node.num_nodes) == (1, 2) and node.source.startswith("Slurm")
    assert slurm_allocation({"PATH": "/bin"}) is None
    mpich = detect_node({"PMI_RANK": "3", "PMI_SIZE": "4"})
    assert (mpich.node_rank, mpich.num_nodes) == (3, 4)
    with pytest.raises(LaunchError, match=r"node rank 4 is not in 0\.\.3"):
        detect_node({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"})
    assert expand_nodelist("n[8-10],login") == ["n8", "n9", "n10", "login"]
    assert expand_nodelist("n[008-010]") == ["n008", "n009", "n010"]
    with pytest.raises(LaunchError, match="not a Slurm host list"):
        expand_nodelist("n[1-2")
    assert parse_env_file('export X="a b"\n# c\nY=\n') == {"X": "a b", "Y": ""}
    with pytest.raises(LaunchError, match="line 1: 'nonsense' is not KEY=VALUE"):
        parse_env_file("nonsense\n")


# --- running: restarts, environment, the driver ---------------------------------------


def test_max_restarts_restarts_every_rank(job_dir: Path):
    flaky = str(SCRIPTS / "flaky.py")
    env = dict(os.environ)
    ok = cli("--nproc-per-node", "2", "--max-restarts", "2", flaky, "2", env=env, cwd=job_dir)
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr.count("restarting every rank") == 2
    assert "(restart 2 of 2) because rank 1 failed (exit code 3)" in ok.stderr
    assert "[rank 0] restart 2" in ok.stdout
    out = cli("--nproc-per-node", "2", "--max-restarts", "1", flaky, "2", env=env, cwd=job_dir)
    assert out.returncode == 3 and out.stderr.count("restarting every rank") == 1


def test_env_file_and_env_options_reach_the_ranks(job_dir: Path):
    (job_dir / ".shardax_env").write_text("# for every rank\nFROM_FILE=yes\nBOTH=file\n")
    result = cli("--nproc-per-node", "2", "--env", "BOTH=option", "--devices", "1,0",
                 str(SCRIPTS / "show_vars.py"), "FROM_FILE", "BOTH", "CUDA_VISIBLE_DEVICES",
                 env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,5"}, cwd=job_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = [json.loads(line.split("VARS ", 1)[1]) for line in result.stdout.splitlines()]
    assert seen == [{"FROM_FILE": "yes", "BOTH": "option", "CUDA_VISIBLE_DEVICES": "5,4"}] * 2
    bad = cli("--devices", "3", "train.py", env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,5"},
              cwd=job_dir)  # fmt: skip
    assert bad.returncode == 2 and "makes 2 device(s) visible" in bad.stderr


def node_launcher(rank: int, port: int, *target: str) -> list[str]:
    return [*LIGHT, "--launcher", "none", "--num-nodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", "1", "--master-port", str(port), *target]  # fmt: skip


def test_the_driver_stops_every_node_when_one_fails(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
):
    """run_nodes, the supervisor ssh/pdsh/srun/mpirun commands run under,
    here on node launchers started directly: the first node to fail stops
    the other, whose node launcher stops its ranks."""
    port = free_port()
    behave = str(SCRIPTS / "behave.py")
    pid_dir = tmp_path
    commands = [
        NodeCommand(name, node_launcher(n, port, behave, str(pid_dir), "sleep", "exit3"))
        for n, name in enumerate(("node-a", "node-b"))
    ]
    start = time.monotonic()
    code = run_nodes(commands, kill_grace=2.0)
    assert time.monotonic() - start < 30.0
    err = capfd.readouterr().err
    assert code == 3, err
    assert (
        "shardax launch: node-b failed (exit code 3); stopping 1 other running process(es)" in err
    )
    assert "node-b: ========" in err  # the node launcher's own summary, labelled
    pids = [int(p) for f in pid_dir.iterdir() for p in f.read_text().split()]
    deadline = time.monotonic() + 5.0
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]


def test_a_node_launcher_stops_when_its_driver_goes_away():
    """Over ssh the node launcher's stdin is the driver's pipe: end of file
    (the driver or its ssh died) stops its ranks."""
    proc = subprocess.Popen(
        [*LIGHT, "--stop-on-stdin-eof", "--nproc-per-node", "2", "--no-python", sys.executable, "-c",
         "import time; print('up', flush=True); time.sleep(600)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().endswith("up\n")
    proc.stdin.close()
    proc.wait(timeout=TIMEOUT_S)
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == 129 and "stdin closed" in err


def test_the_driver_stops_every_node_at_the_timeout(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
):
    """run_nodes with a timeout, on node launchers started directly: when it
    passes, both still run; the driver stops them (their launchers stop
    their ranks), shows each one's last lines and returns 124. (12 s leaves
    a loaded host ample time to start both, which the last lines need.)"""
    port = free_port()
    behave = str(SCRIPTS / "behave.py")
    commands = [
        NodeCommand(name, node_launcher(n, port, behave, str(tmp_path), "sleep", "sleep"))
        for n, name in enumerate(("node-a", "node-b"))
    ]
    code = run_nodes(commands, kill_grace=2.0, timeout=12.0)
    err = capfd.readouterr().err
    assert code == 124, err
    assert "shardax launch: the job ran past --timeout 12 s; stopping node-a, node-b" in err
    for n, name in enumerate(("node-a", "node-b")):
        assert f"shardax launch: {name} was still running at --timeout 12 s; its last" in err
        assert f"  stdout| [rank {n}] rank {n} sleeping" in err
    pids = [int(p) for f in tmp_path.iterdir() for p in f.read_text().split()]
    deadline = time.monotonic() + 5.0
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]


def test_the_timeout_reaches_every_node_launcher(job_dir: Path):
    result = cli(
        "--hostfile", "hosts", "--launcher", "ssh", "--timeout", "90", "--dry-run", "train.py",
        env={"PATH": "/bin"}, cwd=job_dir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all("--timeout 90.0" in line for line in lines), lines
