"""Layouts: a named sharding plus the mesh axes over which values are still
partial sums, or differ from rank to rank (pending means)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, normalize_axes
from ._spec import NamedSharding, P, PartitionSpec, as_spec

__all__ = ["Layout", "as_layout"]


@attrs.frozen(init=False, repr=False)
class Layout:
    """Where a tensor's values live: each dim's mesh axes (the sharding), and
    the axes over which the local values are pending sums (``partial``), and
    those over which they are pending means (``diverged``). Every other axis
    holds identical replicas.

    A diverged value is one each rank of those axes has changed on its own —
    the local copies of 0/1 Adam's local steps (:func:`shardax.optim.zero_one_adam`):
    each rank computes with its own copy, and the whole value is their mean,
    what :func:`shardax.transfer` to a layout without those axes gives (a
    local scaling, then a psum). It never passes for a replica.

    Args:
        mesh_or_sharding: a mesh (then ``spec`` gives the sharding) or a
            :class:`NamedSharding`.
        spec: the partition spec (default: replicated).
        partial: axes over which the global value is the sum of the ranks'
            local values.
        diverged: axes over which the global value is the mean of the
            ranks' local values.

    >>> from shardax import AbstractMesh
    >>> mesh = AbstractMesh({"x": 2, "y": 2})
    >>> Layout(mesh, P("x"), partial="y")
    Layout(AbstractMesh({'x': 2, 'y': 2}), P('x'), partial=('y',))
    >>> Layout(mesh, P("x"), partial="y").dual()
    Layout(AbstractMesh({'x': 2, 'y': 2}), P('x'))
    >>> Layout(mesh, P("x"), partial="x")
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: axis 'x' cannot both split a dim and be partial in P('x') with partial=('x',) on AbstractMesh({'x': 2, 'y': 2})
    >>> Layout(mesh, P("x"), diverged="y")
    Layout(AbstractMesh({'x': 2, 'y': 2}), P('x'), diverged=('y',))
    """

    sharding: NamedSharding
    partial: tuple[str, ...]
    diverged: tuple[str, ...] = ()

    def __init__(
        self,
        mesh_or_sharding: AbstractMesh | NamedSharding,
        spec: PartitionSpec | Sequence[Any] | None = None,
        *,
        partial: str | Iterable[str] = (),
        diverged: str | Iterable[str] = (),
    ) -> None:
        if isinstance(mesh_or_sharding, NamedSharding):
            if spec is not None:
                raise ShardingError("give either a NamedSharding or a mesh and a spec, not both")
            sharding = mesh_or_sharding
        else:
            sharding = NamedSharding(mesh_or_sharding, as_spec(spec) if spec is not None else P())
        mesh = sharding.mesh
        names = normalize_axes(partial)
        for axis in names:
            if axis not in mesh.axis_names:
                raise ShardingError(
                    f"partial axis {axis!r} is not an axis of {mesh!r} (its axes: {mesh.axis_names!r})"
                )
            if axis in sharding.spec.axes:
                raise ShardingError(
                    f"axis {axis!r} cannot both split a dim and be partial in {sharding.spec!r} "
                    f"with partial={names!r} on {mesh!r}"
                )
        apart = normalize_axes(diverged)
        for axis in apart:
            if axis not in mesh.axis_names:
                raise ShardingError(
                    f"diverged axis {axis!r} is not an axis of {mesh!r} (its axes: "
                    f"{mesh.axis_names!r})"
                )
            if axis in sharding.spec.axes or axis in names:
                raise ShardingError(
                    f"axis {axis!r} cannot both be diverged and "
                    f"{'split a dim' if axis in sharding.spec.axes else 'be partial'} in "
                    f"{sharding.spec!r} with partial={names!r} on {mesh!r}"
                )
        ordered = tuple(a for a in mesh.axis_names if a in names)
        self.__attrs_init__(sharding, ordered, tuple(a for a in mesh.axis_names if a in apart))

    @property
    def mesh(self) -> AbstractMesh:
        return self.sharding.mesh

    @property
    def spec(self) -> PartitionSpec:
        return self.sharding.spec

    def dim_axes(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        return self.sharding.dim_axes(ndim)

    @property
    def replicated(self) -> tuple[str, ...]:
        """Axes that neither split a dim nor are partial or diverged, in mesh order."""
        used = set(self.spec.axes) | set(self.partial) | set(self.diverged)
        return tuple(a for a in self.mesh.axis_names if a not in used)

    def dual(self) -> Layout:
        """The layout of this layout's cotangents: same sharding, replicated ↔
        partial (a diverged value's cotangents are partial too: each rank's
        is for its own copy)."""
        return Layout(self.sharding, partial=self.replicated + self.diverged)

    def settled(self) -> Layout:
        """This layout without its diverged axes (replicated over them): where
        :func:`shardax.transfer` puts a diverged value's mean."""
        return Layout(self.sharding, partial=self.partial) if self.diverged else self

    def local_bounds(self, global_shape: Sequence[int], rank: int) -> tuple[tuple[int, int], ...]:
        return self.sharding.local_bounds(global_shape, rank)

    def local_shape(self, global_shape: Sequence[int], rank: int) -> tuple[int, ...]:
        return self.sharding.local_shape(global_shape, rank)

    def local_boxes(
        self, global_shape: Sequence[int], rank: int
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of the boxes of ``rank``'s piece (see
        :meth:`NamedSharding.local_boxes`)."""
        return self.sharding.local_boxes(global_shape, rank)

    def box_views(
        self, local: torch.Tensor, global_shape: Sequence[int], rank: int
    ) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        """``(offsets, sizes, view)`` for each box of ``rank``'s piece:
        ``view`` is the part of ``local`` (that piece) holding the box."""
        boxes = self.local_boxes(global_shape, rank)
        if not self.spec.blocked:
            return [(*boxes[0], local)]
        expanded, inner = self.expand(global_shape)
        viewed = local.reshape(inner.local_shape(expanded, rank))
        ks = self.spec.dim_blocks(len(global_shape))
        out = []
        for index, (offsets, sizes) in zip(
            itertools.product(*[range(k) for k in ks]), boxes, strict=True
        ):
            at: list[Any] = []
            for i, k in zip(index, ks, strict=True):
                at += [i, slice(None)] if k > 1 else [slice(None)]
            out.append((offsets, sizes, viewed[tuple(at)]))
        return out

    def expand(self, global_shape: Sequence[int]) -> tuple[tuple[int, ...], Layout]:
        """Blocked dims made two (see :meth:`NamedSharding.expand`); partial
        axes kept."""
        shape, sharding = self.sharding.expand(global_shape)
        if sharding is self.sharding:
            return shape, self
        return shape, Layout(sharding, partial=self.partial, diverged=self.diverged)

    def __repr__(self) -> str:
        tail = f", partial={self.partial!r}" if self.partial else ""
        tail += f", diverged={self.diverged!r}" if self.diverged else ""
        return f"Layout({self.mesh!r}, {self.spec!r}{tail})"


def as_layout(target: Any, mesh: AbstractMesh | None = None) -> Layout:
    """A Layout from a Layout, a NamedSharding, or a spec (with ``mesh``)."""
    if isinstance(target, Layout):
        return target
    if isinstance(target, NamedSharding):
        return Layout(target)
    if mesh is None:
        raise ShardingError(f"a bare spec {target!r} needs a mesh to become a layout")
    return Layout(mesh, as_spec(target))
