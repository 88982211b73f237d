"""Meshes: named axes over a grid of global ranks.

The rank grid is ``arange(world).reshape(sizes)``: the last axis varies
fastest, so keep the axis that talks most (``tp``) last, where its ranks are
neighbours on one node.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from ..errors import MeshError
from . import _context
from ._groups import Group, create_groups, group_along

__all__ = ["AbstractMesh", "Mesh", "current_mesh", "normalize_axes"]

Axes = str | tuple[str, ...]


def normalize_axes(axes: str | Iterable[str] | None) -> tuple[str, ...]:
    """Axis names as a tuple: ``"dp"`` → ``("dp",)``, ``None`` → ``()``.

    >>> normalize_axes("dp"), normalize_axes(("dp", "tp")), normalize_axes(None)
    (('dp',), ('dp', 'tp'), ())
    """
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    try:
        names = tuple(axes)
    except TypeError:
        names = (axes,)  # type: ignore[assignment]
    bad = [a for a in names if not isinstance(a, str)]
    if bad:
        raise MeshError(
            f"mesh axes are names (str) or tuples of names; got {axes!r} "
            "(a tensor dim? collectives take the axis first, then the dim)"
        )
    return names


def unknown_axis(name: object, mesh: AbstractMesh, where: str) -> str:
    """The message for an axis ``mesh`` does not have (with a suggestion)."""
    hint = difflib.get_close_matches(str(name), mesh.axis_names, n=1, cutoff=0.5)
    return (
        f"unknown mesh axis {name!r} in {where}; the mesh {mesh!r} has axes {mesh.axis_names!r}"
        + (f" (did you mean {hint[0]!r}?)" if hint else "")
    )


def _validate_shape(shape: Any, world: int | None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if not isinstance(shape, Mapping) or not shape:
        raise MeshError(
            f"a mesh is a non-empty mapping of axis names to sizes, like {{'dp': 2, 'tp': 2}}; got {shape!r}"
        )
    names, sizes = tuple(shape.keys()), list(shape.values())
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise MeshError(
                f"mesh axis names must be identifiers like 'dp'; got {name!r} in {dict(shape)!r}"
            )
    for name, size in zip(names, sizes, strict=True):
        if not isinstance(size, int | np.integer) or isinstance(size, bool):
            raise MeshError(
                f"mesh axis {name!r} has size {size!r}; sizes are ints in {dict(shape)!r}"
            )
        if size == 0 or size < -1:
            raise MeshError(
                f"mesh axis {name!r} has size {size}; sizes are positive "
                f"(or one -1 for 'what the world size leaves') in {dict(shape)!r}"
            )
    inferred = [i for i, s in enumerate(sizes) if s == -1]
    if len(inferred) > 1:
        raise MeshError(f"at most one mesh axis may have size -1; got {dict(shape)!r}")
    if inferred:
        if world is None:
            raise MeshError(
                f"an AbstractMesh has no world size to infer -1 from; give every size in {dict(shape)!r}"
            )
        rest = math.prod(s for s in sizes if s != -1)
        if world % rest:
            raise MeshError(
                f"mesh {dict(shape)!r} cannot fit world size {world}: the other axes multiply to "
                f"{rest}, which does not divide {world}"
            )
        sizes[inferred[0]] = world // rest
    if world is not None and math.prod(sizes) != world:
        raise MeshError(
            f"mesh {dict(zip(names, sizes, strict=True))!r} has {math.prod(sizes)} ranks but the "
            f"world size is {world}; make the sizes multiply to {world} (or use -1 for one axis)"
        )
    return names, tuple(int(s) for s in sizes)


@attrs.frozen(init=False, repr=False)
class AbstractMesh:
    """Axis names and sizes, no processes: what planning, ``explain``, offline
    resharding and unit tests use.

    Args:
        shape: axis name → size, in grid order (the last axis varies fastest).

    >>> mesh = AbstractMesh({"dp": 4, "tp": 2})
    >>> mesh
    AbstractMesh({'dp': 4, 'tp': 2})
    >>> mesh.size(), mesh.size("tp"), mesh.coords(5)
    (8, 2, {'dp': 2, 'tp': 1})
    >>> mesh.ranks_along("dp", rank=5)
    (1, 3, 5, 7)
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    def __init__(self, shape: Mapping[str, int]) -> None:
        names, sizes = _validate_shape(shape, world=None)
        self.__attrs_init__(names, sizes)

    # -- shape ---------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """Axis name → size (a fresh dict)."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    @property
    def abstract(self) -> AbstractMesh:
        """The mesh without processes."""
        return AbstractMesh(self.shape)

    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh."""
        return math.prod(self.axis_sizes)

    def __contains__(self, axis: object) -> bool:
        return axis in self.axis_names

    def check_axes(
        self, axes: str | Iterable[str] | None, *, what: str = "axes"
    ) -> tuple[str, ...]:
        """Normalize ``axes`` and check each names an axis of this mesh, once.

        >>> AbstractMesh({"dp": 2}).check_axes("dq")
        Traceback (most recent call last):
        ...
        shardax.errors.MeshError: unknown mesh axis 'dq' in axes ('dq',); the mesh AbstractMesh({'dp': 2}) has axes ('dp',) (did you mean 'dp'?)
        """
        names = normalize_axes(axes)
        for name in names:
            if name not in self.axis_names:
                raise MeshError(unknown_axis(name, self, f"{what} {names!r}"))
        if len(set(names)) != len(names):
            raise MeshError(f"mesh axis repeated in {what} {names!r} of mesh {self!r}")
        return names

    def size(self, axes: str | Iterable[str] | None = None) -> int:
        """Number of ranks along ``axes`` (all axes when None)."""
        if axes is None:
            return self.world_size
        return math.prod(self.axis_sizes[self.axis_names.index(a)] for a in self.check_axes(axes))

    @property
    def rank_grid(self) -> np.ndarray:
        """``arange(world).reshape(sizes)``."""
        return np.arange(self.world_size).reshape(self.axis_sizes)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` on each axis."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is not in mesh {self!r} (ranks 0..{self.world_size - 1})")
        idx = np.unravel_index(rank, self.axis_sizes)
        return {a: int(i) for a, i in zip(self.axis_names, idx, strict=True)}

    def axis_index(self, axes: str | Iterable[str], rank: int) -> int:
        """Index of ``rank`` along ``axes`` (mixed radix, first axis major)."""
        names = self.check_axes(axes)
        c = self.coords(rank)
        index = 0
        for a in names:
            index = index * self.axis_sizes[self.axis_names.index(a)] + c[a]
        return index

    def ranks_along(self, axes: str | Iterable[str], rank: int) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only along ``axes``, in member
        order (mixed radix over ``axes``, first axis major)."""
        names = self.check_axes(axes)
        c = self.coords(rank)
        grid = self.rank_grid
        index = tuple(slice(None) if a in names else c[a] for a in self.axis_names)
        sub = grid[index]  # remaining dims are the named axes, in mesh order
        kept = [a for a in self.axis_names if a in names]
        sub = np.transpose(sub, [kept.index(a) for a in names])
        return tuple(int(r) for r in sub.reshape(-1))

    def groups_along(self, axes: str | Iterable[str]) -> tuple[tuple[int, ...], ...]:
        """Every group of ranks along ``axes`` (the partition of the world),
        each in member order, ordered by their first rank.

        >>> AbstractMesh({"dp": 2, "tp": 2}).groups_along("dp")
        ((0, 2), (1, 3))
        """
        names = self.check_axes(axes)
        others = [i for i, a in enumerate(self.axis_names) if a not in names]
        order = others + [self.axis_names.index(a) for a in names]
        blocks = np.transpose(self.rank_grid, order).reshape(-1, self.size(names) if names else 1)
        return tuple(sorted(tuple(int(r) for r in b) for b in blocks))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shape!r})"


