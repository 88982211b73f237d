"""Many transfers as few collectives: the gathers of a module's parameters
in one all_gather, and gradient reductions in size-capped buckets of one
reduce-scatter or all-reduce each, started as soon as a bucket fills.

Both pack the tensors' pieces rank by rank into one flat buffer (pieces are
taken along the dim each transfer splits, uneven and empty ones included),
run one backend collective, and unpack. Transfers whose plan is not a single
all_gather / psum_scatter / psum run on their own, in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..collectives._backend import Handle, start
from ..collectives._ops import AllGather, AllReduce, Op, ReduceScatter, _offsets
from ._layout import Layout
from ._transfer import View, _compile, _job

__all__ = ["Gathered", "Reducer", "start_gather"]

# A tensor this large, split evenly on dim 0, travels in a collective of its
# own straight between its buffers: no packing copy on the way in or out.
DIRECT_BYTES = 4 * 2**20


def _direct(x: torch.Tensor, op: AllGather | ReduceScatter) -> bool:
    return (
        op.dim == 0
        and len(set(op.sizes)) == 1
        and x.is_contiguous()
        and x.numel() * x.element_size() >= DIRECT_BYTES
    )


def _ops(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[Op, ...]:
    """The plan's ops, without those over one rank (they move nothing)."""
    return tuple(op for op in _compile(src, dst, shape, _job(src, dst)) if op.group.size > 1)


def _unview(ops: tuple[Op, ...]) -> tuple[View | None, tuple[Op, ...], View | None]:
    """A blocked dim's plan, ``View`` (into the expanded view), the
    collectives, ``View`` (back): the views split off, so that one
    all_gather or psum_scatter there fuses like any other (a view is a free
    reshape of the same bytes)."""
    pre = ops[0] if ops and isinstance(ops[0], View) else None
    post = ops[-1] if len(ops) > 1 and isinstance(ops[-1], View) else None
    return pre, ops[pre is not None : len(ops) - (post is not None)], post


