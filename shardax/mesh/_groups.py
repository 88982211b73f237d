"""Process groups for mesh axes: created collectively on first use, cached per
job, shared by every mesh that views the same ranks."""

from __future__ import annotations

import itertools
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..collectives._agree import checks_enabled
from ..collectives._backend import get_backend
from ..collectives._group import Group, PGState, arrival_grace
from ..errors import MeshError
from ._runtime import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from ._mesh import Mesh

__all__ = ["create_groups", "default_timeout", "group_along"]

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
    (meshes viewing the same ranks share them). Afterwards no collective ever
    creates a group, so rank-local control flow cannot deadlock group creation.
    """
    if not dist.is_initialized() or mesh.world_size == 1:
        return
    cache = _CACHE.setdefault(dist.group.WORLD, {})
    timeout = mesh.timeout if mesh.timeout is not None else default_timeout()
    backend = get_backend()
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
        transport = str(dist.get_backend(pg)) if backend.name == "torch" else backend.name
        cache[key] = PGState(pg, mine, timeout, backend, checks_enabled(transport))
        attach = getattr(backend, "attach", None)
        if attach is not None:  # the shm backend maps the group's segment
            attach(cache[key], dist.distributed_c10d._get_default_store())


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
    if mesh.size(axes) == 1 or not dist.is_initialized():
        return Group((mesh.rank,), mesh.rank, None, label, axes)
    cache = _CACHE.setdefault(dist.group.WORLD, {})
    memo = ("group", mesh.axis_names, mesh.axis_sizes, axes, mesh.timeout)
    group = cache.get(memo)
    if group is None:
        key = _partition_key(mesh, tuple(a for a in axes if mesh.size(a) > 1))
        state = cache.get(key)
        if state is None:
            raise MeshError(
                f"{mesh!r} has no process groups on rank {mesh.rank}: it was built before "
                "torch.distributed was initialized, or in another job; build meshes after shardax.init()"
            )
        group = cache[memo] = Group(mesh.ranks_along(axes), mesh.rank, state, label, axes)
    return group
