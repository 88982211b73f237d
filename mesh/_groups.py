"""Process groups for mesh axes: created collectively on first use, cached per
job, shared by every mesh that views the same ranks."""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..collectives._group import Group, PGState
from ._runtime import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from ._mesh import Mesh

__all__ = ["default_timeout", "group_along"]

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


def group_along(mesh: Mesh, axes: tuple[str, ...]) -> Group:
    """This rank's group along ``axes`` of ``mesh``."""
    label = f"axes {axes!r} of {mesh!r}" if len(axes) != 1 else f"axis {axes[0]!r} of {mesh!r}"
    if mesh.size(axes) == 1 or not dist.is_initialized():
        return Group((mesh.rank,), mesh.rank, None, label)
    cache = _CACHE.setdefault(dist.group.WORLD, {})
    memo = ("group", mesh.axis_names, mesh.axis_sizes, axes, mesh.timeout)
    group = cache.get(memo)
    if group is not None:
        return group
    timeout = mesh.timeout if mesh.timeout is not None else default_timeout()
    blocks = tuple(sorted(tuple(sorted(b)) for b in mesh.groups_along(axes)))
    key = ("pg", blocks, mesh.timeout)
    state = cache.get(key)
    if state is None:
        mine = next(b for b in blocks if mesh.rank in b)
        if len(blocks) == 1 and mesh.timeout is None:
            pg = dist.group.WORLD
        else:
            # Collective: every rank creates every block, in the same order.
            pg = None
            for block in blocks:
                made = dist.new_group(list(block), timeout=timedelta(seconds=timeout))
                if block == mine:
                    pg = made
        state = PGState(pg, mine, timeout)
        cache[key] = state
    group = Group(mesh.ranks_along(axes), mesh.rank, state, label)
    cache[memo] = group
    return group
