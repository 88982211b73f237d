"""Start one ``shardax launch --launcher none`` per node: the commands for
ssh, pdsh, Slurm's ``srun`` and ``mpirun`` (pure, so ``--dry-run`` prints
exactly what would run), and a supervisor that runs them with the local
launcher's guarantees — the first node to fail stops the others, a stop
signal stops them all, and ``max_restarts`` starts the whole job again.

Each node's launcher is this same program with ``--launcher none``: it
starts that node's ranks (``node_rank * nproc_per_node + local_rank``) with
the same ``MASTER_ADDR``/``MASTER_PORT``, and torch.distributed's rendezvous
joins them into one world. With ssh, the node launcher also watches its
stdin, which the driver holds open: when the driver (or its ssh) dies, the
remote ranks are stopped too.

>>> job = NodeJob(target=("train.py",), nproc_per_node=2, master_addr="w0", master_port=29500,
...               cwd="/work", python="/usr/bin/python3")
>>> hosts = (Host("w0", (0, 1)), Host("w1", (0, 1)))
>>> for line in describe(node_commands("ssh", job, hosts)):
...     print(line)
w0: ssh -o BatchMode=yes w0 'cd /work && exec /usr/bin/python3 -m shardax launch --launcher none --num-nodes 2 --node-rank 0 --nproc-per-node 2 --master-addr w0 --master-port 29500 --stop-on-stdin-eof train.py'
w1: ssh -o BatchMode=yes w1 'cd /work && exec /usr/bin/python3 -m shardax launch --launcher none --num-nodes 2 --node-rank 1 --nproc-per-node 2 --master-addr w0 --master-port 29500 --stop-on-stdin-eof train.py'
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence

import attrs

from ..errors import LaunchError
from ._launcher import (
    DRAIN_TIMEOUT_S,
    TIMEOUT_EXIT_CODE,
    Deadline,
    _record_signals,
    _spawn_all,
    _stop,
    _supervise,
)
from ._nodes import Host
from ._stream import RankOutput, Sink, describe_returncode, exit_code, still_running

__all__ = ["LAUNCHERS", "NodeCommand", "NodeJob", "describe", "node_commands", "run_nodes"]

LAUNCHERS = ("ssh", "pdsh", "slurm", "mpirun", "none")


@attrs.frozen(kw_only=True)
class NodeJob:
    """What every node's launcher is told.

    Attributes:
        target: the rank program and its arguments as given to ``shardax
            launch`` (``("-m", "pkg.train", "--lr", "3")``, ``("train.py",)``).
        nproc_per_node: ranks per node.
        master_addr, master_port: the rendezvous (rank 0's node).
        cwd: the directory the ranks run in, on every node.
        python: the interpreter, the same path on every node.
        env: variables every rank gets (``.shardax_env``, prefixes, ``--env``).
        log_ranks, kill_grace, timeout: passed on to each node's launcher.
    """

    target: tuple[str, ...] = attrs.field(converter=tuple)
    nproc_per_node: int
    master_addr: str
    master_port: int
    cwd: str
    python: str
    env: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    log_ranks: str = "all"
    kill_grace: float = 5.0
    timeout: float | None = None


@attrs.frozen
class NodeCommand:
    """One command the driver runs: ``label`` names the node(s) it starts."""

    label: str
    argv: tuple[str, ...] = attrs.field(converter=tuple)
    watch_stdin: bool = False


def _node_argv(
    job: NodeJob,
    num_nodes: int,
    node_rank: int | str | None,
    devices: Sequence[int] | None,
    *,
    env_options: bool,
    stdin: bool,
) -> list[str]:
    argv = [
        job.python,
        "-m",
        "shardax",
        "launch",
        "--launcher",
        "none",
        "--num-nodes",
        str(num_nodes),
    ]
    if node_rank is not None:
        argv += ["--node-rank", str(node_rank)]
    argv += [
        "--nproc-per-node",
        str(job.nproc_per_node),
        "--master-addr",
        job.master_addr,
        "--master-port",
        str(job.master_port),
    ]
    if devices is not None:
        argv += ["--devices", ",".join(map(str, devices))]
    if job.log_ranks != "all":
        argv += ["--log-ranks", job.log_ranks]
    if job.kill_grace != 5.0:
        argv += ["--kill-grace", f"{job.kill_grace:g}"]
    if job.timeout is not None:
        argv += ["--timeout", repr(float(job.timeout))]
    if env_options:
        for key, value in sorted(job.env.items()):
            argv += ["--env", f"{key}={value}"]
    if stdin:
        argv.append("--stop-on-stdin-eof")
    return [*argv, *job.target]


def _devices(host: Host, nproc: int) -> tuple[int, ...] | None:
    """The slots to pin when they are not simply the first ``nproc``."""
    slots = host.slots[:nproc]
    return None if slots == tuple(range(nproc)) else slots


def _remote_shell(job: NodeJob, argv: Sequence[str]) -> str:
    env = [f"{k}={v}" for k, v in sorted(job.env.items())]
    head = ["env", *env] if env else []
    return f"cd {shlex.quote(job.cwd)} && exec {shlex.join([*head, *argv])}"


def node_commands(
    launcher: str, job: NodeJob, hosts: Sequence[Host], *, mpi: str = "openmpi"
) -> list[NodeCommand]:
    """The commands that start ``job`` on ``hosts``: one ssh per node, or one
    ``pdsh``/``srun``/``mpirun`` for them all (each starts one launcher per
    node, whose node rank comes from pdsh's ``%n``, ``SLURM_NODEID`` or the
    MPI rank). ``mpi`` is ``"openmpi"`` or ``"mpich"`` (their ``mpirun``
    flags differ).

    >>> job = NodeJob(target=("t.py",), nproc_per_node=1, master_addr="a", master_port=1,
    ...               cwd="/w", python="py")
    >>> node_commands("slurm", job, (Host("a", (0,)), Host("b", (0,))))[0].argv[:6]
    ('srun', '--nodes=2', '--ntasks-per-node=1', '--nodelist=a,b', '--chdir=/w', '--kill-on-bad-exit=1')
    """
    if not hosts:
        raise LaunchError("no hosts to launch on")
    counts = {h.name: min(len(h.slots), job.nproc_per_node) for h in hosts}
    short = [f"{name} ({n})" for name, n in counts.items() if n < job.nproc_per_node]
    if short:
        raise LaunchError(
            f"every node runs --nproc-per-node={job.nproc_per_node} ranks, but these have fewer "
            f"slots: {', '.join(short)}; lower --nproc-per-node or fix --include/--exclude"
        )
    n = len(hosts)
    devices = {h.name: _devices(h, job.nproc_per_node) for h in hosts}
    if launcher == "ssh":
        return [
            NodeCommand(
                h.name,
                [
                    "ssh",
                    "-o",
                    "BatchMode=yes",
                    h.name,
                    _remote_shell(
                        job,
                        _node_argv(job, n, i, devices[h.name], env_options=False, stdin=True),
                    ),
                ],
                watch_stdin=True,
            )
            for i, h in enumerate(hosts)
        ]
    if len(set(devices.values())) > 1:
        raise LaunchError(
            f"--launcher {launcher} starts every node with one command, so every node must use "
            f"the same slots; got {devices}: use --launcher ssh, or select the same slots"
        )
    pinned = next(iter(devices.values()))
    names = ",".join(h.name for h in hosts)
    if launcher == "pdsh":
        argv = _node_argv(job, n, "%n", pinned, env_options=False, stdin=False)
        return [
            NodeCommand(names, ["pdsh", "-S", "-f", "1024", "-w", names, _remote_shell(job, argv)])
        ]
    if launcher == "slurm":
        argv = _node_argv(job, n, None, pinned, env_options=True, stdin=False)
        head = [
            "srun",
            f"--nodes={n}",
            "--ntasks-per-node=1",
            f"--nodelist={names}",
            f"--chdir={job.cwd}",
            "--kill-on-bad-exit=1",
        ]
        return [NodeCommand(names, [*head, *argv])]
    if launcher == "mpirun":
        argv = _node_argv(job, n, None, pinned, env_options=True, stdin=False)
        if mpi == "openmpi":
            head = [
                "mpirun",
                "-n",
                str(n),
                "--map-by",
                "ppr:1:node",
                "--host",
                names,
                "--wdir",
                job.cwd,
            ]
        elif mpi == "mpich":
            head = ["mpirun", "-n", str(n), "-ppn", "1", "-hosts", names, "-wdir", job.cwd]
        else:
            raise LaunchError(f"mpi is 'openmpi' or 'mpich', got {mpi!r}")
        return [NodeCommand(names, [*head, *argv])]
    raise LaunchError(f"--launcher is one of {', '.join(LAUNCHERS)}; got {launcher!r}")


def describe(commands: Sequence[NodeCommand]) -> list[str]:
    """One line per command, as ``--dry-run`` prints them."""
    return [f"{c.label}: {shlex.join(c.argv)}" for c in commands]


def mpi_flavor(version_output: str) -> str:
    """``openmpi`` or ``mpich`` from ``mpirun --version``'s output.

    >>> mpi_flavor("mpirun (Open MPI) 4.1.2"), mpi_flavor("HYDRA build details:")
    ('openmpi', 'mpich')
    """
    text = version_output.lower()
    return "mpich" if ("hydra" in text or "mpich" in text or "intel" in text) else "openmpi"


def run_nodes(
    commands: Sequence[NodeCommand],
    *,
    kill_grace: float,
    max_restarts: int = 0,
    timeout: float | None = None,
) -> int:
    """Run the node commands and supervise them like ranks: every line is
    re-emitted prefixed with the node, the first to fail stops the others
    (SIGTERM, then SIGKILL after ``kill_grace``), and up to ``max_restarts``
    times the whole job starts again; once ``timeout`` seconds have passed
    in all, the node launchers still running are stopped the same way.
    Returns the first failure's exit code, 0, 124 when the time ran out,
    or 128 + the signal that stopped the driver."""
    deadline = Deadline.of(timeout)
    restart = 0
    while True:
        sink = Sink()
        labels = [c.label for c in commands]
        with _record_signals() as received:
            procs = _spawn_all(
                [c.argv for c in commands],
                [None] * len(commands),
                stdin_pipes=[c.watch_stdin for c in commands],
                what="node launcher",
            )
            outputs = [
                RankOutput(i, p.stdout, p.stderr, sink=sink, show=True, label=f"{c.label}: ")
                for i, (c, p) in enumerate(zip(commands, procs, strict=True))
            ]
            for output in outputs:
                output.start()
            try:
                outcome = _supervise(
                    procs,
                    range(len(procs)),
                    received,
                    kill_grace,
                    sink,
                    names=labels,
                    deadline=deadline,
                )
            except BaseException:
                _stop(procs, 0.0, received)
                raise
            finally:
                for p in procs:
                    if p.stdin is not None:
                        p.stdin.close()
        drained_by = time.monotonic() + DRAIN_TIMEOUT_S
        for output in outputs:
            output.join(max(0.0, drained_by - time.monotonic()))
        if outcome.signum is not None:
            return 128 + outcome.signum
        if outcome.timed_out and deadline is not None:
            for i in outcome.timed_out:
                head = f"{labels[i]} was still running at --timeout {deadline.seconds:g} s"
                lines = still_running(f"shardax launch: {head}", outputs[i].output_tail())
                sink.message("\n".join(lines))
            return TIMEOUT_EXIT_CODE
        if not outcome.failures:
            return 0
        index, code = outcome.failures[0]
        reason = f"{labels[index]} failed ({describe_returncode(code)})"
        if restart >= max_restarts:
            sink.message(f"shardax launch: {reason}; the job stopped")
            return exit_code(code)
        restart += 1
        sink.message(
            f"shardax launch: restarting every node (restart {restart} of {max_restarts}) "
            f"because {reason}"
        )
        commands = [_with_restart(c, restart) for c in commands]


def _with_restart(command: NodeCommand, restart: int) -> NodeCommand:
    """The command with ``SHARDAX_RESTART_COUNT`` for its ranks."""
    argv = list(command.argv)
    marker = "--env"
    setting = f"SHARDAX_RESTART_COUNT={restart}"
    for i, arg in enumerate(argv):
        if "shardax launch --launcher none" in arg:  # a remote shell line (ssh, pdsh)
            argv[i] = arg.replace(
                "launch --launcher none", f"launch --launcher none {marker} {setting}", 1
            )
            return attrs.evolve(command, argv=argv)
    at = argv.index("none") + 1  # '--launcher none' of the node launcher
    return attrs.evolve(command, argv=[*argv[:at], marker, setting, *argv[at:]])