@attrs.frozen(init=False, repr=False)
class Mesh(AbstractMesh):
    """A mesh over the live ranks of this job.

    Build it on every rank, after :func:`shardax.init` (world size 1 needs no
    init), and build the same meshes in the same order on every rank: that is
    when the process groups of every set of its axes are created —
    collectively, once per job, shared by meshes that view the same ranks — so
    that no collective ever has to create one. One axis may be ``-1``: it
    takes what the world size leaves.

    Args:
        shape: axis name → size, in grid order (last axis fastest).
        timeout: seconds a collective on this mesh may wait before it raises
            :class:`~shardax.errors.CollectiveTimeoutError`; None → the
            timeout given to :func:`shardax.init`.

    >>> mesh = Mesh({"dp": -1})          # world size 1 here
    >>> mesh, mesh.rank, mesh.axis_index("dp")
    (Mesh({'dp': 1}), 0, 0)
    >>> with mesh:
    ...     current_mesh() is mesh
    True
    """

    timeout: float | None = attrs.field(eq=False)
    rank: int = attrs.field(eq=False)
    members: tuple[int, ...] | None = attrs.field(default=None)

    def __init__(self, shape: Mapping[str, int], *, timeout: float | None = None) -> None:
        rank, world = _process_rank_and_world()
        names, sizes = _validate_shape(shape, world=world)
        if timeout is not None and not timeout > 0:
            raise MeshError(f"timeout must be positive seconds; got {timeout!r}")
        self.__attrs_init__(names, sizes, timeout, rank)
        create_groups(self)

    def global_rank(self, rank: int | None = None) -> int:
        """The job rank of grid position ``rank`` (this rank's when None):
        the same number on a mesh over the whole job; on a :meth:`submesh`,
        its ``members[rank]``."""
        at = self.rank if rank is None else rank
        return at if self.members is None else self.members[at]

    def submesh(self, axes: str | Iterable[str]) -> Mesh:
        """The mesh of this rank's group along ``axes`` (the other axes held
        at this rank's coordinates): torch's ``device_mesh["dp", "tp"]``. Its
        grid positions are its own (``rank`` is this rank's position there,
        ``members`` the job ranks in grid order) and its process groups are
        this mesh's, made when this mesh was built: no communication, no
        group created. A pipeline stage's parameters live on the submesh of
        the axes other than ``pp``.

        >>> Mesh({"dp": 1, "pp": 1}).submesh("dp")
        Mesh({'dp': 1}, members=(0,))
        """
        names = self.check_axes(axes)
        members = tuple(self.global_rank(r) for r in self.ranks_along(names))
        sizes = tuple(self.size(a) for a in names)
        sub = Mesh.__new__(Mesh)
        sub.__attrs_init__(names, sizes, self.timeout, members.index(self.global_rank()), members)
        return sub

    def __repr__(self) -> str:
        if self.members is None:
            return super().__repr__()
        return f"Mesh({self.shape!r}, members={self.members!r})"

    def axis_index(self, axes: str | Iterable[str], rank: int | None = None) -> int:  # type: ignore[override]
        """This rank's index along ``axes`` (mixed radix, first axis major)."""
        return super().axis_index(axes, self.rank if rank is None else rank)

    def ranks_along(self, axes: str | Iterable[str], rank: int | None = None) -> tuple[int, ...]:  # type: ignore[override]
        """The ranks of this rank's group along ``axes``, in member order."""
        return super().ranks_along(axes, self.rank if rank is None else rank)

    def view(self, shape: Mapping[str, int]) -> Mesh:
        """Another named view of the same ranks (e.g. an expert ``ep`` view of a
        dense ``dp×tp`` mesh); its groups are shared with other views."""
        return Mesh(shape, timeout=self.timeout)

    def group(self, axes: str | Iterable[str]) -> Group:
        """The collective group of this rank along ``axes`` (member order:
        mixed radix over ``axes``, first axis major). Local: no communication."""
        return group_along(self, self.check_axes(axes))

    def __enter__(self) -> Mesh:
        _context.push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _context.pop()


def current_mesh() -> Mesh | None:
    """The mesh of the innermost ``with mesh:`` block, or None.

    >>> current_mesh() is None
    True
    """
    return _context.current()


def _process_rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    from ..errors import LaunchError
    from ._runtime import detect_env

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        env = detect_env()
        world, source = (env.world_size, env.source) if env else (1, "")
    except LaunchError as err:
        world, source = 2, f"a launcher ({err})"
    if world > 1:
        raise MeshError(
            f"this process was launched as one of {world} ranks (by {source}) but "
            "torch.distributed is not initialized; call shardax.init() before building a Mesh"
        )
    return 0, 1
