"""Partition specs and named shardings: which mesh axes split which dims.

A dim split over axes ``(a, b)`` is chunked over ``a`` first, then each
``a``-chunk over ``b`` (torch.chunk semantics at each level: ceil-sized
pieces, later ones smaller or empty). For every divisible shape this is JAX's
layout exactly; for uneven ones it is DTensor's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..collectives._ops import chunk_sizes
from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, unknown_axis

__all__ = [
    "Blocks", "NamedSharding", "P", "PartitionSpec", "Zigzag", "as_spec", "blocks", "dim_bounds",
    "piece_array", "piece_sizes", "zigzag", "zigzag_bounds",
]  # fmt: skip


@attrs.frozen(repr=False)
class Blocks:
    """A spec entry for a dim made of ``k`` equal blocks side by side — a
    fused q/k/v projection ``[3·d, d]``, gate and up ``[2·f, d]`` — split
    block by block over ``axes``: each rank holds its part of every block,
    in block order, and the tensor keeps its shape. Write it with
    :func:`blocks`.

    >>> from shardax import AbstractMesh
    >>> s = NamedSharding(AbstractMesh({"tp": 2}), P(blocks(3, "tp"), None))
    >>> s.local_shape((12, 4), 0), s.local_boxes((12, 4), 1)
    ((6, 4), [((2, 0), (2, 4)), ((6, 0), (2, 4)), ((10, 0), (2, 4))])
    """

    k: int
    axes: tuple[str, ...]

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ShardingError(
                f"blocks(k, ...) needs a positive whole number of blocks; got {self.k!r}"
            )
        if not self.axes or not all(isinstance(a, str) for a in self.axes):
            raise ShardingError(
                f"blocks({self.k}, ...) needs the mesh axes that split each block; got {self.axes!r}"
            )

    def __repr__(self) -> str:
        return f"blocks({self.k}, " + ", ".join(repr(a) for a in self.axes) + ")"


def blocks(k: int, *axes: str) -> Blocks:
    """The spec entry for a dim of ``k`` equal blocks, each split over
    ``axes`` (one or more mesh axes, first major): see :class:`Blocks`.

    >>> P(None, blocks(3, "tp"))
    P(None, blocks(3, 'tp'))
    """
    flat = tuple(a for x in axes for a in ((x,) if isinstance(x, str) else tuple(x)))
    return Blocks(k, flat)


@attrs.frozen(repr=False)
class Zigzag:
    """A spec entry for a sequence dim split head–tail over ``axes`` (n
    members): the dim is cut into ``2·n`` equal chunks and member ``i`` holds
    chunks ``i`` and ``2·n-1-i``, in that order — so under causal attention,
    where later tokens attend to more, every member does the same work
    (the load balancing of ring attention's zigzag layout; Liu et al., 2023,
    "Ring Attention with Blockwise Transformers for Near-Infinite Context").
    A member's piece is two boxes (:meth:`NamedSharding.local_boxes`). It
    lays out batches (:mod:`shardax.data`) and activations under
    ``rules.context_parallel``, not parameters. Write it with :func:`zigzag`.

    >>> from shardax import AbstractMesh
    >>> s = NamedSharding(AbstractMesh({"cp": 2}), P(None, zigzag("cp")))
    >>> s.local_shape((1, 8), 0), s.local_boxes((1, 8), 0), s.local_boxes((1, 8), 1)
    ((1, 4), [((0, 0), (1, 2)), ((0, 6), (1, 2))], [((0, 2), (1, 2)), ((0, 4), (1, 2))])
    """

    axes: tuple[str, ...]

    def __attrs_post_init__(self) -> None:
        if (
            not isinstance(self.axes, tuple)
            or not self.axes
            or not all(isinstance(a, str) for a in self.axes)
        ):
            raise ShardingError(
                f"zigzag(...) needs the mesh axes that split the sequence, e.g. zigzag('cp'); "
                f"got {self.axes!r}"
            )

    def __repr__(self) -> str:
        return "zigzag(" + ", ".join(repr(a) for a in self.axes) + ")"


def zigzag(*axes: str | Sequence[str]) -> Zigzag:
    """The spec entry for a sequence dim split head–tail over ``axes`` (one
    or more mesh axes, first major): see :class:`Zigzag`. A dim of 8 over 2
    members is 4 chunks of 2; member 0 holds chunks 0 and 3, member 1
    chunks 1 and 2.

    >>> from shardax import AbstractMesh
    >>> spec = P("dp", zigzag("cp"))
    >>> spec, spec.axes
    (P('dp', zigzag('cp')), ('dp', 'cp'))
    >>> s = NamedSharding(AbstractMesh({"cp": 2}), P(zigzag("cp")))
    >>> [s.local_boxes((8,), r) for r in range(2)]
    [[((0,), (2,)), ((6,), (2,))], [((2,), (2,)), ((4,), (2,))]]
    """
    flat = tuple(a for x in axes for a in ((x,) if isinstance(x, str) else tuple(x)))
    return Zigzag(flat)


def zigzag_bounds(length: int, n: int, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[start, stop)`` chunks member ``index`` of ``n`` holds of a
    dim of ``length`` split :func:`zigzag`: chunks ``index`` and
    ``2·n-1-index`` of ``2·n`` equal ones, in that order.

    Raises:
        ShardingError: ``length`` is not a multiple of ``2·n``.

    >>> zigzag_bounds(8, 2, 0), zigzag_bounds(8, 2, 1)
    (((0, 2), (6, 8)), ((2, 4), (4, 6)))
    >>> zigzag_bounds(6, 2, 0)
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: a zigzag split over 2 members cuts a dim into 2·2 = 4 equal chunks, so its length must be a multiple of 4; got 6: pad or trim it to 4 or 8
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ShardingError(f"a zigzag split needs a positive number of members; got {n!r}")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
        raise ShardingError(
            f"member {index!r} is not one of the {n} of a zigzag split (0..{n - 1})"
        )
    chunks = 2 * n
    if length % chunks:
        lower, upper = length // chunks * chunks, (length // chunks + 1) * chunks
        choices = f"{lower} or {upper}" if lower else f"{upper}"
        raise ShardingError(
            f"a zigzag split over {n} members cuts a dim into 2·{n} = {chunks} equal chunks, so "
            f"its length must be a multiple of {chunks}; got {length}: pad or trim it to {choices}"
        )
    c = length // chunks
    return (index * c, (index + 1) * c), ((chunks - 1 - index) * c, (chunks - index) * c)


Entry = str | tuple[str, ...] | Blocks | Zigzag | None


def _normalize_entry(entry: Any, raw: tuple[Any, ...]) -> Entry:
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Blocks):
        return entry if entry.k > 1 else _normalize_entry(entry.axes, raw)
    if isinstance(entry, Zigzag):
        return entry
    if isinstance(entry, list | tuple) and all(isinstance(a, str) for a in entry):
        if len(entry) == 0:
            return None
        return entry[0] if len(entry) == 1 else tuple(entry)
    raise ShardingError(
        f"a spec entry is None, an axis name, a tuple of axis names or blocks(k, axis, ...) or "
        f"zigzag(axis, ...); got {entry!r} in P{raw!r}"
    )


@attrs.frozen(init=False, repr=False, eq=False)
class PartitionSpec:
    """One entry per tensor dim: None (not split), an axis name, or a tuple of
    axis names (split over their product, first major); or a dim split block
    by block (:func:`blocks`) or head–tail (:func:`zigzag`). Missing trailing
    entries mean None.

    >>> P("dp", None)
    P('dp', None)
    >>> P(("dp", "tp"), None) == P("dp", "tp")
    False
    >>> P(("dp",)) == P("dp"), P("dp", None) == P("dp")
    (True, True)
    >>> P("dp", "dp")
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: mesh axis 'dp' appears twice in P('dp', 'dp'); a mesh axis can split at most one dim, once
    """

    entries: tuple[Entry, ...]

    def __init__(self, *entries: Any) -> None:
        norm = tuple(_normalize_entry(e, entries) for e in entries)
        self.__attrs_init__(norm)
        seen: set[str] = set()
        for axis in self.axes:
            if axis in seen:
                raise ShardingError(
                    f"mesh axis {axis!r} appears twice in {self!r}; a mesh axis can split at most "
                    "one dim, once"
                )
            seen.add(axis)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec uses, dim by dim."""
        return tuple(a for e in self.entries for a in _entry_axes(e))

    def dim_blocks(self, ndim: int) -> tuple[int, ...]:
        """The number of blocks of each of ``ndim`` dims (1: not blocked).

        >>> P(None, blocks(3, "tp")).dim_blocks(3)
        (1, 3, 1)
        """
        self.dim_axes(ndim)  # checks ndim
        ks = tuple(e.k if isinstance(e, Blocks) else 1 for e in self.entries)
        return ks + (1,) * (ndim - len(ks))

    @property
    def blocked(self) -> bool:
        """Whether some dim is split block by block (:func:`blocks`)."""
        return any(isinstance(e, Blocks) for e in self.entries)

    @property
    def zigzagged(self) -> bool:
        """Whether some dim is split head–tail (:func:`zigzag`).

        >>> P("dp", zigzag("cp")).zigzagged, P("dp", "cp").zigzagged
        (True, False)
        """
        return any(isinstance(e, Zigzag) for e in self.entries)

    def dim_axes(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        """The axes of each of ``ndim`` dims (padded with ``()``).

        >>> P(("dp", "tp")).dim_axes(2)
        (('dp', 'tp'), ())
        """
        if len(self.entries) > ndim:
            raise ShardingError(
                f"{self!r} has {len(self.entries)} entries but the tensor has {ndim} dims"
            )
        return tuple(_entry_axes(e) for e in self.entries) + ((),) * (ndim - len(self.entries))

    @classmethod
    def from_dim_axes(cls, dim_axes: Sequence[Sequence[str]]) -> PartitionSpec:
        """The spec with these axes per dim, trailing unsplit dims dropped.

        >>> P.from_dim_axes([("x",), (), ()])
        P('x')
        """
        entries = [tuple(a) for a in dim_axes]
        while entries and not entries[-1]:
            entries.pop()
        return cls(*entries)

    def _key(self) -> tuple[Entry, ...]:
        entries = list(self.entries)
        while entries and entries[-1] is None:
            entries.pop()
        return tuple(entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartitionSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Any:
        return iter(self.entries)

    def __getitem__(self, i: int) -> Entry:
        return self.entries[i]

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self.entries) + ")"


P = PartitionSpec


def _entry_axes(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, Blocks | Zigzag):
        return entry.axes
    return (entry,) if isinstance(entry, str) else entry


def piece_array(length: int, sizes: Sequence[int]) -> np.ndarray:
    """:func:`piece_sizes` as an int64 array of shape ``sizes`` (one
    dimension per level), computed level by level on whole arrays: for many
    pieces (``explain`` of a dim split 16,384 ways), where the tuple's
    Python loop is slow; for a few, :func:`piece_sizes` is quicker.

    >>> piece_array(5, [2, 2]).tolist()
    [[2, 1], [1, 1]]
    """
    pieces = np.array([length], dtype=np.int64)
    for n in sizes:
        chunk = -(-pieces // n)  # torch.chunk: ceil-sized, later ones smaller or empty
        starts = np.arange(n, dtype=np.int64) * chunk[:, None]
        pieces = np.clip(pieces[:, None] - starts, 0, chunk[:, None]).reshape(-1)
    return pieces.reshape(tuple(sizes))


def piece_sizes(length: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Lengths of the pieces of ``length`` chunked over ``sizes`` (the first
    major, each chunk chunked again), in member order.

    >>> piece_sizes(5, [2, 2])
    (2, 1, 1, 1)
    """
    pieces = [length]
    for n in sizes:
        pieces = [c for p in pieces for c in chunk_sizes(p, n)]
    return tuple(pieces)


def dim_bounds(length: int, sizes: Sequence[int], index: Sequence[int]) -> tuple[int, int]:
    """``[start, stop)`` of the piece at ``index`` (one index per size),
    found level by level: O(levels), not O(pieces).

    >>> dim_bounds(5, [2, 2], [0, 1]), dim_bounds(5, [2, 2], [1, 1])
    ((2, 3), (4, 5))
    """
    start = 0
    for n, i in zip(sizes, index, strict=True):
        chunk = -(-length // n)
        start += min(i * chunk, length)  # the pieces before the i-th: full chunks, then the rest
        length = max(0, min(chunk, length - i * chunk))
    return start, start + length


def _check_spec_axes(mesh: AbstractMesh, spec: PartitionSpec) -> None:
    for axis in spec.axes:
        if axis not in mesh.axis_names:
            raise ShardingError(unknown_axis(axis, mesh, repr(spec)))


@attrs.frozen(repr=False)
class NamedSharding:
    """A spec bound to a mesh: where each rank's piece of a tensor lies.

    >>> from shardax import AbstractMesh
    >>> s = NamedSharding(AbstractMesh({"dp": 2, "tp": 2}), P("dp", "tp"))
    >>> s
    NamedSharding(AbstractMesh({'dp': 2, 'tp': 2}), P('dp', 'tp'))
    >>> s.shard_shape((8, 6)), s.devices_indices_map((8, 6))[3]
    ((4, 3), (slice(4, 8, None), slice(3, 6, None)))
    >>> NamedSharding(AbstractMesh({"dp": 2}), P("dq"))
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: unknown mesh axis 'dq' in P('dq'); the mesh AbstractMesh({'dp': 2}) has axes ('dp',) (did you mean 'dp'?)
    """

    mesh: AbstractMesh
    spec: PartitionSpec = attrs.field(converter=lambda s: as_spec(s))

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.mesh, AbstractMesh):
            raise ShardingError(f"NamedSharding needs a Mesh or AbstractMesh, got {self.mesh!r}")
        _check_spec_axes(self.mesh, self.spec)

    def check_shape(
        self, global_shape: Sequence[int], *, path: str = "", source: str = ""
    ) -> tuple[int, ...]:
        """``global_shape`` as a tuple, checked to have a dim for every spec
        entry (``path`` and ``source`` only make the error more precise)."""
        shape = tuple(int(d) for d in global_shape)
        if len(self.spec) > len(shape):
            where = f"{path!r}: " if path else ""
            raise ShardingError(
                f"{where}{self.spec!r}{source} has {len(self.spec)} entries but the tensor has "
                f"shape {shape} ({len(shape)} dims) on {self.mesh!r}; give at most {len(shape)} "
                "entries (write a rule for this leaf)"
            )
        return shape

    def dim_axes(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        """The axes of each of ``ndim`` dims, for planning a transfer or a
        relayout: each rank's piece one box (blocked dims in their
        :meth:`expand` view), so not for a zigzag spec."""
        self._refuse_zigzag("a transfer or relayout (dim_axes)")
        return self.spec.dim_axes(ndim)

    def expand(self, global_shape: Sequence[int]) -> tuple[tuple[int, ...], NamedSharding]:
        """The shape and sharding with every blocked dim (:func:`blocks`) made
        two — ``k`` blocks, then the block itself, split over the axes — in
        which each rank's piece is one box. Unblocked: ``(shape, self)``.

        >>> s = NamedSharding(AbstractMesh({"tp": 2}), P(None, blocks(3, "tp")))
        >>> s.expand((4, 12))
        ((4, 3, 4), NamedSharding(AbstractMesh({'tp': 2}), P(None, None, 'tp')))
        """
        shape = self.check_shape(global_shape)
        self._refuse_zigzag("expand")
        if not self.spec.blocked:
            return shape, self
        out_shape: list[int] = []
        entries: list[Any] = []
        for size, entry in zip(
            shape, list(self.spec) + [None] * (len(shape) - len(self.spec)), strict=True
        ):
            if isinstance(entry, Blocks):
                if size % entry.k:
                    raise ShardingError(
                        f"{self.spec!r}: a dim of {size} cannot be {entry.k} equal blocks "
                        f"(shape {shape}, {self.mesh!r})"
                    )
                out_shape += [entry.k, size // entry.k]
                entries += [None, entry.axes]
            else:
                out_shape.append(size)
                entries.append(entry)
        return tuple(out_shape), NamedSharding(self.mesh, P(*entries))

    def local_bounds(self, global_shape: Sequence[int], rank: int) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` per dim of ``rank``'s piece (one box: not for a
        blocked or zigzag spec, whose pieces are :meth:`local_boxes`)."""
        shape = self.check_shape(global_shape)
        self._refuse_zigzag("local_bounds")
        if self.spec.blocked:
            raise ShardingError(
                f"internal: {self.spec!r} splits a dim block by block: a piece is several boxes "
                "(local_boxes), not one"
            )
        coords = self.mesh.coords(rank)
        sizes = self.mesh.shape
        return tuple(
            dim_bounds(d, [sizes[a] for a in axes], [coords[a] for a in axes])
            for d, axes in zip(shape, self.dim_axes(len(shape)), strict=True)
        )

    def local_boxes(
        self, global_shape: Sequence[int], rank: int
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of each box of ``rank``'s piece, in the order
        its local tensor holds them (several only where a dim is blocked:
        one per block, or zigzag: its two chunks; the first dim's boxes
        outermost); empty boxes included."""
        shape = self.check_shape(global_shape)
        if self.spec.zigzagged:
            runs = self._zigzag_runs(shape, rank)
            return [
                (tuple(a for a, _ in box), tuple(b - a for a, b in box))
                for box in itertools.product(*runs)
            ]
        expanded, inner = self.expand(shape)
        bounds = inner.local_bounds(expanded, rank)
        ks = self.spec.dim_blocks(len(shape))
        boxes = []
        for index in itertools.product(*[range(k) for k in ks]):
            offsets, sizes, j = [], [], 0
            for d, k in enumerate(ks):
                if k == 1:
                    a, b = bounds[j]
                    j += 1
                else:
                    a, b = bounds[j + 1]
                    a, b = index[d] * expanded[j + 1] + a, index[d] * expanded[j + 1] + b
                    j += 2
                offsets.append(a)
                sizes.append(b - a)
            boxes.append((tuple(offsets), tuple(sizes)))
        return boxes

    def local_shape(self, global_shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s piece (uneven dims: later ranks may be smaller)."""
        shape = self.check_shape(global_shape)
        if self.spec.zigzagged:
            return tuple(sum(b - a for a, b in r) for r in self._zigzag_runs(shape, rank))
        if not self.spec.blocked:
            return tuple(b - a for a, b in self.local_bounds(shape, rank))
        expanded, inner = self.expand(shape)
        local = inner.local_shape(expanded, rank)
        out, j = [], 0
        for k in self.spec.dim_blocks(len(shape)):
            out.append(local[j] if k == 1 else local[j] * local[j + 1])
            j += 1 if k == 1 else 2
        return tuple(out)

    def shard_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the largest piece (rank 0's); every piece when divisible."""
        return self.local_shape(global_shape, 0)

    def devices_indices_map(self, global_shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """``{rank: index}`` of every rank's piece; like JAX's, with ranks for
        devices (``slice(None)`` for dims no axis of size > 1 splits)."""
        shape = self.check_shape(global_shape)
        self._refuse_zigzag("devices_indices_map")
        if self.spec.blocked:
            raise ShardingError(
                f"{self.spec!r} splits a dim block by block: a rank's piece is several boxes, "
                "not one index (use local_boxes)"
            )
        sizes = self.mesh.shape
        split = [math.prod(sizes[a] for a in axes) > 1 for axes in self.dim_axes(len(shape))]
        out = {}
        for rank in range(self.mesh.world_size):
            bounds = self.local_bounds(shape, rank)
            out[rank] = tuple(
                slice(a, b) if s else slice(None) for (a, b), s in zip(bounds, split, strict=True)
            )
        return out

    def _refuse_zigzag(self, what: str) -> None:
        if self.spec.zigzagged:
            raise ShardingError(
                f"{what} takes a piece of one box per rank, and {self.spec!r} on {self.mesh!r} "
                "splits a dim zigzag: zigzag lays out batches (sx.data) and activations under "
                "rules.context_parallel, in two boxes per rank (local_boxes); parameters and "
                "transfers use plain splits or blocks(...)"
            )

    def _zigzag_runs(self, shape: tuple[int, ...], rank: int) -> list[list[tuple[int, int]]]:
        """``[start, stop)`` runs of ``rank``'s piece in each dim of a spec
        with a zigzag dim: two there, one in every other dim."""
        if self.spec.blocked:
            raise ShardingError(
                f"{self.spec!r} splits one dim block by block and another zigzag on {self.mesh!r}; "
                "a spec takes one or the other: split the blocked dim plainly or the zigzag one "
                "contiguously"
            )
        sizes = self.mesh.shape
        coords = self.mesh.coords(rank)
        runs = []
        for d, (length, entry) in enumerate(
            zip(shape, list(self.spec) + [None] * (len(shape) - len(self.spec)), strict=True)
        ):
            axes = _entry_axes(entry)
            if not isinstance(entry, Zigzag):
                at = dim_bounds(length, [sizes[a] for a in axes], [coords[a] for a in axes])
                runs.append([at])
                continue
            n, index = self.mesh.size(axes), self.mesh.axis_index(axes, rank)
            try:
                runs.append(list(zigzag_bounds(length, n, index)))
            except ShardingError as err:
                raise ShardingError(
                    f"dim {d} of shape {shape} under {self.spec!r} on {self.mesh!r}: {err}"
                ) from None
        return runs

    def is_fully_replicated(self) -> bool:
        return all(self.mesh.size(a) == 1 for a in self.spec.axes) if self.spec.axes else True

    def __repr__(self) -> str:
        return f"NamedSharding({self.mesh!r}, {self.spec!r})"


def as_spec(spec: Any) -> PartitionSpec:
    """A PartitionSpec from a spec or a tuple/list of entries.

    >>> as_spec(("dp", None))
    P('dp', None)
    >>> as_spec("dp")
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: a spec is a PartitionSpec, one entry per dim, like P('dp'); got the string 'dp'
    """
    if isinstance(spec, PartitionSpec):
        return spec
    if isinstance(spec, str):
        raise ShardingError(
            f"a spec is a PartitionSpec, one entry per dim, like P({spec!r}); got the string {spec!r}"
        )
    if isinstance(spec, tuple | list):
        return P(*spec)
    raise ShardingError(f"expected a PartitionSpec like P('dp', None); got {spec!r}")
