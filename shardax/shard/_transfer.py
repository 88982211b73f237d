"""The one executor: plans (:func:`~shardax.shard._plan.plan_transfer`)
compiled to this rank's ops and run.

- :func:`program` compiles the plan between two layouts for a global shape
  into a :class:`Program`, once per (layouts, shape, job).
- :func:`transfer` runs one leaf's program, differentiably.
- :func:`transfer_many` runs many leaves' programs at once (not
  differentiable): the programs that come down to one all_gather travel
  together, one collective per group and dtype — a module's parameters
  under ZeRO-3.
- :class:`Reducer` is the same for gradient contributions, which arrive one
  by one during backward: programs that come down to one psum_scatter or
  psum go in size-capped buckets, each started as soon as it fills.

Whatever does not fuse runs its program on its own (:meth:`Program.run`, the
one place a plan runs); how the fused collectives pack their tensors is
:mod:`._packing`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
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
from ..kernels._quant import dequantize_int8, quantize_int8
from ..mesh._mesh import Mesh
from ._layout import Layout, as_layout
from ._packing import (
    Sink,
    direct,
    start_all_gather,
    start_all_gather_direct,
    start_psum,
    start_psum_scatter,
    start_psum_scatter_direct,
)
from ._plan import Step, legs, plan_transfer, settle
from ._redistribute import Redistribute
from ._sharded import Sharded
from ._spec import piece_sizes

__all__ = ["Batch", "Program", "Reducer", "program", "through_int8", "transfer", "transfer_many"]


# -- compiling a plan ---------------------------------------------------------------


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


@attrs.frozen
class Scale(Op):
    """This rank's piece times ``factor``: a diverged value's local copy
    made its share of their mean (diverged → partial, ``1 / group size``).
    Local; its own transpose."""

    factor: float
    name: ClassVar[str] = "scale"

    def start(self, x: torch.Tensor) -> Handle:
        return Handle.ready(x * self.factor)


register_transpose(Scale, lambda op: op)


@attrs.frozen
class Program:
    """A plan compiled for this rank: ``ops``, the ops that move data, in
    order (an op over one rank moves nothing and is left out).

    ``collective`` is set where those ops are one collective, alone or
    between the free reshapes into and out of a blocked dim's expanded view
    — what a batched transfer fuses with other leaves'. It then runs on the
    input reshaped to ``view_in`` (when set) and its result, of shape
    ``view_out`` (when set), is reshaped to ``out_shape``, this rank's local
    shape in the target layout.
    """

    ops: tuple[Op, ...]
    out_shape: tuple[int, ...]
    collective: Op | None = None
    view_in: tuple[int, ...] | None = None
    view_out: tuple[int, ...] | None = None

    @property
    def collective_shape(self) -> tuple[int, ...]:
        """The shape ``collective`` gives: ``view_out``, else ``out_shape``."""
        return self.view_out if self.view_out is not None else self.out_shape

    def run(self, t: torch.Tensor, *, differentiable: bool = False) -> torch.Tensor:
        """The plan run on this rank's tensor ``t``, op by op; with
        ``differentiable``, backward runs the transposed ops."""
        for op in self.ops:
            t = apply_op(t, op) if differentiable else op.run(t)
        return t


@functools.lru_cache(maxsize=1024)
def _compile(src: Layout, dst: Layout, shape: tuple[int, ...], job: Any) -> Program:
    """The program from ``src`` to ``dst``, built once per (layouts, shape,
    job): a transfer repeated every step (a ZeRO-3 gather, say) neither
    replans nor rebuilds its ops. Blocked dims are moved in their expanded
    view (:func:`~shardax.shard._plan.legs`), with a local reshape into it
    and out of it around each leg."""
    ops: list[Op] = []
    final = dst
    src, dst, mean = settle(src, dst)
    if mean:
        mesh = src.mesh
        assert isinstance(mesh, Mesh)
        ops.append(Scale(mesh.group(mean), 1.0 / mesh.group(mean).size))
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
    moving = tuple(op for op in ops if op.group.size > 1)
    out_shape = final.local_shape(shape, final.mesh.rank)  # type: ignore[attr-defined]
    # The views split off: one collective between them fuses like any other
    # (a view is a free reshape of the same bytes).
    pre = moving[0] if moving and isinstance(moving[0], View) else None
    post = moving[-1] if len(moving) > 1 and isinstance(moving[-1], View) else None
    core = moving[pre is not None : len(moving) - (post is not None)]
    if len(core) != 1:
        return Program(moving, out_shape)
    return Program(
        moving,
        out_shape,
        core[0],
        pre.after if pre is not None else None,
        post.before if post is not None else None,
    )


def _job(src: Layout, dst: Layout) -> Any:
    """What else a compiled transfer depends on: the job's process groups
    (new after a re-init) and the meshes' timeouts (which pick the groups)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return (world, src.mesh.timeout, dst.mesh.timeout)  # type: ignore[attr-defined]


