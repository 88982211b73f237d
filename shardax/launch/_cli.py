"""The ``shardax launch`` command: a thin click wrapper over :func:`launch`.

>>> from click.testing import CliRunner
>>> result = CliRunner().invoke(launch_command, ["--nproc-per-node", "0", "t.py"])
>>> result.exit_code, "0 is not in the range" in result.output
(2, True)
"""

from __future__ import annotations

import difflib
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import click

from .._bad_setting import BadSetting
from ..errors import LaunchError
from ._elastic import check_elastic
from ._launcher import launch
from ._multinode import LAUNCHERS, NodeJob, describe, mpi_flavor, node_commands, run_nodes
from ._nodes import (
    Host,
    detect_node,
    parse_env_file,
    parse_hostfile,
    propagated_env,
    select_hosts,
    slurm_allocation,
)
from ._spec import DEFAULT_MASTER_ADDR, LaunchSpec, rank_command, rank_env, validate_ranks

__all__ = ["launch_command", "parse_log_ranks"]

_EPILOG = """\b
Examples:
  shardax launch --nproc-per-node 4 train.py --lr 3e-4
  shardax launch --nproc-per-node 2 -m mypkg.train --config run.hjson
  shardax launch --nproc-per-node 8 --log-ranks 0 train.py
  shardax launch --nproc-per-node 2 --no-python bash -c 'echo $RANK'
  shardax launch --nproc-per-node 4 --elastic 2:4 --max-restarts 3 train.py
  shardax launch --hostfile hosts --launcher ssh --master-port 29500 train.py
  shardax launch --launcher none --num-nodes 2 --node-rank 1 \\
      --nproc-per-node 8 --master-addr node0 --master-port 29500 train.py
  srun -N 2 --ntasks-per-node 1 shardax launch --launcher none --nproc-per-node 8 train.py

\b
Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and
NODE_RANK (its node), MASTER_ADDR, MASTER_PORT, SHARDAX_LAUNCHED=1,
PYTHONUNBUFFERED=1, SHARDAX_RESTART_COUNT (with --max-restarts also
SHARDAX_MEMORY_DIR, with --elastic SHARDAX_ELASTIC), the variables of .shardax_env
(~ then the working directory) and --env, and, unless already set,
GLOO_SOCKET_IFNAME=lo (loopback rendezvous), OMP_NUM_THREADS=max(1, CPUs //
nproc-per-node) and THP_MEM_ALLOC_ENABLE=1. Its stdin is /dev/null. Over
ssh, pdsh, srun and mpirun, variables named NCCL_*, PYTHON*, SHARDAX_*,
CUDA_*, TORCH_*, GLOO_*, OMP_*, … travel too.

\b
If a rank fails, the others get SIGTERM (their whole process groups), then
SIGKILL after --kill-grace seconds; the failed rank's traceback (or its
last lines) is printed and its exit code returned (128+N if killed by signal
N). Ctrl-C / SIGTERM stop all ranks the same way and exit 130 / 143; a job
past --timeout is stopped the same way and exits 124. See docs/launch.md.
"""


