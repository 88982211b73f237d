"""Process groups for mesh axes: the ranks along some axes as one rank sees
them (:class:`Group`), the torch process group that connects them
(:class:`PGState`) — created collectively when a :class:`~shardax.mesh.Mesh`
is built, cached per job, shared by every mesh that views the same ranks.

The mesh knows axes, ranks and groups; what a layer above keeps per process
group (the collectives layer: its backend, its shared-memory segment, its
count of collectives) it attaches when the group is made, through the
:class:`GroupSetup` it hands to :func:`set_group_setup`. The mesh imports
nothing of it.
"""

from __future__ import annotations

import itertools
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ..errors import MeshError
from ._runtime import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from ._mesh import Mesh

__all__ = [
    "Group",
    "GroupSetup",
    "PGState",
    "arrival_grace",
    "create_groups",
    "default_timeout",
    "forget_groups",
    "group_along",
    "set_group_setup",
]


def arrival_grace(timeout: float) -> float:
    """Seconds of a collective's ``timeout`` kept for naming the ranks that
    did not arrive (through the store) once the transport gave up.

    >>> arrival_grace(2.0), arrival_grace(600.0)
    (0.4, 5.0)
    """
    return min(5.0, 0.2 * timeout)


class PGState:
    """One torch process group of a mesh: its ranks, its timeout, and what
    the layer above attached to it when it was made (``comm``: the
    collectives layer's state for this group; None until then).

    Every member of the group holds one, made at the same point of the same
    mesh build, so a layer above can keep per-group state in step across
    ranks (a count of the collectives issued on it names a collective on
    every rank).
    """

    __slots__ = ("comm", "pg", "ranks", "timeout")

    def __init__(self, pg: Any, ranks: tuple[int, ...], timeout: float, comm: Any = None) -> None:
        self.pg = pg
        self.ranks = ranks  # sorted global ranks: torch's group rank order
        self.timeout = timeout
        self.comm = comm

    @property
    def wait(self) -> float:
        """How long the transport waits before it gives up: the timeout less
        the :func:`arrival_grace` spent finding out who did not arrive, so
        that the error comes within the timeout."""
        return self.timeout - arrival_grace(self.timeout)


class Group:
    """The ranks of one mesh-axis group, in member order, as seen by one rank.

    ``members[i]`` is the global rank of member ``i`` (mixed radix over the
    axes, first axis major); ``index`` is this rank's member index. A group of
    one member has no process group: every collective on it is local.
    """

    __slots__ = ("_torch_ranks", "axes", "index", "label", "members", "rank", "state")

    def __init__(
        self,
        members: tuple[int, ...],
        rank: int,
        state: PGState | None,
        label: str,
        axes: tuple[str, ...] = (),
    ) -> None:
        self.axes = axes
        self.members = members
        self.rank = rank
        self.index = members.index(rank)
        self.state = state
        self.label = label
        if state is None:
            self._torch_ranks: tuple[int, ...] | None = None
        else:
            order = tuple(state.ranks.index(r) for r in members)
            self._torch_ranks = None if order == tuple(range(len(members))) else order

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def pg(self) -> Any:
        return None if self.state is None else self.state.pg

    @property
    def in_torch_order(self) -> bool:
        """Whether member ``i`` is torch group rank ``i`` (true unless the axes
        were named out of mesh order)."""
        return self._torch_ranks is None

    def torch_rank(self, member: int) -> int:
        """Torch's group rank of member ``member``."""
        return member if self._torch_ranks is None else self._torch_ranks[member]

    def member_of_torch_rank(self, group_rank: int) -> int:
        return group_rank if self._torch_ranks is None else self._torch_ranks.index(group_rank)

    def __repr__(self) -> str:
        return f"<Group {self.label} members={self.members} index={self.index}>"


class GroupSetup(Protocol):
    """What a layer above the mesh does with each process group the mesh
    makes: ``setup(state)`` returns what it keeps for the group (stored as
    ``state.comm``).

    It is called right after the group is made, on every rank, in the same
    order (the order every rank builds its meshes in, which
    :func:`create_groups` checks), so a setup that is itself collective —
    mapping a shared-memory segment among the group's members — runs in step
    on all of them and cannot deadlock; and never inside a collective, where
    rank-local control flow could skip it.
    """

    def __call__(self, state: PGState) -> Any: ...


_SETUP: list[GroupSetup] = []  # the one setup (the collectives layer's), once it is imported


def set_group_setup(setup: GroupSetup) -> None:
    """Have ``setup`` attach its state to every process group made from now
    on (the collectives layer does, when it is imported: ``import shardax``
    wires the layers so). A second, different setup is an error: groups
    are shared by every mesh, so one layer owns what hangs on them."""
    if _SETUP and _SETUP[0] is not setup:
        raise MeshError(
            f"process groups already get their state from {_SETUP[0]!r}; cannot also use {setup!r}"
        )
    _SETUP[:] = [setup]


# Keyed by the job's default process group, so a new job (init after
# shutdown) starts with an empty cache. Values: partition key -> PGState, and
# (mesh, axes) -> Group.
_CACHE: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def default_timeout() -> float:
    """The default process group's timeout, in seconds."""
    if not (dist.is_available() and dist.is_initialized()):
        return DEFAULT_TIMEOUT
    pg = dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return pg._get_backend(device).options._timeout.total_seconds()
        except Exception:
            continue
    return DEFAULT_TIMEOUT