def program(src: Layout, dst: Layout, shape: tuple[int, ...]) -> Program:
    """The compiled plan from ``src`` to ``dst`` for a tensor of global
    ``shape``, on this rank (cached)."""
    return _compile(src, dst, shape, _job(src, dst))


# -- one leaf -----------------------------------------------------------------------


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
    local = program(x.layout, layout, x.shape).run(x.local, differentiable=True)
    return Sharded(local, layout, x.shape)


# -- many leaves --------------------------------------------------------------------


class Batch:
    """Transfers started together by :func:`transfer_many`. ``wait()``
    finishes them and gives the local tensors in item order; ``bases`` are
    the buffers the batch allocated (the tensors are views into them), in
    an order a repeat of the same batch reproduces."""

    def __init__(self, n: int) -> None:
        self.tensors: list[torch.Tensor | None] = [None] * n
        self.bases: list[torch.Tensor] = []
        self._steps: list[Callable[[], None]] = []

    def then(self, step: Callable[[], None]) -> Batch:
        """Run ``step`` once the transfers are done, at :meth:`wait`."""
        self._steps.append(step)
        return self

    def wait(self) -> list[torch.Tensor]:
        steps, self._steps = self._steps, []
        for step in steps:
            step()
        return self.tensors  # type: ignore[return-value]


def transfer_many(
    items: Sequence[tuple[Sharded, Layout]], int8: Sequence[bool] | None = None
) -> Batch:
    """Start moving each ``(leaf, layout)`` item's local tensor to
    ``layout`` (not differentiable).

    Programs that are one all_gather travel together, one collective per
    group and dtype (a tensor of at least
    :data:`~shardax.shard._packing.DIRECT_BYTES` split evenly on dim 0 in
    one of its own, with no packing); the other programs run one by one at
    ``wait()``; a leaf whose program moves nothing is its own local tensor.

    ``int8[i]`` (ZeRO++'s qwZ, ``rules.zero(3, quantize_weights=True)``):
    item ``i`` moves quantized blockwise to int8 and arrives dequantized —
    in the all_gathers it travels in, or, for a program of several steps,
    quantized and dequantized here before it runs (the same values, full
    bytes). A leaf whose program moves nothing is left exact.
    """
    batch = Batch(len(items))
    flags = [False] * len(items) if int8 is None else list(int8)
    packs: dict[
        tuple[int, torch.dtype, bool], list[tuple[int, torch.Tensor, AllGather, Program]]
    ] = {}
    singles: list[tuple[int, torch.Tensor, Program]] = []
    for i, (x, layout) in enumerate(items):
        prog = program(x.layout, layout, x.shape)
        local = x.local.detach()
        op = prog.collective
        if not prog.ops:
            batch.tensors[i] = local
        elif not isinstance(op, AllGather):
            singles.append((i, through_int8(local) if flags[i] else local, prog))
        elif not flags[i] and direct(
            local if prog.view_in is None else local.reshape(prog.view_in), op
        ):
            full, finish = start_all_gather_direct(local, op, prog.out_shape)
            batch.bases.append(full)
            batch._steps.append(functools.partial(_put, batch, i, finish))
        else:
            packs.setdefault((id(op.group), x.dtype, flags[i]), []).append((i, local, op, prog))
    for (_, _, quantized), members in packs.items():
        flat, finish = start_all_gather(
            [(local, op, prog.collective_shape) for _, local, op, prog in members], int8=quantized
        )
        batch.bases.append(flat)
        batch._steps.append(functools.partial(_put_all, batch, members, finish))
    for i, local, prog in singles:
        batch._steps.append(functools.partial(_run_single, batch, i, local, prog))
    return batch


def through_int8(t: torch.Tensor) -> torch.Tensor:
    """``t`` quantized to int8 blockwise and back (the values a quantized
    gather delivers)."""
    q, scales = quantize_int8(t)
    return dequantize_int8(q, scales, t.dtype).view(t.shape)


def _put(batch: Batch, i: int, finish: Callable[[], torch.Tensor]) -> None:
    """Item ``i``'s direct all_gather done: its tensor."""
    batch.tensors[i] = finish()


def _put_all(batch: Batch, members: list[Any], finish: Callable[[], list[torch.Tensor]]) -> None:
    """A packed all_gather done: each member's tensor, in its local shape."""
    for (i, _, _, prog), full in zip(members, finish(), strict=True):
        batch.tensors[i] = full.view(prog.out_shape)


def _run_single(batch: Batch, i: int, local: torch.Tensor, prog: Program) -> None:
    """Item ``i``'s program, which fuses with nothing, run on its own."""
    t = prog.run(local).contiguous()
    batch.tensors[i] = t
    batch.bases.append(t)


