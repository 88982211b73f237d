"""Which nodes a job runs on, and what each node is told: pure functions
over text and environments, no process started.

- :func:`parse_hostfile` reads DeepSpeed's hostfile format (``host slots=N``
  per line, ``#`` comments);
- :func:`select_hosts` applies ``--include``/``--exclude``
  (``host1:0,1@host2``);
- :func:`expand_nodelist` expands Slurm's compressed host lists
  (``node[01-03,07],gpu5``) and :func:`slurm_allocation` reads the
  allocation a job step runs in;
- :func:`detect_node` says which node of how many this process is, from
  Slurm, OpenMPI or MPICH (Hydra/PMI) variables;
- :func:`propagated_env` is what every node's ranks get from here: the
  ``.shardax_env`` file, variables with chosen prefixes, and ``--env``.

>>> hosts = parse_hostfile("worker-0 slots=2\\nworker-1 slots=2  # the second box\\n")
>>> select_hosts(hosts, exclude="worker-1:1")
(Host(name='worker-0', slots=(0, 1)), Host(name='worker-1', slots=(0,)))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..errors import LaunchError

__all__ = [
    "PROPAGATED_PREFIXES",
    "Host",
    "NodeInfo",
    "SlurmAllocation",
    "detect_node",
    "expand_nodelist",
    "parse_env_file",
    "parse_hostfile",
    "parse_selection",
    "propagated_env",
    "select_hosts",
    "slurm_allocation",
]

PROPAGATED_PREFIXES = (
    "NCCL_",
    "PYTHON",
    "SHARDAX_",
    "CUDA_",
    "TORCH_",
    "GLOO_",
    "OMP_",
    "MKL_",
    "UCX_",
    "FI_",
    "HF_",
    "TRANSFORMERS_",
    "LD_LIBRARY_PATH",
    "PATH",
    "VIRTUAL_ENV",
)
"""Variables of the launching shell, by name prefix, that every rank on
every node gets (``PATH`` and ``PYTHONPATH`` so the same interpreter and
packages resolve; ``NCCL_``/``GLOO_`` transport settings; …)."""

_HOST = re.compile(r"^[A-Za-z0-9_.\-:\[\]]+$")


def _check_slots(instance: Host, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not value or any(s < 0 for s in value) or len(set(value)) != len(value):
        raise LaunchError(
            f"host {instance.name!r}: slots must be distinct indices >= 0, got {value}"
        )


@attrs.frozen
class Host:
    """A node and the local slots (device indices) ranks run in there.

    >>> Host("worker-0", (0, 1))
    Host(name='worker-0', slots=(0, 1))
    """

    name: str
    slots: tuple[int, ...] = attrs.field(converter=tuple, validator=_check_slots)


def parse_hostfile(text: str, source: str = "hostfile") -> tuple[Host, ...]:
    """Hosts from DeepSpeed's hostfile format: ``hostname slots=N`` per line;
    blank lines and ``#`` comments (whole-line or trailing) are ignored.

    >>> parse_hostfile("# two nodes\\nnode-a slots=2\\n\\nnode-b slots=1\\n")
    (Host(name='node-a', slots=(0, 1)), Host(name='node-b', slots=(0,)))
    >>> parse_hostfile("node-a slots=two")
    Traceback (most recent call last):
    ...
    shardax.errors.LaunchError: hostfile line 1: 'node-a slots=two' is not 'HOST slots=N' with N a positive integer
    """
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if m is None or int(m.group(2)) < 1 or not _HOST.match(m.group(1)):
            raise LaunchError(
                f"{source} line {number}: {raw.strip()!r} is not 'HOST slots=N' with N a "
                "positive integer"
            )
        name = m.group(1)
        if name in seen:
            raise LaunchError(
                f"{source} line {number}: host {name!r} is already listed on line {seen[name]}"
            )
        seen[name] = number
        hosts.append(Host(name, tuple(range(int(m.group(2))))))
    if not hosts:
        raise LaunchError(f"{source} lists no hosts (lines are 'HOST slots=N')")
    return tuple(hosts)


def parse_selection(text: str, what: str) -> dict[str, tuple[int, ...] | None]:
    """``host1:0,1@host2`` → ``{"host1": (0, 1), "host2": None}`` (None: the
    whole host).

    >>> parse_selection("worker-0:0,1@worker-1", "--include")
    {'worker-0': (0, 1), 'worker-1': None}
    """
    out: dict[str, tuple[int, ...] | None] = {}
    for part in text.split("@"):
        name, colon, slots = part.strip().partition(":")
        if not name or not _HOST.match(name) or (colon and not slots):
            raise LaunchError(
                f"{what} {text!r}: {part!r} is not HOST or HOST:SLOT,SLOT "
                "(hosts separated by '@', e.g. 'worker-0:0,1@worker-1')"
            )
        if name in out:
            raise LaunchError(f"{what} {text!r} names host {name!r} twice")
        if colon:
            try:
                out[name] = tuple(int(s) for s in slots.split(","))
            except ValueError:
                raise LaunchError(f"{what} {text!r}: slots of {name!r} must be integers") from None
        else:
            out[name] = None
    return out


def select_hosts(
    hosts: Sequence[Host], include: str | None = None, exclude: str | None = None
) -> tuple[Host, ...]:
    """The hosts (and slots) ``--include`` keeps or ``--exclude`` drops, in
    hostfile order; naming a host or slot the hostfile lacks is an error.

    >>> hosts = (Host("a", (0, 1)), Host("b", (0, 1)))
    >>> select_hosts(hosts, include="b:1")
    (Host(name='b', slots=(1,)),)
    """
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be combined: use one of them")
    text, what = (include, "--include") if include else (exclude, "--exclude")
    if not text:
        return tuple(hosts)
    chosen = parse_selection(text, what)
    known = {h.name: h for h in hosts}
    for name, slots in chosen.items():
        if name not in known:
            raise LaunchError(f"{what}: host {name!r} is not in the hostfile ({', '.join(known)})")
        missing = sorted(set(slots or ()) - set(known[name].slots))
        if missing:
            raise LaunchError(
                f"{what}: host {name!r} has slots {list(known[name].slots)}, not {missing}"
            )
    out = []
    for h in hosts:
        pick = chosen.get(h.name, ...)
        if include:
            if pick is ...:
                continue
            out.append(h if pick is None else Host(h.name, tuple(s for s in h.slots if s in pick)))
        else:
            if pick is None:
                continue
            drop = () if pick is ... else pick
            left = tuple(s for s in h.slots if s not in drop)
            if left:
                out.append(Host(h.name, left))
    if not out:
        raise LaunchError(f"{what} {text!r} leaves no host to run on")
    return tuple(out)


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order.

    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> expand_nodelist("rack[1-2]-n[1-2]")
    ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    names: list[str] = []
    depth, start = 0, 0
    items = []
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if depth < 0:
            break
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth != 0 or any(not item.strip() for item in items):
        raise LaunchError(f"{text!r} is not a Slurm host list such as 'node[01-03,07],gpu5'")
    for item in items:
        names.extend(_expand_one(item.strip(), text))
    return names


def _expand_one(item: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out = []
    for part in m.group(1).split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise LaunchError(f"{whole!r}: {part!r} in {item!r} is not N or N-M")
        width = len(lo)
        for n in range(int(lo), int(hi if dash else lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}", whole))
    return out


def _tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) per node."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise LaunchError(f"SLURM_TASKS_PER_NODE={text!r} is not like '2(x3),1'")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


@attrs.frozen
class SlurmAllocation:
    """The nodes of a Slurm job (or job step) and this process's place in it.

    Attributes:
        hosts: the node names, in Slurm's order (the first is the master).
        node_rank: this node's index (``SLURM_NODEID``), or None outside a step.
        tasks_per_node: Slurm tasks per node, when it says.
        gpus_per_node: GPUs on this node (``SLURM_GPUS_ON_NODE``), when it says.
        job_id: ``SLURM_JOB_ID``.
    """

    hosts: tuple[str, ...]
    node_rank: int | None
    tasks_per_node: tuple[int, ...] | None
    gpus_per_node: int | None
    job_id: str


def slurm_allocation(env: Mapping[str, str]) -> SlurmAllocation | None:
    """The Slurm allocation ``env`` describes, or None outside Slurm. A job
    step's own node list (``SLURM_STEP_NODELIST``) wins over the job's.

    >>> env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1"}
    >>> a = slurm_allocation(env)
    >>> a.hosts, a.node_rank
    (('gpu07', 'gpu08'), 1)
    """
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    if not nodelist or "SLURM_JOB_ID" not in env:
        return None
    hosts = tuple(expand_nodelist(nodelist))
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node_id = env.get("SLURM_NODEID")
    gpus = env.get("SLURM_GPUS_ON_NODE")
    try:
        return SlurmAllocation(
            hosts=hosts,
            node_rank=int(node_id) if node_id is not None else None,
            tasks_per_node=tuple(_tasks_per_node(tasks)) if tasks else None,
            gpus_per_node=int(gpus) if gpus else None,
            job_id=env["SLURM_JOB_ID"],
        )
    except ValueError:
        raise LaunchError(
            f"the Slurm environment is not understood: SLURM_NODEID={node_id!r}, "
            f"SLURM_GPUS_ON_NODE={gpus!r}"
        ) from None


@attrs.frozen
class NodeInfo:
    """Which node this process is (``node_rank`` of ``num_nodes``), and who
    said so."""

    node_rank: int
    num_nodes: int
    source: str


_MPI = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OpenMPI"),
    ("PMI_RANK", "PMI_SIZE", "MPICH (PMI)"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIx"),
)


def detect_node(env: Mapping[str, str]) -> NodeInfo | None:
    """This process's node rank and the node count, from the launcher that
    started it — ``srun`` with one task per node (``SLURM_NODEID`` of
    ``SLURM_NNODES``), ``mpirun`` with one process per node (OpenMPI's
    ``OMPI_COMM_WORLD_RANK``/``SIZE``, MPICH's ``PMI_RANK``/``SIZE``) — or
    None when none did.

    >>> detect_node({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    NodeInfo(node_rank=1, num_nodes=2, source='OpenMPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)')
    """
    for rank, size, source in _MPI:
        if rank in env and size in env:
            return _node(env[rank], env[size], f"{source} ({rank}, {size})")
    if "SLURM_STEP_ID" in env and "SLURM_NODEID" in env:
        nodes = (
            env.get("SLURM_STEP_NUM_NODES")
            or env.get("SLURM_NNODES")
            or env.get("SLURM_JOB_NUM_NODES")
        )
        if nodes is not None:
            return _node(env["SLURM_NODEID"], nodes, "Slurm (SLURM_NODEID, SLURM_NNODES)")
    return None


def _node(rank: str, size: str, source: str) -> NodeInfo:
    try:
        r, n = int(rank), int(size)
    except ValueError:
        raise LaunchError(f"{source}: node rank {rank!r} of {size!r} are not integers") from None
    if not 0 <= r < n:
        raise LaunchError(f"{source}: node rank {r} is not in 0..{n - 1}")
    return NodeInfo(r, n, source)


def parse_env_file(text: str, source: str = ".shardax_env") -> dict[str, str]:
    """``KEY=VALUE`` lines (``export`` allowed, ``#`` comments, values
    optionally quoted) as a dict.

    >>> parse_env_file("# transport\\nNCCL_IB_DISABLE=1\\nexport HF_HOME='/data/hf'\\n")
    {'NCCL_IB_DISABLE': '1', 'HF_HOME': '/data/hf'}
    """
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise LaunchError(f"{source} line {number}: {raw.strip()!r} is not KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def propagated_env(
    environ: Mapping[str, str],
    env_file: Mapping[str, str] | None = None,
    extra: Iterable[str] = (),
    prefixes: Sequence[str] = PROPAGATED_PREFIXES,
) -> dict[str, str]:
    """What every rank on every node gets from the launching shell: the
    variables of ``environ`` whose names start with one of ``prefixes``, then
    the ``.shardax_env`` file's, then ``--env KEY=VAL`` ones (later wins).

    >>> propagated_env({"NCCL_DEBUG": "INFO", "HOME": "/root"}, {"A": "1"}, ["B=2"])
    {'NCCL_DEBUG': 'INFO', 'A': '1', 'B': '2'}
    """
    out = {k: v for k, v in environ.items() if k.startswith(tuple(prefixes))}
    out.update(env_file or {})
    for item in extra:
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise LaunchError(f"--env {item!r} is not KEY=VALUE")
        out[key] = value
    return out
