"""What to launch, and the environment each rank gets.

This module only *describes* a launch: a :class:`LaunchSpec` value and the
pure function :func:`rank_env` that turns it into one rank's environment. It
spawns nothing (that is ``_launcher``) and reads no output (that is
``_stream``); a multi-node job is one such launch per node, each with its
``node_rank`` (``_nodes`` and ``_multinode`` say how they are started).

The environment follows torchrun's contract, so code written for
``torch.distributed.init_process_group("env://")`` runs as is.

>>> spec = LaunchSpec(cmd=["python", "train.py"], nproc_per_node=2, master_port=29500)
>>> env = rank_env(spec, 1, {})
>>> env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]
('1', '2', '127.0.0.1', '29500')
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..errors import LaunchError

__all__ = [
    "LaunchSpec",
    "cpu_count",
    "free_port",
    "is_loopback",
    "rank_command",
    "rank_env",
    "validate_ranks",
    "visible_devices",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"


def _to_cmd(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)):
        raise LaunchError(
            f"cmd must be a sequence of arguments, not one string: {value!r} "
            "(split it with shlex.split, or see rank_command)"
        )
    return tuple(value)


def _check_cmd(instance: LaunchSpec, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise LaunchError("LaunchSpec.cmd is empty: give the program each rank runs, and its args")
    bad = [arg for arg in value if not isinstance(arg, str)]
    if bad:
        raise LaunchError(f"LaunchSpec.cmd must be strings, got {bad!r} in {value!r}")


def _check_nproc(instance: LaunchSpec, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchError(
            f"nproc_per_node must be an integer >= 1, got {value!r}; "
            "it is the number of ranks to start on this machine"
        )


def _check_addr(instance: LaunchSpec, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise LaunchError(
            f"master_addr must be a host name or IP address, got {value!r} "
            f"(use {DEFAULT_MASTER_ADDR!r} for a single machine)"
        )


def _check_port(instance: LaunchSpec, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise LaunchError(
            f"master_port must be an integer in 1..65535, got {value!r}; "
            "leave it unset to let the OS pick a free port"
        )


def _check_nodes(instance: LaunchSpec, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchError(f"num_nodes must be an integer >= 1, got {value!r}")


def _check_node_rank(instance: LaunchSpec, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < instance.num_nodes:
        raise LaunchError(
            f"node_rank must be an integer in 0..{instance.num_nodes - 1} for num_nodes="
            f"{instance.num_nodes}, got {value!r}"
        )


def _to_devices(value: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _check_devices(
    instance: LaunchSpec, attribute: attrs.Attribute, value: tuple[int, ...] | None
) -> None:
    if value is None:
        return
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in value):
        raise LaunchError(f"devices must be device indices >= 0, got {value!r}")
    if len(value) != instance.nproc_per_node:
        raise LaunchError(
            f"{len(value)} devices {list(value)} for nproc_per_node={instance.nproc_per_node}: "
            "give one device per rank"
        )


@attrs.frozen(kw_only=True)
class LaunchSpec:
    """What to start on this node: the command every rank runs, how many
    ranks, where rank 0 listens for the rendezvous, and which node of how
    many this is.

    Attributes:
        cmd: The full argv each rank runs (the same for every rank), e.g.
            ``(sys.executable, "train.py", "--lr", "3")``.
        nproc_per_node: The number of ranks to start on this machine.
        master_addr: The address rank 0's ``torch.distributed`` store binds.
        master_port: The port of that store (see :func:`free_port`).
        num_nodes: The number of nodes in the job, each running
            ``nproc_per_node`` ranks.
        node_rank: This node's index: its ranks are
            ``node_rank * nproc_per_node + local_rank``.
        devices: The node's device slots the ranks use, one per rank (from
            ``--include host:0,1``): they become ``CUDA_VISIBLE_DEVICES``,
            picked from an existing ``CUDA_VISIBLE_DEVICES`` by position.

    >>> LaunchSpec(cmd=["python", "t.py"], nproc_per_node=2, master_port=29500)
    LaunchSpec(cmd=('python', 't.py'), nproc_per_node=2, master_addr='127.0.0.1', master_port=29500, num_nodes=1, node_rank=0, devices=None)
    >>> try:
    ...     LaunchSpec(cmd=["python", "t.py"], nproc_per_node=0, master_port=29500)
    ... except LaunchError as e:
    ...     print(e)
    nproc_per_node must be an integer >= 1, got 0; it is the number of ranks to start on this machine
    """

    cmd: tuple[str, ...] = attrs.field(converter=_to_cmd, validator=_check_cmd)
    nproc_per_node: int = attrs.field(validator=_check_nproc)
    master_addr: str = attrs.field(default=DEFAULT_MASTER_ADDR, validator=_check_addr)
    master_port: int = attrs.field(validator=_check_port)
    num_nodes: int = attrs.field(default=1, validator=_check_nodes)
    node_rank: int = attrs.field(default=0, validator=_check_node_rank)
    devices: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_devices, validator=_check_devices
    )

    @property
    def world_size(self) -> int:
        """The number of ranks in the job, on all nodes.

        >>> LaunchSpec(cmd=["t"], nproc_per_node=4, master_port=1, num_nodes=2).world_size
        8
        """
        return self.num_nodes * self.nproc_per_node

    @property
    def ranks(self) -> range:
        """The global ranks this node runs.

        >>> LaunchSpec(cmd=["t"], nproc_per_node=2, master_port=1, num_nodes=2, node_rank=1).ranks
        range(2, 4)
        """
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)


def free_port(host: str = "") -> int:
    """Ask the OS for a TCP port that is free right now, by binding port 0.

    The port is released before this returns, so another process may take it
    before rank 0 binds it; the window is short and the same one torchrun has.

    Args:
        host: The address to bind (default: all interfaces).

    Returns:
        A port number in 1..65535.

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def cpu_count() -> int:
    """The number of CPUs this process may run on (its affinity mask, which
    ``taskset`` and container cpusets narrow), at least 1.

    >>> cpu_count() >= 1
    True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def rank_env(spec: LaunchSpec, local_rank: int, base_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of one rank: ``base_env`` plus the launcher's variables.

    Always set (overriding ``base_env``): ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``NODE_RANK``
    (the node's index), ``MASTER_ADDR``, ``MASTER_PORT``,
    ``SHARDAX_LAUNCHED=1`` and ``PYTHONUNBUFFERED=1`` (so output and
    tracebacks reach the launcher as they happen); with ``spec.devices``,
    ``CUDA_VISIBLE_DEVICES`` (those slots; an existing
    ``CUDA_VISIBLE_DEVICES`` is narrowed by position, never replaced).

    Set only where ``base_env`` lacks them: ``GLOO_SOCKET_IFNAME=lo`` (when
    the rendezvous address is a loopback one: every rank is local),
    ``OMP_NUM_THREADS`` = max(1, cpu_count() //
    nproc_per_node), so N ranks do not each start one thread per CPU, and
    ``THP_MEM_ALLOC_ENABLE=1``, so torch backs large CPU tensors with huge
    pages (a fresh 32 MiB buffer — every collective's output — then costs a
    quarter of the page-fault time).

    Args:
        spec: The launch.
        local_rank: This rank's index on this machine, in
            ``range(spec.nproc_per_node)``.
        base_env: The environment to start from (usually ``os.environ``);
            it is not modified.

    Returns:
        A new ``dict`` to pass as the rank's environment.

    Raises:
        LaunchError: ``local_rank`` is out of range.

    >>> spec = LaunchSpec(cmd=["t"], nproc_per_node=2, master_port=29500)
    >>> env = rank_env(spec, 0, {"OMP_NUM_THREADS": "8", "PATH": "/bin"})
    >>> {k: env[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")}
    {'RANK': '0', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '2', 'NODE_RANK': '0'}
    >>> env["OMP_NUM_THREADS"], env["GLOO_SOCKET_IFNAME"], env["PATH"]
    ('8', 'lo', '/bin')
    """
    if isinstance(local_rank, bool) or not isinstance(local_rank, int):
        raise LaunchError(f"local_rank must be an int, got {local_rank!r}")
    if not 0 <= local_rank < spec.nproc_per_node:
        raise LaunchError(
            f"local_rank {local_rank} is out of range for nproc_per_node="
            f"{spec.nproc_per_node} (valid: 0..{spec.nproc_per_node - 1})"
        )
    env = dict(base_env)
    if spec.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(spec.devices, base_env)
    env.update(
        RANK=str(spec.ranks[local_rank]),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.nproc_per_node),
        GROUP_RANK=str(spec.node_rank),
        NODE_RANK=str(spec.node_rank),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        SHARDAX_LAUNCHED="1",
        PYTHONUNBUFFERED="1",
    )
    if is_loopback(spec.master_addr):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // spec.nproc_per_node)))
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return env


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` names this machine's loopback interface.

    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("10.0.0.5")
    (True, True, False)
    """
    return addr in ("localhost", "::1") or addr.startswith("127.")


def visible_devices(devices: Sequence[int], base_env: Mapping[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the node's device ``devices``: those
    indices, or — when the node already restricts the visible devices (a
    Slurm allocation, a container) — the devices at those positions of its
    list, which is never replaced wholesale.

    >>> visible_devices([0, 1], {}), visible_devices([1], {"CUDA_VISIBLE_DEVICES": "4,5,6"})
    ('0,1', '5')
    """
    given = base_env.get("CUDA_VISIBLE_DEVICES")
    if given is None or not given.strip():
        return ",".join(map(str, devices))
    visible = [d.strip() for d in given.split(",") if d.strip()]
    beyond = [d for d in devices if d >= len(visible)]
    if beyond:
        raise LaunchError(
            f"device slots {beyond} do not exist here: CUDA_VISIBLE_DEVICES={given!r} makes "
            f"{len(visible)} device(s) visible, slots 0..{len(visible) - 1}"
        )
    return ",".join(visible[d] for d in devices)


def rank_command(
    target: str, args: Sequence[str] = (), *, module: bool = False, no_python: bool = False
) -> tuple[str, ...]:
    """The argv each rank runs for a script, a module or a plain executable.

    Args:
        target: A Python script path; with ``module``, a module name (run as
            ``python -m``); with ``no_python``, an executable (on ``PATH`` or
            a path).
        args: Arguments passed to ``target`` untouched.
        module: Run ``target`` as a module.
        no_python: Run ``target`` directly, not with the Python interpreter.

    Returns:
        The argv, with ``sys.executable`` first unless ``no_python``.

    Raises:
        LaunchError: The script or executable does not exist, or the options
            contradict each other.

    >>> rank_command("pkg.train", ["--lr", "3"], module=True)[1:]
    ('-m', 'pkg.train', '--lr', '3')
    >>> try:
    ...     rank_command("no/such/train.py")
    ... except LaunchError as e:
    ...     print(str(e).split(" (")[0])
    script 'no/such/train.py' not found
    """
    args = tuple(args)
    if module and no_python:
        raise LaunchError("module and no_python cannot be combined (a module needs Python)")
    if not target:
        raise LaunchError("no script given: name a Python script, or a module with -m")
    if no_python:
        if shutil.which(target) is None:
            raise LaunchError(
                f"executable {target!r} not found (neither a path nor on PATH); "
                "drop --no-python to run a Python script"
            )
        return (target, *args)
    if not sys.executable:
        raise LaunchError("cannot find the Python interpreter (sys.executable is empty)")
    if module:
        return (sys.executable, "-m", target, *args)
    if not os.path.exists(target):
        hint = (
            f"; to run the module {target!r} use -m"
            if "/" not in target and not target.endswith(".py")
            else ""
        )
        raise LaunchError(f"script {target!r} not found (relative to {os.getcwd()}){hint}")
    return (sys.executable, target, *args)


def validate_ranks(ranks: Iterable[int], world_size: int, what: str) -> frozenset[int]:
    """Check that every rank in ``ranks`` exists in a job of ``world_size``.

    >>> sorted(validate_ranks([0, 2], 4, "log_ranks"))
    [0, 2]
    """
    ranks = tuple(ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise LaunchError(f"{what} must be integers, got {bad!r}")
    out = frozenset(ranks)
    missing = sorted(r for r in out if not 0 <= r < world_size)
    if missing:
        raise LaunchError(
            f"{what}: no rank(s) {missing} in a job of {world_size} rank(s) "
            f"(valid ranks: 0..{world_size - 1})"
        )
    return out