def _partition_key(mesh: Mesh, axes: tuple[str, ...]) -> tuple[Any, ...]:
    blocks = tuple(sorted(tuple(sorted(b)) for b in mesh.groups_along(axes)))
    return ("pg", blocks, mesh.timeout)


def forget_groups() -> None:
    """Drop every cached group of this job (``shutdown`` does, before
    destroying the process groups: the cache's values hold the groups, and
    held groups would be torn down only with the interpreter — where gloo's
    threads can abort the process)."""
    if dist.is_available() and dist.is_initialized():
        _CACHE.pop(dist.group.WORLD, None)


def create_groups(mesh: Mesh) -> None:
    """Create the process groups of every set of ``mesh``'s axes that has more
    than one rank: collectively (every rank calls this, for the same meshes,
    in the same order — building a Mesh does), in a fixed order, once per job
    (meshes viewing the same ranks share them), each set up by the
    :class:`GroupSetup` of :func:`set_group_setup` as soon as it is made.
    Afterwards no collective ever creates a group, so rank-local control
    flow cannot deadlock group creation.
    """
    if not dist.is_initialized() or mesh.world_size == 1:
        return
    cache = _CACHE.setdefault(dist.group.WORLD, {})
    timeout = mesh.timeout if mesh.timeout is not None else default_timeout()
    names = [a for a, n in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if n > 1]
    combos = [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]
    if any(_partition_key(mesh, axes) not in cache for axes in combos):
        builds = cache["builds"] = cache.get("builds", 0) + 1
        _everyone_builds(mesh, builds, timeout)
    for axes in combos:
        key = _partition_key(mesh, axes)
        if key in cache:
            continue
        blocks = key[1]
        mine = next(b for b in blocks if mesh.rank in b)
        # Every group gets its own process group, whose transport gives up
        # early enough to name the missing ranks within the timeout.
        wait = timeout - arrival_grace(timeout)
        pg = None
        for block in blocks:
            try:
                made = dist.new_group(list(block), timeout=timedelta(seconds=wait))
            except Exception as err:
                raise MeshError(
                    f"creating the process groups of {mesh!r} failed on rank {mesh.rank} "
                    f"({err}); every rank must build the same meshes, in the same order"
                ) from err
            if block == mine:
                pg = made
        state = PGState(pg, mine, timeout)
        for setup in _SETUP:  # in step on every rank: see GroupSetup
            state.comm = setup(state)
        cache[key] = cache[_block_key(mine, mesh.timeout)] = state


def _everyone_builds(mesh: Mesh, build: int, timeout: float) -> None:
    """Every rank arrives at the same mesh build (the ``build``-th that makes
    groups), within ``timeout``: else a :class:`MeshError` naming the ranks
    that never came, or that built another mesh — before any process group
    is made (a raw store timeout names no one)."""
    store = dist.distributed_c10d._get_default_store()
    key = f"shardax/mesh-build/{build}"
    mine = repr(mesh)
    store.set(f"{key}/{mesh.rank}", mine)
    others = [f"{key}/{r}" for r in range(mesh.world_size)]
    deadline = time.monotonic() + timeout
    missing = list(range(mesh.world_size))
    while missing:
        missing = [r for r in missing if not store.check([others[r]])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    built = {r: store.get(others[r]).decode() for r in range(mesh.world_size) if r not in missing}
    differ = {r: m for r, m in built.items() if m != mine}
    if missing or differ:
        parts = []
        if missing:
            parts.append(f"ranks {missing} did not build a mesh within {timeout:g} s")
        if differ:
            parts.append("; ".join(f"rank {r} built {m}" for r, m in sorted(differ.items())))
        raise MeshError(
            f"building {mine} (mesh build #{build} on rank {mesh.rank}): {'; '.join(parts)}. "
            "Every rank must build the same meshes, in the same order (a rank that died, "
            "returned early or took a rank-dependent branch before building it causes this)."
        )


def group_along(mesh: Mesh, axes: tuple[str, ...]) -> Group:
    """This rank's group along ``axes`` of ``mesh`` (no communication)."""
    label = f"axes {axes!r} of {mesh!r}" if len(axes) != 1 else f"axis {axes[0]!r} of {mesh!r}"
    me = mesh.global_rank()
    if mesh.size(axes) == 1 or not dist.is_initialized():
        return Group((me,), me, None, label, axes)
    cache = _CACHE.setdefault(dist.group.WORLD, {})
    memo = ("group", mesh.axis_names, mesh.axis_sizes, mesh.members, axes, mesh.timeout)
    group = cache.get(memo)
    if group is None:
        members = tuple(mesh.global_rank(r) for r in mesh.ranks_along(axes))
        state = cache.get(_block_key(members, mesh.timeout))
        if state is None:
            raise MeshError(
                f"{mesh!r} has no process groups on rank {me}: it was built before "
                "torch.distributed was initialized, or in another job; build meshes after shardax.init()"
            )
        group = cache[memo] = Group(members, me, state, label, axes)
    return group


def _block_key(members: tuple[int, ...], timeout: float | None) -> tuple[Any, ...]:
    """The cache key of the process group of exactly the ranks ``members``
    (any order), made by whichever mesh made it first."""
    return ("block", tuple(sorted(members)), timeout)
