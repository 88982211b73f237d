"""One backend collective for many tensors: each tensor's pieces are packed
rank by rank into one flat buffer (pieces taken along the dim the collective
splits, uneven and empty ones included), the collective runs once on it, and
the results are unpacked as views of one buffer or handed to sinks.

This module knows collectives and shapes, not layouts or plans: which
tensors travel together is :mod:`._transfer`'s choice. Each ``start_*``
function issues its collective at once and returns what finishes it (waits,
then unpacks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..collectives._backend import start
from ..collectives._ops import AllGather, AllReduce, ReduceScatter, _offsets

__all__ = [
    "DIRECT_BYTES",
    "Sink",
    "direct",
    "start_all_gather",
    "start_all_gather_direct",
    "start_psum",
    "start_psum_scatter",
    "start_psum_scatter_direct",
]

Sink = Callable[[torch.Tensor], None]

# A tensor this large, split evenly on dim 0, travels in a collective of its
# own straight between its buffers: no packing copy on the way in or out.
DIRECT_BYTES = 4 * 2**20


def direct(x: torch.Tensor, op: AllGather | ReduceScatter) -> bool:
    """Whether ``x`` takes ``op`` on its own, with no packing (see
    :data:`DIRECT_BYTES`)."""
    return (
        op.dim == 0
        and len(set(op.sizes)) == 1
        and x.is_contiguous()
        and x.numel() * x.element_size() >= DIRECT_BYTES
    )


def _piece_shape(shape: Sequence[int], dim: int, length: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = length
    return tuple(out)


# -- gathers --------------------------------------------------------------------


def start_all_gather_direct(
    local: torch.Tensor, op: AllGather, shape: tuple[int, ...]
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """``op`` on ``local`` alone, into a new tensor of ``shape`` (the
    gathered local shape): that tensor, and ``finish() -> it``."""
    group = op.group
    full = torch.empty(shape, dtype=local.dtype)
    handle = start(
        group,
        "all_gather",
        lambda b: b.all_gather(full.view(-1), local.reshape(-1), group),
        lambda: None,
    )

    def finish() -> torch.Tensor:
        handle.wait()
        return full

    return full, finish


def start_all_gather(
    members: Sequence[tuple[torch.Tensor, AllGather, tuple[int, ...]]],
) -> tuple[torch.Tensor, Callable[[], list[torch.Tensor]]]:
    """One all_gather for ``members``: ``(local piece, its gather, the
    gathered shape)``, all over one group and of one dtype. Returns the flat
    buffer the gathered tensors live in, and ``finish()`` -> those tensors
    (views of it, in member order)."""
    group = members[0][1].group
    n, me = group.size, group.index
    shapes = [shape for _, _, shape in members]
    # numel of every member's piece of every tensor
    numels = [
        [math.prod(_piece_shape(shape, op.dim, s)) for s in op.sizes] for _, op, shape in members
    ]
    per_member = [sum(col[r] for col in numels) for r in range(n)]
    m = max(per_member)
    dtype = members[0][0].dtype
    send = torch.empty(m, dtype=dtype)
    torch.cat([local.reshape(-1) for local, _, _ in members], out=send[: per_member[me]])
    recv = torch.empty(n * m, dtype=dtype)
    handle = start(group, "all_gather", lambda b: b.all_gather(recv, send, group), lambda: None)
    flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype)

    def finish() -> list[torch.Tensor]:
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
                size_r = op.sizes[r]
                if size_r:
                    piece = rows[r, pos : pos + col[r]].view(
                        _piece_shape(full.shape, op.dim, size_r)
                    )
                    full.narrow(op.dim, _offsets(op.sizes)[r], size_r).copy_(piece)
                pos += col[r]
        return fulls

    return flat, finish


# -- reductions -------------------------------------------------------------------


def start_psum(bucket: Sequence[tuple[torch.Tensor, AllReduce, Sink]]) -> Callable[[], None]:
    """One all-reduce (sum) of every ``(tensor, its psum, sink)`` in
    ``bucket``; ``finish()`` hands each sink its sum."""
    group = bucket[0][1].group
    flat = torch.cat([g.reshape(-1) for g, _, _ in bucket])
    handle = start(group, "psum", lambda b: b.all_reduce(flat, "sum", group), lambda: None)

    def finish() -> None:
        handle.wait()
        offset = 0
        for g, _, sink in bucket:
            sink(flat[offset : offset + g.numel()].view(g.shape))
            offset += g.numel()

    return finish


def start_psum_scatter_direct(
    grad: torch.Tensor, op: ReduceScatter, sink: Sink
) -> Callable[[], None]:
    """``op`` on ``grad`` alone, straight from its buffer (``direct`` holds);
    ``finish()`` hands ``sink`` this rank's piece."""
    group = op.group
    send = grad.view(group.size, -1)
    recv = grad.new_empty(send.shape[1])
    handle = start(
        group, "psum_scatter", lambda b: b.reduce_scatter(recv, send, group), lambda: None
    )

    def finish() -> None:
        handle.wait()
        sink(recv.view(op.sizes[group.index], *grad.shape[1:]))

    return finish


def start_psum_scatter(
    bucket: Sequence[tuple[torch.Tensor, ReduceScatter, Sink]],
) -> Callable[[], None]:
    """One reduce-scatter of every ``(tensor, its psum_scatter, sink)`` in
    ``bucket``, all over one group; ``finish()`` hands each sink this rank's
    piece of its sum."""
    group = bucket[0][1].group
    n, me = group.size, group.index
    pieces: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for g, op, _ in bucket:
        for r, (o, s) in enumerate(zip(_offsets(op.sizes), op.sizes, strict=True)):
            pieces[r].append(g.narrow(op.dim, o, s).reshape(-1))
    lengths = [sum(p.numel() for p in row) for row in pieces]
    m = max(lengths)
    send = bucket[0][0].new_zeros((n, m))
    for r, row in enumerate(pieces):
        if row:
            torch.cat(row, out=send[r, : lengths[r]])
    recv = send.new_empty(m)
    handle = start(
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
