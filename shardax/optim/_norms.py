"""Norms and finiteness of sharded pytrees, every element counted once.

A Sharded leaf's local sum of squares is summed over the mesh axes that split
its dims, and only those: replicas along the other axes are identical and are
not counted again. Leaves are grouped by (mesh, shard axes, device), so a tree
needs one psum per group, not one per leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..collectives._api import psum
from ..errors import ShardingError
from ..shard._sharded import Sharded
from ._base import Leaf, flatten, leaf_path, local

__all__ = ["all_finite", "global_norm"]


def shard_axes(x: Sharded, path: str) -> tuple[str, ...]:
    """The mesh axes that split ``x``'s dims, in mesh order; a leaf with
    pending sums cannot be measured."""
    if x.partial:
        raise ShardingError(
            f"leaf {path} ({x!r}) holds pending sums over {x.partial}: its norm is not "
            "defined until they are reduced; transfer it to a layout without partial axes "
            "first (e.g. shardax.transfer(g, g.spec), a psum, or psum_scatter for ZeRO-2)"
        )
    used = set(x.spec.axes)
    return tuple(a for a in x.mesh.axis_names if a in used)


def sums_of_squares(
    leaves: Sequence[Leaf], describe: Callable[[int], str] | None = None
) -> list[torch.Tensor]:
    """Each leaf's global sum of squares, as a 0-d fp32 tensor on the leaf's
    device, identical on every rank. ``describe(i)`` names leaf ``i`` in
    messages."""
    if not leaves:
        return []
    locals_ = [local(x) for x in leaves]
    norms = _norms(locals_)
    squares = [n * n for n in norms]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, Sharded):
            axes = shard_axes(x, describe(i) if describe is not None else f"#{i}")
            if axes:
                groups.setdefault((x.mesh, axes, x.device), []).append(i)
    for (mesh, axes, _), idx in groups.items():
        total = psum(torch.stack([squares[i] for i in idx]), axes, mesh=mesh)
        for j, i in enumerate(idx):
            squares[i] = total[j]
    return squares


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for idx in groups.values():
        norms = torch._foreach_norm([tensors[i] for i in idx], 2, dtype=torch.float32)
        for j, i in enumerate(idx):
            out[i] = norms[j]
    return out


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of all the values of a pytree, as a 0-d fp32 tensor.

    For Sharded leaves it is the norm of the *global* tensors: each element
    counts once whatever the layout (sharded leaves are summed over their
    shard axes only; replicated ones are not re-counted), uneven and empty
    shards included; every rank gets the same value. Plain tensors count as
    they are (this rank's values). Leaves with pending (partial) sums raise
    :class:`~shardax.ShardingError`: reduce them first.

    >>> import torch
    >>> from shardax import optim
    >>> optim.global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0])]})
    tensor(5.)
    """
    with torch.no_grad():
        leaves, _ = flatten(tree, "tree")
        if not leaves:
            return torch.zeros((), dtype=torch.float32)
        squares = sums_of_squares(leaves, lambda i: repr(leaf_path(tree, i)))
        device = squares[0].device
        return torch.stack([s.to(device) for s in squares]).sum().sqrt()


def all_finite(tree: Any) -> bool:
    """Whether every value of a pytree is finite — agreed by all ranks: a
    NaN or inf in any rank's shard of a Sharded leaf makes it False on every
    rank (a psum over all axes of each mesh the leaves live on). Plain tensors
    are checked on this rank only.

    >>> import torch
    >>> from shardax import optim
    >>> optim.all_finite({"a": torch.ones(2)}), optim.all_finite([torch.tensor([1.0, float("inf")])])
    (True, False)
    """
    with torch.no_grad():
        leaves, _ = flatten(tree, "tree")
        if not leaves:
            return True
        meshes = []
        for x in leaves:
            if isinstance(x, Sharded) and x.mesh not in meshes:
                meshes.append(x.mesh)
        device = next((x.device for x in leaves if isinstance(x, Sharded)), local(leaves[0]).device)
        bad = torch.stack([(~torch.isfinite(local(x))).any().to(device) for x in leaves]).sum(
            dtype=torch.float32
        )
        for mesh in meshes:
            bad = psum(bad, mesh.axis_names, mesh=mesh)
        return bool(bad.item() == 0)