def _piece_shape(shape: Sequence[int], dim: int, length: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = length
    return tuple(out)


class Gathered:
    """The result of :func:`start_gather`: ``wait()`` gives the tensors in
    item order; ``bases`` are the buffers this gather allocated (the tensors
    are views into them), in a deterministic order a re-gather repeats."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []
        self.tensors: list[torch.Tensor | None] = []
        self.bases: list[torch.Tensor] = []
        self._done = False

    def wait(self) -> list[torch.Tensor]:
        if not self._done:
            for step in self._steps:
                step()
            self._steps = []
            self._done = True
        return self.tensors  # type: ignore[return-value]


def start_gather(items: Sequence[tuple[Any, Layout]]) -> Gathered:
    """Start moving each ``(Sharded, layout)`` item's local tensor to
    ``layout`` (not differentiable). All-gathers over the same group and
    dtype travel together; other transfers run at ``wait()``; transfers that
    move nothing return the local tensor itself."""
    out = Gathered()
    out.tensors = [None] * len(items)
    fused: dict[tuple[int, torch.dtype], list[tuple[int, AllGather]]] = {}
    singles: list[tuple[int, tuple[Op, ...]]] = []
    for i, (x, layout) in enumerate(items):
        ops = _ops(x.layout, layout, x.shape)
        pre, core, post = _unview(ops)
        if not ops:
            out.tensors[i] = x.local.detach()
        elif len(core) == 1 and isinstance(core[0], AllGather):
            local = x.local.detach()
            if _direct(local if pre is None else local.reshape(pre.after), core[0]):
                out._steps.append(_start_direct_gather(i, local, layout, x, core[0], out))
            else:
                shape = (
                    post.before if post is not None else layout.local_shape(x.shape, x.mesh.rank)
                )
                fused.setdefault((id(core[0].group), x.dtype), []).append((i, core[0], shape))
        else:
            singles.append((i, ops))
    for members in fused.values():
        out._steps.append(_start_fused_gather(items, members, out))
    for i, ops in singles:

        def run(i: int = i, ops: tuple[Op, ...] = ops) -> None:
            t = items[i][0].local.detach()
            for op in ops:
                t = op.run(t)
            t = t.contiguous()
            out.tensors[i] = t
            out.bases.append(t)

        out._steps.append(run)
    return out


def _start_direct_gather(
    i: int, local: torch.Tensor, layout: Layout, x: Any, op: AllGather, out: Gathered
) -> Callable[[], None]:
    group = op.group
    full = torch.empty(layout.local_shape(x.shape, x.mesh.rank), dtype=local.dtype)
    handle = start(
        group,
        "all_gather",
        lambda b: b.all_gather(full.view(-1), local.reshape(-1), group),
        lambda: None,
    )
    out.bases.append(full)

    def finish() -> None:
        handle.wait()
        out.tensors[i] = full

    return finish


def _start_fused_gather(
    items: Sequence[tuple[Any, Layout]],
    members: list[tuple[int, AllGather, tuple[int, ...]]],
    out: Gathered,
) -> Callable[[], None]:
    """One all_gather for ``members``: ``(item, its gather, the gathered
    local shape in the gather's view)``."""
    group = members[0][1].group
    n, me = group.size, group.index
    # numel of every member's piece of every tensor
    shapes = [shape for _, _, shape in members]
    numels = [
        [math.prod(_piece_shape(shape, op.dim, s)) for s in op.sizes] for _, op, shape in members
    ]
    per_member = [sum(col[r] for col in numels) for r in range(n)]
    m = max(per_member)
    dtype = items[members[0][0]][0].dtype
    send = torch.empty(m, dtype=dtype)
    torch.cat(
        [items[i][0].local.detach().reshape(-1) for i, _, _ in members], out=send[: per_member[me]]
    )
    recv = torch.empty(n * m, dtype=dtype)
    handle = start(group, "all_gather", lambda b: b.all_gather(recv, send, group), lambda: None)
    flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype)
    out.bases.append(flat)

    def finish() -> None:
        handle.wait()
        rows = recv.view(n, m)
        offset = 0
        fulls = []
        for full_shape in shapes:
            k = math.prod(full_shape)
            fulls.append(flat[offset : offset + k].view(full_shape))
            offset += k
        for r in range(n):
            pos = 0
            for (_, op, _), full, col in zip(members, fulls, numels, strict=True):
                start_r = _offsets(op.sizes)[r]
                size_r = op.sizes[r]
                if size_r:
                    piece = rows[r, pos : pos + col[r]].view(
                        _piece_shape(full.shape, op.dim, size_r)
                    )
                    full.narrow(op.dim, start_r, size_r).copy_(piece)
                pos += col[r]
        for (i, _, _), full in zip(members, fulls, strict=True):
            x, layout = items[i]
            out.tensors[i] = full.view(layout.local_shape(x.shape, x.mesh.rank))

    return finish


class Reducer:
    """Reduces gradient contributions (in a partial layout) to their target
    layouts in buckets of about ``bucket_bytes``, each started as soon as it
    fills, at most ``in_flight`` at a time (the oldest is finished when a new
    one starts, so full-size gradients do not pile up); ``finish()`` starts
    the rest, waits for all and hands each result to its ``sink``."""

    def __init__(self, bucket_bytes: int, in_flight: int = 2) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.in_flight = in_flight
        self._open: dict[tuple[str, int, torch.dtype], list[tuple[torch.Tensor, Op, Any]]] = {}
        self._sizes: dict[tuple[str, int, torch.dtype], int] = {}
        self._flying: list[Callable[[], None]] = []

    def add(
        self,
        grad: torch.Tensor,
        src: Layout,
        dst: Layout,
        shape: tuple[int, ...],
        sink: Callable[[torch.Tensor], None],
    ) -> None:
        ops = _ops(src, dst, shape)
        if not ops:
            sink(grad)
            return
        pre, core, post = _unview(ops)
        op = core[0] if core else ops[0]
        if len(core) != 1 or not (
            isinstance(op, ReduceScatter) or (isinstance(op, AllReduce) and op.reduce == "sum")
        ):
            for o in ops:
                grad = o.run(grad)
            sink(grad)
            return
        if pre is not None:  # a blocked dim: reduce in its expanded view
            grad = grad.reshape(pre.after)
        if post is not None:
            sink = _viewed(sink, post.after)
        if isinstance(op, ReduceScatter) and _direct(grad, op):
            self._fly(_direct_reduce_scatter(grad, op, sink))
            return
        key = (type(op).__name__, id(op.group), grad.dtype)
        self._open.setdefault(key, []).append((grad, op, sink))
        self._sizes[key] = self._sizes.get(key, 0) + grad.numel() * grad.element_size()
        if self._sizes[key] >= self.bucket_bytes:
            self._launch(key)

    def _launch(self, key: tuple[str, int, torch.dtype]) -> None:
        bucket = self._open.pop(key)
        self._sizes.pop(key)
        if isinstance(bucket[0][1], AllReduce):
            self._fly(_all_reduce(bucket))
        else:
            self._fly(_reduce_scatter(bucket))

    def _fly(self, finish: Callable[[], None]) -> None:
        """Keep at most ``in_flight`` reductions going: finishing the oldest
        frees its full-size input while backward goes on."""
        self._flying.append(finish)
        while len(self._flying) > self.in_flight:
            self._flying.pop(0)()

    def finish(self) -> None:
        for key in list(self._open):
            self._launch(key)
        flying, self._flying = self._flying, []
        for done in flying:
            done()


def _viewed(sink: Callable[[torch.Tensor], None], shape: tuple[int, ...]) -> Callable[..., None]:
    return lambda g: sink(g.reshape(shape))


def _all_reduce(bucket: list[tuple[torch.Tensor, Op, Any]]) -> Callable[[], None]:
    group = bucket[0][1].group
    flat = torch.cat([g.reshape(-1) for g, _, _ in bucket])
    handle: Handle = start(group, "psum", lambda b: b.all_reduce(flat, "sum", group), lambda: None)

    def finish() -> None:
        handle.wait()
        offset = 0
        for g, _, sink in bucket:
            sink(flat[offset : offset + g.numel()].view(g.shape))
            offset += g.numel()

    return finish


def _direct_reduce_scatter(
    grad: torch.Tensor, op: ReduceScatter, sink: Callable[[torch.Tensor], None]
) -> Callable[[], None]:
    group = op.group
    n = group.size
    send = grad.view(n, -1)
    recv = grad.new_empty(send.shape[1])
    handle = start(
        group, "psum_scatter", lambda b: b.reduce_scatter(recv, send, group), lambda: None
    )

    def finish() -> None:
        handle.wait()
        sink(recv.view(op.sizes[group.index], *grad.shape[1:]))

    return finish


def _reduce_scatter(bucket: list[tuple[torch.Tensor, Op, Any]]) -> Callable[[], None]:
    group = bucket[0][1].group
    n, me = group.size, group.index
    pieces: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for g, op, _ in bucket:
        assert isinstance(op, ReduceScatter)
        for r, (o, s) in enumerate(zip(_offsets(op.sizes), op.sizes, strict=True)):
            pieces[r].append(g.narrow(op.dim, o, s).reshape(-1))
    lengths = [sum(p.numel() for p in row) for row in pieces]
    m = max(lengths)
    send = bucket[0][0].new_zeros((n, m))
    for r, row in enumerate(pieces):
        if row:
            torch.cat(row, out=send[r, : lengths[r]])
    recv = send.new_empty(m)
    handle: Handle = start(
        group, "psum_scatter", lambda b: b.reduce_scatter(recv, send, group), lambda: None
    )

    def finish() -> None:
        handle.wait()
        offset = 0
        for g, op, sink in bucket:
            shape = _piece_shape(g.shape, op.dim, op.sizes[me])
            k = math.prod(shape)
            sink(recv[offset : offset + k].view(shape))
            offset += k

    return finish
