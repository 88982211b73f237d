"""``transfer``: run a plan's collectives on a Sharded value, differentiably."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from ..collectives._api import apply_op
from ..collectives._backend import Handle
from ..collectives._ops import (
    AllGather,
    AllReduce,
    AllToAll,
    Mask,
    Op,
    Pad,
    ReduceScatter,
    Slice,
    register_transpose,
)
from ..errors import ShardingError
from ..mesh._mesh import Mesh
from ._layout import Layout, as_layout
from ._plan import Step, legs, plan_transfer
from ._redistribute import Redistribute
from ._sharded import Sharded
from ._spec import piece_sizes

__all__ = ["transfer"]


def _op(step: Step, before: Layout, after: Layout, shape: tuple[int, ...]) -> Op:
    mesh = before.mesh if step.kind != "mask" else after.mesh
    assert isinstance(mesh, Mesh)
    if step.kind == "redistribute":
        return Redistribute(mesh.group(mesh.axis_names), before, after, shape)
    group = mesh.group(step.axes)
    sizes = [mesh.size(a) for a in step.axes]
    rank = mesh.rank
    if step.kind == "psum":
        return AllReduce(group, "sum")
    if step.kind == "mask":
        return Mask(group)
    d = step.dim
    assert d is not None
    if step.kind in ("slice", "psum_scatter"):
        pieces = piece_sizes(before.local_shape(shape, rank)[d], sizes)
        return (Slice if step.kind == "slice" else ReduceScatter)(group, d, pieces)
    if step.kind in ("all_gather", "pad"):
        pieces = piece_sizes(after.local_shape(shape, rank)[d], sizes)
        return (AllGather if step.kind == "all_gather" else Pad)(group, d, pieces)
    # all_to_all: step.dim's axes move to step.to_dim.
    e = step.to_dim
    assert e is not None
    split = piece_sizes(before.local_shape(shape, rank)[e], sizes)
    concat = piece_sizes(after.local_shape(shape, rank)[d], sizes)
    return AllToAll(group, e, d, split, concat)


@attrs.frozen
class View(Op):
    """A local reshape of this rank's piece between a layout with blocked
    dims and its expanded view (``legs``), where each piece is one box."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    name: ClassVar[str] = "view"

    def start(self, x: torch.Tensor) -> Handle:
        return Handle.ready(x.reshape(self.after))


register_transpose(View, lambda op: View(op.group, op.after, op.before))


@functools.lru_cache(maxsize=1024)
def _compile(src: Layout, dst: Layout, shape: tuple[int, ...], job: Any) -> tuple[Op, ...]:
    """The ops of the plan from ``src`` to ``dst``, built once per (layouts,
    shape, job): a transfer repeated every step (a ZeRO-3 gather, say) neither
    replans nor rebuilds its ops. Blocked dims are moved in their expanded
    view (:func:`~shardax.shard._plan.legs`), with a local reshape into it
    and out of it around each leg."""
    ops: list[Op] = []
    for a, b, a_x, b_x, view in legs(src, dst, shape):
        plan = plan_transfer(a_x, b_x, view)
        pairs = zip(plan.steps, plan.layouts[:-1], plan.layouts[1:], strict=True)
        leg = [_op(step, before, after, view) for step, before, after in pairs]
        if view != shape:
            mesh = a.mesh
            assert isinstance(mesh, Mesh)
            group, rank = mesh.group(mesh.axis_names), mesh.rank
            into = View(group, a.local_shape(shape, rank), a_x.local_shape(view, rank))
            back = View(group, b_x.local_shape(view, rank), b.local_shape(shape, rank))
            leg = [into, *leg, back]
        ops += leg
    return tuple(ops)


def _job(src: Layout, dst: Layout) -> Any:
    """What else a compiled transfer depends on: the job's process groups
    (new after a re-init) and the meshes' timeouts (which pick the groups)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return (world, src.mesh.timeout, dst.mesh.timeout)  # type: ignore[attr-defined]


def transfer(x: Sharded, dst: Any) -> Sharded:
    """Relayout ``x`` to ``dst`` (a :class:`Layout`, a :class:`NamedSharding`,
    or a spec on ``x``'s mesh) — the one mechanism that moves data.

    Partial → replicated is a psum, partial → sharded a psum_scatter, sharded →
    replicated an all_gather, replicated → sharded a local slice, a split that
    moves between dims an all_to_all; several such steps combine (see
    :func:`plan_transfer`). Differentiable: backward runs the transposed
    transfer between the dual layouts (replicated ↔ partial), so gradients are
    never scaled by an axis size.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> x = sx.shard(torch.arange(4.0), mesh, sx.P("dp"))
    >>> sx.transfer(x, sx.P()).local
    tensor([0., 1., 2., 3.])
    """
    if not isinstance(x, Sharded):
        raise ShardingError(
            f"transfer moves Sharded values; got {type(x).__name__} (use shard() first)"
        )
    layout = as_layout(dst, x.mesh)
    if not isinstance(layout.mesh, Mesh):
        raise ShardingError(f"transfer needs a live Mesh for its target, got {layout.mesh!r}")
    if layout == x.layout:
        return x
    local = x.local
    for op in _compile(x.layout, layout, x.shape, _job(x.layout, layout)):
        local = apply_op(local, op)
    return Sharded(local, layout, x.shape)
