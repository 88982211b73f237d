"""A global batch split over the data axes of a mesh.

The data axes are the axes of a batch spec's first entry (``P("dp")``,
``P(("dp", "sp"))``): dim 0 of every batch leaf is split over them with the
same chunk semantics as any other spec (:class:`~shardax.NamedSharding`), so
ranks that differ only along other axes (``tp``) hold identical data. A
second entry splits dim 1, the sequence, of every leaf with two dims or more
(context parallelism): over axes in equal contiguous chunks
(``P("dp", "cp")``), or head–tail (``P("dp", zigzag("cp"))``, see
:func:`~shardax.zigzag`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import optree
import torch

from .._tree import flatten_with_paths
from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, Mesh
from ..shard._ring_modes import SEQUENCE_SPLIT
from ..shard._spec import (
    Blocks,
    NamedSharding,
    P,
    PartitionSpec,
    Zigzag,
    as_spec,
    dim_bounds,
    zigzag_bounds,
)

__all__ = ["BATCH_SPEC", "BatchSplit", "shard_batch", "shard_batches"]

BATCH_SPEC = P("dp")  # the default: examples split over "dp"


class BatchSplit:
    """One rank's part of a batch under a batch spec (internal helper).

    Checks the spec (one or two entries, axes of the mesh) and the rank once;
    then :meth:`bounds` gives ``[start, stop)`` of this rank's examples for
    any global batch size, :meth:`seq_bounds` the chunks of the sequence
    (dim 1) it keeps — the global positions of its tokens, which ring
    attention needs for its causal mask — and :meth:`split_sequence` cuts
    them out of a batch.

    >>> import shardax as sx
    >>> split = BatchSplit(sx.AbstractMesh({"dp": 2, "cp": 2}), sx.P("dp", sx.zigzag("cp")), 1)
    >>> split.bounds(4), split.seq_bounds(8), split.seq_axes, split.zigzag
    ((0, 2), ((2, 4), (4, 6)), ('cp',), True)
    """

    def __init__(self, mesh: AbstractMesh, spec: Any, rank: int | None) -> None:
        if not isinstance(mesh, AbstractMesh):
            raise ShardingError(
                f"expected a Mesh or AbstractMesh to split the batch over; got {mesh!r}"
            )
        spec = as_spec(spec)
        entries = spec.entries
        examples = entries[0] if entries else None
        sequence = entries[1] if len(entries) > 1 else None
        if any(e is not None for e in entries[2:]):
            raise ShardingError(
                f"a batch spec has at most two entries: the data axes that split dim 0 (the "
                f"examples), then the axes that split dim 1 (the sequence); got {spec!r} on "
                f"{mesh!r}. Use P({examples!r}, {sequence!r}) (a tuple entry splits a dim over "
                "several axes) and split other dims of the local batch yourself"
            )
        if isinstance(examples, Blocks | Zigzag):
            raise ShardingError(
                f"dim 0 of a batch, the examples, is split over axes in plain chunks; got "
                f"{examples!r} in {spec!r} on {mesh!r}. A zigzag split is for the sequence, the "
                "second entry: P('dp', zigzag('cp'))"
            )
        if isinstance(sequence, Blocks):
            raise ShardingError(
                f"dim 1 of a batch, the sequence, is split over axes (contiguous chunks) or "
                f"zigzag(axes); got {sequence!r} in {spec!r} on {mesh!r}"
            )
        whole = P(examples, sequence) if sequence is not None else P(*entries[:1])
        self.spec: PartitionSpec = NamedSharding(mesh, whole).spec  # checks the axes
        self.sharding = NamedSharding(mesh, P(*entries[:1]))  # dim 0
        self.axes: tuple[str, ...] = self.sharding.spec.axes
        self.size = mesh.size(self.axes) if self.axes else 1
        self.rank = _resolve_rank(mesh, rank)
        self.seq_axes: tuple[str, ...] = P(sequence).axes
        """The axes splitting the sequence (dim 1); ``()``: not split."""
        self.seq_size = mesh.size(self.seq_axes) if self.seq_axes else 1
        self.zigzag = isinstance(sequence, Zigzag)
        """Whether the sequence is split head–tail (two chunks per rank)."""

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

    def seq_bounds(self, seq_len: int, path: str = "") -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` of each chunk of a sequence of ``seq_len`` this
        rank keeps, in the order it holds them: ``(0, seq_len)`` when the
        spec does not split it, one chunk for axes, two for a zigzag split.

        Raises:
            ShardingError: ``seq_len`` does not split evenly (``path``, the
                leaf, makes the message more precise).
        """
        mesh, n = self.sharding.mesh, self.seq_size
        if not self.seq_axes:
            return ((0, seq_len),)
        index = mesh.axis_index(self.seq_axes, self.rank)
        where = f"batch leaf {path!r}: " if path else ""
        sizes = tuple(mesh.size(a) for a in self.seq_axes)
        axes = f"the sequence axes {self.seq_axes!r} of sizes {sizes} ({n} ranks) of {mesh!r}"
        if self.zigzag:
            try:
                return zigzag_bounds(seq_len, n, index)
            except ShardingError as err:
                raise ShardingError(
                    f"{where}the sequence (dim 1) of {seq_len} does not split zigzag over {axes} "
                    f"under {self.spec!r}: {err}"
                ) from None
        if seq_len % n:
            lower, upper = seq_len // n * n, (seq_len // n + 1) * n
            choices = f"{lower} or {upper}" if lower else f"{upper}"
            raise ShardingError(
                f"{where}the sequence (dim 1) of {seq_len} does not split evenly over {axes} "
                f"under {self.spec!r}; use a sequence length that is a multiple of {n} (e.g. "
                f"{choices}): pad or trim it"
            )
        return (dim_bounds(seq_len, [n], [index]),)

    def cut_sequence(self, x: torch.Tensor, path: str = "") -> torch.Tensor:
        """This rank's part of dim 1 of ``x`` (a batch leaf of two dims or
        more; others, and every leaf when the sequence is not split, are
        returned as they are): a view of one chunk, or the two chunks of a
        zigzag split concatenated (a copy — a view where they touch: the
        middle rank's, or a single member's)."""
        if x.dim() < 2:
            return x
        if not self.seq_axes:
            return _marked(x[:], ((), None))
        chunks = self.seq_bounds(x.shape[1], path)
        if len(chunks) == 2 and chunks[0][1] == chunks[1][0]:  # they touch (the middle member)
            chunks = ((chunks[0][0], chunks[1][1]),)
        if len(chunks) == 1:
            piece = x[:, chunks[0][0] : chunks[0][1]]
        else:
            piece = torch.cat([x[:, a:b] for a, b in chunks], dim=1)
        return _marked(piece, (self.seq_axes, "zigzag" if self.zigzag else "contiguous"))

    def split_sequence(self, batch: Any) -> Any:
        """``batch`` (a pytree) with dim 1 of every tensor of two dims or more
        cut to this rank's part (:meth:`cut_sequence`)."""
        paths, leaves, treespec = flatten_with_paths(batch)
        out = [
            self.cut_sequence(x, path or "<root>") if isinstance(x, torch.Tensor) else x
            for path, x in zip(paths, leaves, strict=True)
        ]
        return optree.tree_unflatten(treespec, out)


