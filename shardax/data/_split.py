"""A global batch split over the data axes of a mesh.

The data axes are the axes of a batch spec's only entry (``P("dp")``,
``P(("dp", "sp"))``): dim 0 of every batch leaf is split over them with the
same chunk semantics as any other spec (:class:`~shardax.NamedSharding`), so
ranks that differ only along other axes (``tp``) hold identical data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import optree
import torch

from .._tree import flatten_with_paths
from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, Mesh
from ..shard._spec import NamedSharding, P, PartitionSpec, as_spec

__all__ = ["BATCH_SPEC", "BatchSplit", "shard_batch", "shard_batches"]

BATCH_SPEC = P("dp")  # the default: examples split over "dp"


class BatchSplit:
    """One rank's part of dim 0 under a batch spec (internal helper).

    Checks the spec (one entry, axes of the mesh) and the rank once; then
    :meth:`bounds` gives ``[start, stop)`` of this rank's examples for any
    global batch size.
    """

    def __init__(self, mesh: AbstractMesh, spec: Any, rank: int | None) -> None:
        if not isinstance(mesh, AbstractMesh):
            raise ShardingError(
                f"expected a Mesh or AbstractMesh to split the batch over; got {mesh!r}"
            )
        spec = as_spec(spec)
        if any(e is not None for e in spec.entries[1:]):
            raise ShardingError(
                f"a batch spec has one entry, the data axes that split dim 0 (the examples); got "
                f"{spec!r} on {mesh!r}. Use P({spec.entries[0]!r}) (a tuple entry splits the "
                "examples over several axes) and split other dims, e.g. the sequence, of the "
                "local batch yourself"
            )
        self.sharding = NamedSharding(mesh, P(spec.entries[0]) if spec.entries else P())
        self.spec: PartitionSpec = self.sharding.spec
        self.axes: tuple[str, ...] = self.sharding.spec.axes
        self.size = mesh.size(self.axes) if self.axes else 1
        self.rank = _resolve_rank(mesh, rank)

    def describe(self) -> str:
        """The data axes, their sizes and the mesh, for messages."""
        mesh = self.sharding.mesh
        sizes = tuple(mesh.size(a) for a in self.axes)
        return f"the data axes {self.axes!r} of sizes {sizes} ({self.size} ranks) of {mesh!r}"

    def check_divisible(self, global_batch_size: int, what: str = "global batch") -> None:
        """Raise :class:`ShardingError` unless the batch splits evenly."""
        if global_batch_size % self.size:
            n = self.size
            lower, upper = global_batch_size // n * n, (global_batch_size // n + 1) * n
            choices = f"{lower} or {upper}" if lower else f"{upper}"
            raise ShardingError(
                f"{what} of {global_batch_size} examples does not split evenly over "
                f"{self.describe()}; use a global batch size that is a multiple of {n} "
                f"(e.g. {choices}), or a mesh whose data axes divide {global_batch_size}"
            )

    def bounds(self, global_batch_size: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's examples (chunk semantics)."""
        return self.sharding.local_bounds((global_batch_size,), self.rank)[0]


def _resolve_rank(mesh: AbstractMesh, rank: int | None) -> int:
    if rank is None:
        if isinstance(mesh, Mesh):
            return mesh.rank
        raise ShardingError(
            f"{mesh!r} is an AbstractMesh: it has no rank of its own; pass rank= (0.."
            f"{mesh.world_size - 1}) to say whose part you want, or use a live Mesh"
        )
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < mesh.world_size:
        raise ShardingError(f"rank {rank!r} is not in {mesh!r} (ranks 0..{mesh.world_size - 1})")
    return rank


def shard_batch(
    batch: Any, mesh: AbstractMesh, spec: PartitionSpec = BATCH_SPEC, *, rank: int | None = None
) -> Any:
    """This rank's part of a global batch: dim 0 of every tensor split over the
    data axes of ``spec``.

    Every rank passes the same global batch and keeps its own rows (a view, no
    communication). Ranks that differ only along axes ``spec`` does not name
    get the same rows. Leaves that are not tensors pass through unchanged.

    Args:
        batch: a pytree of tensors, all with the global batch size on dim 0.
        mesh: the mesh (a live one, or an :class:`~shardax.AbstractMesh` with
            ``rank``).
        spec: one entry: the axes splitting the examples, e.g. ``P("dp")`` or
            ``P(("dp", "sp"))``.
        rank: whose part (default: this process's rank on a live mesh).

    Raises:
        ShardingError: the batch size does not split evenly over the data
            axes, leaves disagree on it, or the spec does not fit the mesh.

    >>> import torch, shardax as sx
    >>> batch = {"x": torch.arange(8).reshape(4, 2), "y": torch.arange(4)}
    >>> sx.data.shard_batch(batch, sx.Mesh({"dp": 1}))["y"]
    tensor([0, 1, 2, 3])
    >>> mesh = sx.AbstractMesh({"dp": 2, "tp": 2})
    >>> [sx.data.shard_batch(batch, mesh, rank=r)["y"].tolist() for r in range(4)]
    [[0, 1], [0, 1], [2, 3], [2, 3]]
    """
    split = BatchSplit(mesh, spec, rank)
    paths, leaves, treespec = flatten_with_paths(batch)
    sizes = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ShardingError(
                    f"batch leaf {path or '<root>'!r} is a scalar tensor; every tensor in a batch "
                    "has the examples on dim 0"
                )
            sizes[path or "<root>"] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        raise ShardingError(
            f"the leaves of the batch disagree on its size (dim 0): {sizes}; every leaf holds "
            "the same examples"
        )
    if not sizes:
        return batch
    global_batch_size = next(iter(sizes.values()))
    split.check_divisible(global_batch_size)
    start, stop = split.bounds(global_batch_size)
    out = [x[start:stop] if isinstance(x, torch.Tensor) else x for x in leaves]
    return optree.tree_unflatten(treespec, out)


def shard_batches(
    batches: Iterable[Any],
    mesh: AbstractMesh,
    spec: PartitionSpec = BATCH_SPEC,
    *,
    rank: int | None = None,
) -> Iterator[Any]:
    """:func:`shard_batch` of each global batch, lazily.

    Every rank iterates the same global batches (same data, same order) and
    gets its own part of each. To have each rank *load* only its part, use
    :class:`Sampler` instead.

    >>> import torch, shardax as sx
    >>> loader = [{"x": torch.arange(4)}, {"x": torch.arange(4, 8)}]
    >>> mesh = sx.AbstractMesh({"dp": 2})
    >>> [b["x"].tolist() for b in sx.data.shard_batches(loader, mesh, rank=1)]
    [[2, 3], [6, 7]]
    """
    BatchSplit(mesh, spec, rank)  # a bad mesh, spec or rank fails here, not at the first batch
    return (shard_batch(batch, mesh, spec, rank=rank) for batch in batches)