def parse_log_ranks(text: str) -> tuple[int, ...] | None:
    """Parse ``--log-ranks``: ``all`` (``None``), or ranks and ranges
    separated by commas.

    >>> parse_log_ranks("all") is None
    True
    >>> parse_log_ranks("0,2-4")
    (0, 2, 3, 4)
    """
    text = text.strip()
    if text.lower() == "all":
        return None
    ranks: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise click.BadParameter(
                f"{text!r} is not 'all' or a list of ranks like '0', '0,2' or '0-3'"
            ) from None
        if lo < 0 or hi < lo:
            raise click.BadParameter(f"{part.strip()!r} is not a rank or a range lo-hi of ranks")
        ranks.extend(range(lo, hi + 1))
    return tuple(ranks)


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
        "show_default": True,
    },
    epilog=_EPILOG,
)
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    type=click.IntRange(min=1),
    default=None,
    help="Number of ranks to start on each node.  [default: 1; with --hostfile, its slots]",
)
@click.option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    default=None,
    help="Address of rank 0's rendezvous store (MASTER_ADDR).  [default: 127.0.0.1; the first "
    "host with --hostfile or in a Slurm allocation]",
)
@click.option(
    "--master-port",
    "--master_port",
    "master_port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port of the rendezvous store (MASTER_PORT).  [default: a free port from the OS on one "
    "node; 29500 when several nodes are started from here or by Slurm/MPI]",
)
@click.option(
    "--log-ranks",
    default="all",
    show_default=True,
    metavar="RANKS",
    help="Ranks whose output is shown: 'all', or e.g. '0', '0,2', '0-3'. "
    "A failed rank's traceback is shown regardless.",
)
@click.option(
    "--kill-grace",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when stopping ranks.",
)
@click.option(
    "--launcher",
    type=click.Choice(LAUNCHERS),
    default=None,
    help="How nodes are started: ssh or pdsh (one launcher per --hostfile node), slurm "
    "(srun, in the allocation or on --hostfile nodes), mpirun (one process per node), or "
    "none (this node only; the others start their own).  [default: none; with --hostfile, "
    "pdsh if installed, else ssh]",
)
@click.option("--no-ssh", is_flag=True, help="Same as --launcher none.")
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False),
    default=None,
    help="DeepSpeed-style hostfile: 'HOST slots=N' per line, '#' comments.",
)
@click.option(
    "--include", default=None, metavar="HOSTS", help="Only these hosts/slots: 'host1:0,1@host2'."
)
@click.option(
    "--exclude", default=None, metavar="HOSTS", help="All but these hosts/slots: 'host1:1@host3'."
)
@click.option(
    "--num-nodes",
    "--nnodes",
    "num_nodes",
    type=click.IntRange(min=1),
    default=None,
    help="Nodes in the job. With --hostfile: use its first N hosts. With --launcher none: the "
    "job's node count.  [default: all hosts; with --launcher none, from Slurm or MPI, else 1]",
)
@click.option(
    "--node-rank",
    type=click.IntRange(min=0),
    default=None,
    help="This node's index (--launcher none).  [default: from SLURM_NODEID or the MPI rank, else 0]",
)
@click.option(
    "--devices",
    default=None,
    metavar="SLOTS",
    help="This node's device slots, one per rank, e.g. '0,1' (CUDA_VISIBLE_DEVICES; an existing "
    "one is narrowed by position, never replaced).",
)
@click.option(
    "--env",
    "env_items",
    multiple=True,
    metavar="KEY=VAL",
    help="A variable every rank gets (repeatable).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the command each node (or rank) would run; start nothing.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="When a rank fails, stop all and start the job again, up to N times (the script "
    "resumes from its latest checkpoint; ranks see SHARDAX_RESTART_COUNT).",
)
@click.option(
    "--elastic",
    default=None,
    metavar="MIN:MAX",
    help="Start MAX ranks (all of the job's); when ranks are lost (killed by a signal, or "
    "failed with an error of their own), stop the others and restart on the ranks that remain "
    "while they are at least MIN (needs --max-restarts; ranks see SHARDAX_ELASTIC and the new "
    "WORLD_SIZE). Several nodes: every node's --launcher none launcher takes it.",
)
@click.option(
    "--rejoin-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="With --elastic over several nodes: how long the node launchers wait for each other "
    "after a failure; a node that has not rejoined by then is lost.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Limit the whole job (restarts included) to SECONDS of wall-clock time: then every "
    "rank still running is stopped (SIGTERM, SIGKILL after --kill-grace), the ranks and their "
    "last lines are shown, and the launcher exits 124.  [default: no limit]",
)
@click.option("--stop-on-stdin-eof", is_flag=True, hidden=True)
@click.option("-m", "--module", is_flag=True, help="Run SCRIPT as a module, like 'python -m'.")
@click.option(
    "--no-python",
    is_flag=True,
    help="Run SCRIPT as an executable, not with the Python interpreter.",
)
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[SCRIPT_ARGS]...")
@click.pass_context
def launch_command(
    ctx: click.Context,
    nproc_per_node: int | None,
    master_addr: str | None,
    master_port: int | None,
    log_ranks: str,
    kill_grace: float,
    launcher: str | None,
    no_ssh: bool,
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
    num_nodes: int | None,
    node_rank: int | None,
    devices: str | None,
    env_items: tuple[str, ...],
    dry_run: bool,
    max_restarts: int,
    elastic: str | None,
    rejoin_timeout: float,
    timeout: float | None,
    stop_on_stdin_eof: bool,
    module: bool,
    no_python: bool,
    script: str,
    script_args: tuple[str, ...],
) -> None:
    """Start NPROC_PER_NODE ranks running SCRIPT [SCRIPT_ARGS]... on this
    node, or on every node of a --hostfile or Slurm allocation.

    Every line a rank prints is shown prefixed '[rank k] ' (and the node's
    name, when several are started from here). Everything after SCRIPT is
    passed to it untouched, options included.
    """
    if script.startswith("-") and script != "-":  # an unknown option, not a script
        names = [name for param in ctx.command.params for name in param.opts]
        close = difflib.get_close_matches(script, names)
        raise click.NoSuchOption(script, possibilities=close, ctx=ctx)
    if no_ssh:
        if launcher not in (None, "none"):
            raise click.UsageError(f"--no-ssh contradicts --launcher {launcher}", ctx=ctx)
        launcher = "none"
    shown = parse_log_ranks(log_ranks)
    try:
        if shown is not None and launcher in (None, "none") and hostfile is None:
            validate_ranks(shown, (num_nodes or 1) * (nproc_per_node or 1), repr(log_ranks))
    except LaunchError as e:
        raise click.BadParameter(str(e), param_hint="--log-ranks") from None
    try:
        cmd = rank_command(script, script_args, module=module, no_python=no_python)
    except LaunchError as e:
        raise click.UsageError(str(e), ctx=ctx) from None
    try:
        extra = _env_files()
        ranks_env = propagated_env({}, extra, env_items, prefixes=())
        slots = _parse_devices(devices)
        if launcher is None:
            launcher = "none" if hostfile is None else ("pdsh" if shutil.which("pdsh") else "ssh")
        if launcher == "none":
            for flag, value in (
                ("--hostfile", hostfile),
                ("--include", include),
                ("--exclude", exclude),
            ):
                if value is not None:
                    raise LaunchError(
                        f"{flag} lists nodes for a launcher that starts them (ssh, pdsh, slurm, "
                        "mpirun); --launcher none runs this node only"
                    )
            code = _run_this_node(
                cmd,
                nproc_per_node=1 if nproc_per_node is None else nproc_per_node,
                master_addr=master_addr,
                master_port=master_port,
                shown=shown,
                log_ranks=log_ranks,
                kill_grace=kill_grace,
                num_nodes=num_nodes,
                node_rank=node_rank,
                devices=slots,
                env={**os.environ, **ranks_env},
                dry_run=dry_run,
                max_restarts=max_restarts,
                stop_on_stdin_eof=stop_on_stdin_eof,
                timeout=timeout,
                elastic=elastic,
                rejoin_timeout=rejoin_timeout,
            )
        else:
            if elastic is not None:
                raise LaunchError(
                    f"--elastic with --launcher {launcher}: the node launchers of an elastic job "
                    "agree among themselves, so start one per node with --launcher none --elastic "
                    "(by hand, under srun -N, or as a Kubernetes pod each)"
                )
            if node_rank is not None or slots is not None:
                raise LaunchError(
                    f"--node-rank and --devices describe one node; with --launcher {launcher} "
                    "they come from the hostfile (use --include host:0,1 to pick slots)"
                )
            hosts = _hosts(launcher, hostfile, include, exclude, num_nodes)
            nproc = nproc_per_node if nproc_per_node is not None else _slots_per_node(hosts)
            if shown is not None:
                validate_ranks(shown, nproc * len(hosts), repr(log_ranks))
            job = NodeJob(
                target=_target(script, script_args, module=module, no_python=no_python),
                nproc_per_node=nproc,
                master_addr=master_addr or hosts[0].name,
                master_port=29500 if master_port is None else master_port,
                cwd=os.getcwd(),
                python=sys.executable,
                env=propagated_env(os.environ, extra, env_items),
                log_ranks=log_ranks,
                kill_grace=kill_grace,
                timeout=timeout,
            )
            commands = node_commands(
                launcher, job, hosts, mpi=_mpi() if launcher == "mpirun" else "openmpi"
            )
            if dry_run:
                for line in describe(commands):
                    click.echo(line)
                ctx.exit(0)
            code = run_nodes(
                commands, kill_grace=kill_grace, max_restarts=max_restarts, timeout=timeout
            )
    except LaunchError as e:
        raise BadSetting(str(e)) from None
    ctx.exit(code)


def _env_files() -> dict[str, str]:
    """``~/.shardax_env`` then ``./.shardax_env`` (the working directory's wins)."""
    out: dict[str, str] = {}
    for path in (Path.home() / ".shardax_env", Path.cwd() / ".shardax_env"):
        if path.is_file():
            out.update(parse_env_file(path.read_text(), str(path)))
    return out


def _parse_devices(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise LaunchError(f"--devices {text!r} is not a list of device slots like '0,1'") from None


def _target(script: str, args: Sequence[str], *, module: bool, no_python: bool) -> tuple[str, ...]:
    flags = ("-m",) if module else ("--no-python",) if no_python else ()
    return (*flags, script, *args)


def _hosts(
    launcher: str,
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
    num_nodes: int | None,
) -> tuple[Host, ...]:
    if hostfile is not None:
        try:
            text = Path(hostfile).read_text()
        except OSError as e:
            raise LaunchError(f"cannot read --hostfile {hostfile!r}: {e.strerror or e}") from None
        hosts = parse_hostfile(text, hostfile)
    else:
        allocation = slurm_allocation(os.environ) if launcher == "slurm" else None
        if allocation is None:
            where = (
                " or run inside a Slurm allocation (salloc/sbatch)" if launcher == "slurm" else ""
            )
            raise LaunchError(f"--launcher {launcher} needs --hostfile (the nodes to start){where}")
        per_node = allocation.gpus_per_node or (allocation.tasks_per_node or (1,))[0]
        hosts = tuple(Host(name, tuple(range(per_node))) for name in allocation.hosts)
    hosts = select_hosts(hosts, include, exclude)
    if num_nodes is not None:
        if num_nodes > len(hosts):
            raise LaunchError(
                f"--num-nodes {num_nodes}, but only {len(hosts)} host(s) are selected"
            )
        hosts = hosts[:num_nodes]
    return hosts


def _slots_per_node(hosts: Sequence[Host]) -> int:
    counts = {h.name: len(h.slots) for h in hosts}
    if len(set(counts.values())) != 1:
        raise LaunchError(
            f"the nodes have different slot counts {counts}: every node runs the same number of "
            "ranks; give --nproc-per-node, or select equal slots with --include/--exclude"
        )
    return next(iter(counts.values()))


def _mpi() -> str:
    """Which MPI's ``mpirun`` is installed (its flags differ); Open MPI if unknown."""
    if shutil.which("mpirun") is None:
        return "openmpi"
    try:
        out = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "openmpi"
    return mpi_flavor(out.stdout + out.stderr)


def _run_this_node(
    cmd: tuple[str, ...],
    *,
    nproc_per_node: int,
    master_addr: str | None,
    master_port: int | None,
    shown: tuple[int, ...] | None,
    log_ranks: str,
    kill_grace: float,
    num_nodes: int | None,
    node_rank: int | None,
    devices: tuple[int, ...] | None,
    env: Mapping[str, str],
    dry_run: bool,
    max_restarts: int,
    stop_on_stdin_eof: bool,
    timeout: float | None = None,
    elastic: str | None = None,
    rejoin_timeout: float = 30.0,
) -> int:
    """``--launcher none``: this node's ranks, its place in the job given or
    read from Slurm / MPI."""
    detected = detect_node(os.environ) if num_nodes is None or node_rank is None else None
    if num_nodes is None:
        num_nodes = detected.num_nodes if detected is not None else 1
    if node_rank is None:
        if detected is not None:
            node_rank = detected.node_rank
        elif num_nodes > 1:
            raise LaunchError(
                f"--num-nodes {num_nodes} needs --node-rank (this node's index), or a Slurm/MPI "
                "launcher that says it"
            )
        else:
            node_rank = 0
    if master_addr is None:
        allocation = slurm_allocation(os.environ) if num_nodes > 1 else None
        master_addr = allocation.hosts[0] if allocation is not None else DEFAULT_MASTER_ADDR
    if master_port is None and num_nodes > 1:
        if detected is None:
            raise LaunchError(
                f"a job of {num_nodes} nodes needs --master-port: every node's launcher must use "
                "the same one (e.g. --master-port 29500)"
            )
        master_port = 29500  # the same default on every node Slurm or MPI started
    if shown is not None:
        validate_ranks(shown, num_nodes * nproc_per_node, repr(log_ranks))
    check_elastic(elastic, num_nodes * nproc_per_node, max_restarts)  # refused before anything
    if dry_run:
        spec = LaunchSpec(
            cmd=cmd,
            nproc_per_node=nproc_per_node,
            master_addr=master_addr,
            master_port=29500 if master_port is None else master_port,
            num_nodes=num_nodes,
            node_rank=node_rank,
            devices=devices,
        )
        for local in range(nproc_per_node):
            full = rank_env(spec, local, env)
            added = {k: v for k, v in full.items() if env.get(k) != v}
            click.echo(
                f"rank {spec.ranks[local]} (node {node_rank}): "
                + shlex.join([*(f"{k}={v}" for k, v in sorted(added.items())), *cmd])
            )
        return 0
    return launch(
        cmd,
        nproc_per_node=nproc_per_node,
        master_addr=master_addr,
        master_port=master_port,
        log_ranks=shown,
        kill_grace=kill_grace,
        env=env,
        num_nodes=num_nodes,
        node_rank=node_rank,
        devices=devices,
        max_restarts=max_restarts,
        stop_on_stdin_eof=stop_on_stdin_eof,
        timeout=timeout,
        elastic=elastic,
        rejoin_timeout=rejoin_timeout,
    )