def _marked(x: torch.Tensor, split: tuple[tuple[str, ...], str | None]) -> torch.Tensor:
    """``x``, marked with how its sequence was cut (``SEQUENCE_SPLIT``)."""
    setattr(x, SEQUENCE_SPLIT, split)
    return x


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
    data axes of ``spec`` — and, with a second entry, dim 1 (the sequence)
    of every tensor of two dims or more split over its axes.

    Every rank passes the same global batch and keeps its own rows (a view, no
    communication). Ranks that differ only along axes ``spec`` does not name
    get the same data. Leaves that are not tensors pass through unchanged, and
    leaves of one dim (a value per example) keep it whole.

    The sequence splits as ``P("dp", "cp")`` says, in equal contiguous chunks
    (a view), or as ``P("dp", zigzag("cp"))`` says, head–tail for causal ring
    attention: of ``2·n`` equal chunks over ``n`` ranks, rank ``i`` keeps
    chunks ``i`` and ``2·n-1-i``, concatenated (a copy, or a view where they
    touch; see :func:`~shardax.zigzag`).

    Args:
        batch: a pytree of tensors, all with the global batch size on dim 0
            (and, with a sequence entry, the sequence on dim 1 of those with
            two dims or more).
        mesh: the mesh (a live one, or an :class:`~shardax.AbstractMesh` with
            ``rank``).
        spec: one or two entries: the axes splitting the examples, e.g.
            ``P("dp")`` or ``P(("dp", "sp"))``; then the axes splitting the
            sequence, e.g. ``P("dp", "cp")`` or ``P("dp", zigzag("cp"))``.
        rank: whose part (default: this process's rank on a live mesh).

    Raises:
        ShardingError: the batch size does not split evenly over the data
            axes, leaves disagree on it, a sequence does not split evenly
            (zigzag: into ``2·n`` chunks), or the spec does not fit the mesh.

    >>> import torch, shardax as sx
    >>> batch = {"x": torch.arange(8).reshape(4, 2), "y": torch.arange(4)}
    >>> sx.data.shard_batch(batch, sx.Mesh({"dp": 1}))["y"]
    tensor([0, 1, 2, 3])
    >>> mesh = sx.AbstractMesh({"dp": 2, "tp": 2})
    >>> [sx.data.shard_batch(batch, mesh, rank=r)["y"].tolist() for r in range(4)]
    [[0, 1], [0, 1], [2, 3], [2, 3]]

    The sequence too, zigzag over ``cp`` (rank 1 is ``dp`` 0, ``cp`` 1):

    >>> tokens = {"x": torch.arange(16).reshape(2, 8), "id": torch.arange(2)}
    >>> mesh, spec = sx.AbstractMesh({"dp": 2, "cp": 2}), sx.P("dp", sx.zigzag("cp"))
    >>> [sx.data.shard_batch(tokens, mesh, spec, rank=r)["x"].tolist() for r in range(4)]
    [[[0, 1, 6, 7]], [[2, 3, 4, 5]], [[8, 9, 14, 15]], [[10, 11, 12, 13]]]
    >>> sx.data.shard_batch(tokens, mesh, sx.P("dp", "cp"), rank=1)
    {'x': tensor([[4, 5, 6, 7]]), 'id': tensor([0])}
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
    out = [
        split.cut_sequence(x[start:stop], path or "<root>") if isinstance(x, torch.Tensor) else x
        for path, x in zip(paths, leaves, strict=True)
    ]
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
    gets its own part of each (the sequence too, with a second spec entry).
    To have each rank *load* only its examples, use :class:`Sampler` and
    :func:`batches` instead.

    >>> import torch, shardax as sx
    >>> loader = [{"x": torch.arange(4)}, {"x": torch.arange(4, 8)}]
    >>> mesh = sx.AbstractMesh({"dp": 2})
    >>> [b["x"].tolist() for b in sx.data.shard_batches(loader, mesh, rank=1)]
    [[2, 3], [6, 7]]
    """
    BatchSplit(mesh, spec, rank)  # a bad mesh, spec or rank fails here, not at the first batch
    return (shard_batch(batch, mesh, spec, rank=rank) for batch in batches)