class Reducer:
    """Reduces gradient contributions (in a partial layout) to their target
    layouts in buckets of about ``bucket_bytes``, each started as soon as it
    fills, at most ``in_flight`` at a time (the oldest is finished when a new
    one starts, so full-size gradients do not pile up); ``finish()`` starts
    the rest, waits for all and hands each result to its ``sink``.

    Programs that are one psum_scatter or psum (sum) go in buckets, one per
    collective, group and dtype (a tensor of at least
    :data:`~shardax.shard._packing.DIRECT_BYTES` split evenly on dim 0 in a
    psum_scatter of its own); any other program runs when it is added.
    """

    def __init__(self, bucket_bytes: int, in_flight: int = 2) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.in_flight = in_flight
        self._open: dict[
            tuple[str, int, torch.dtype, Any], list[tuple[torch.Tensor, Any, Sink]]
        ] = {}
        self._sizes: dict[tuple[str, int, torch.dtype, Any], int] = {}
        self._flying: list[Callable[[], None]] = []

    def add(
        self,
        grad: torch.Tensor,
        src: Layout,
        dst: Layout,
        shape: tuple[int, ...],
        sink: Sink,
        across: tuple[str, ...] = (),
    ) -> None:
        """Reduce ``grad`` from ``src`` to ``dst`` (the global ``shape``)
        and hand the result to ``sink``. ``across`` (ZeRO++'s qgZ): where
        the program is one psum_scatter, it runs in int4 — over the group's
        other axes within a node, then over these across nodes."""
        prog = program(src, dst, shape)
        op = prog.collective
        if not prog.ops:
            sink(grad)
            return
        int4 = (dst.mesh, across) if across and isinstance(op, ReduceScatter) else None
        hierarchical = _scatter_then_sum(prog)
        if hierarchical is not None:  # HSDP: each piece then summed over the replicas, bucketed too
            op, over = hierarchical
            sink = functools.partial(self._bucket, op=over, sink=sink)
        elif not (
            isinstance(op, ReduceScatter) or (isinstance(op, AllReduce) and op.reduce == "sum")
        ):
            sink(prog.run(grad))
            return
        if prog.view_in is not None:  # a blocked dim: reduce in its expanded view
            grad = grad.reshape(prog.view_in)
        if prog.view_out is not None:
            sink = _reshaped(sink, prog.out_shape)
        if isinstance(op, ReduceScatter) and int4 is None and direct(grad, op):
            self._fly(start_psum_scatter_direct(grad, op, sink))
            return
        self._bucket(grad, op, sink, int4)

    def _bucket(self, grad: torch.Tensor, op: Any, sink: Sink, int4: Any = None) -> None:
        """``grad`` into the open bucket of ``op``'s kind, group and dtype
        (and ``int4``: qgZ's ``(mesh, axes across)``), launched once it
        holds ``bucket_bytes``."""
        key = (type(op).__name__, id(op.group), grad.dtype, int4)
        self._open.setdefault(key, []).append((grad, op, sink))
        self._sizes[key] = self._sizes.get(key, 0) + grad.numel() * grad.element_size()
        if self._sizes[key] >= self.bucket_bytes:
            self._launch(key)

    def _launch(self, key: tuple[str, int, torch.dtype, Any]) -> None:
        bucket = self._open.pop(key)
        self._sizes.pop(key)
        if isinstance(bucket[0][1], AllReduce):
            self._fly(start_psum(bucket))
        else:
            self._fly(start_psum_scatter(bucket, int4=key[3]))

    def _fly(self, finish: Callable[[], None]) -> None:
        """Keep at most ``in_flight`` reductions going: finishing the oldest
        frees its full-size input while backward goes on."""
        self._flying.append(finish)
        while len(self._flying) > self.in_flight:
            self._flying.pop(0)()

    def finish(self) -> None:
        while self._open or self._flying:  # a finished psum_scatter may fill a psum's bucket
            for key in list(self._open):
                self._launch(key)
            flying, self._flying = self._flying, []
            for done in flying:
                done()


def _scatter_then_sum(prog: Program) -> tuple[ReduceScatter, AllReduce] | None:
    """The two collectives of a program that is a psum_scatter then a psum
    (sum) over other axes — a gradient of hybrid sharding: split over the
    axes within a replica, summed over the replicas — else None."""
    if len(prog.ops) != 2:
        return None
    first, then = prog.ops
    if isinstance(first, ReduceScatter) and isinstance(then, AllReduce) and then.reduce == "sum":
        return first, then
    return None


def _reshaped(sink: Sink, shape: tuple[int, ...]) -> Sink:
    """``sink``, given its tensor reshaped to ``shape`` (out of a view)."""
    return lambda g: sink(g.reshape(shape))
