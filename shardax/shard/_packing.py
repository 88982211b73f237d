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
from typing import Any

import torch

from ..collectives._backend import start
from ..collectives._ops import AllGather, AllReduce, ReduceScatter, _offsets
from ..collectives._qgz import quantized_psum_scatter
from ..kernels._quant import dequantize_int8, quantize_int8, scale_count

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
    int8: bool = False,
) -> tuple[torch.Tensor, Callable[[], list[torch.Tensor]]]:
    """One all_gather for ``members``: ``(local piece, its gather, the
    gathered shape)``, all over one group and of one dtype. Returns the flat
    buffer the gathered tensors live in, and ``finish()`` -> those tensors
    (views of it, in member order).

    With ``int8`` (ZeRO++'s qwZ), each piece travels quantized blockwise
    (:func:`~shardax.kernels.quantize_int8`) and every rank, this one
    included, unpacks the dequantized values: all ranks compute with the
    same weights."""
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
    if int8:
        rows_of, handle = _start_int8_all_gather([local for local, _, _ in members], numels, group)
    else:
        send = torch.empty(m, dtype=dtype)
        torch.cat([local.reshape(-1) for local, _, _ in members], out=send[: per_member[me]])
        recv = torch.empty(n * m, dtype=dtype)
        handle = start(group, "all_gather", lambda b: b.all_gather(recv, send, group), lambda: None)
    flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype)

    def finish() -> list[torch.Tensor]:
        handle.wait()
        rows = rows_of() if int8 else recv.view(n, m)
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


def _start_int8_all_gather(
    locals_: Sequence[torch.Tensor], numels: Sequence[Sequence[int]], group: Any
) -> tuple[Callable[[], torch.Tensor], Any]:
    """All-gather the pieces ``locals_`` (this rank's, of one dtype; member
    ``j``'s piece on rank ``r`` has ``numels[j][r]`` elements) quantized:
    each piece on its own blocks (its values so depend on that piece alone,
    however the pieces are batched), a rank's row its int8 values then its
    fp32 scales, in one byte buffer. Returns ``rows()`` -> the dequantized
    rows ``[group size, longest row]``, each rank's pieces in member order
    (call it after the wait), and the handle."""
    n, me = group.size, group.index
    counts = [[_scale_count(k) for k in col] for col in numels]
    m = max(sum(col[r] for col in numels) for r in range(n))
    m_scales = max(sum(col[r] for col in counts) for r in range(n))
    start_scales = m + (-m) % 4  # 4-byte aligned
    width = start_scales + 4 * m_scales
    mine = torch.empty(width, dtype=torch.uint8)
    q, scales = mine[:m].view(torch.int8), mine[start_scales:].view(torch.float32)
    at = at_scale = 0
    for local, col, count in zip(locals_, numels, counts, strict=True):
        k, c = col[me], count[me]
        if k:
            quantize_int8(local, q[at : at + k], scales[at_scale : at_scale + c])
        at, at_scale = at + k, at_scale + c
    recv = torch.empty(n * width, dtype=torch.uint8)
    handle = start(group, "all_gather", lambda b: b.all_gather(recv, mine, group), lambda: None)
    dtype = locals_[0].dtype

    def rows() -> torch.Tensor:
        out = torch.empty((n, m), dtype=dtype)
        for r, row in enumerate(recv.view(n, width)):
            q, scales = row[:m].view(torch.int8), row[start_scales:].view(torch.float32)
            at = at_scale = 0
            for col, count in zip(numels, counts, strict=True):
                k, c = col[r], count[r]
                if k:
                    dequantize_int8(q[at : at + k], scales[at_scale : at_scale + c],
                                    out=out[r, at : at + k])  # fmt: skip
                at, at_scale = at + k, at_scale + c
        return out

    return rows, handle


def _scale_count(k: int) -> int:
    return scale_count(k) if k else 0


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
    int4: tuple[Any, tuple[str, ...]] | None = None,
) -> Callable[[], None]:
    """One reduce-scatter of every ``(tensor, its psum_scatter, sink)`` in
    ``bucket``, all over one group; ``finish()`` hands each sink this rank's
    piece of its sum.

    ``int4`` (ZeRO++'s qgZ): ``(mesh, axes across nodes)``; the packed
    rows are reduced by :func:`~shardax.collectives.quantized_psum_scatter`
    (int4, within the node over the group's other axes, then across),
    here and now (it is not asynchronous)."""
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
    if int4 is not None:
        mesh, across = int4
        within = tuple(a for a in group.axes if a not in across)
        recv = quantized_psum_scatter(send.view(-1), across, within, mesh=mesh)
        handle = None
    else:
        recv = send.new_empty(m)
        handle = start(
            group, "psum_scatter", lambda b: b.reduce_scatter(recv, send, group), lambda: None
        )

    def finish() -> None:
        if handle is not None:
            handle.wait()
        offset = 0
        for g, op, sink in bucket:
            shape = _piece_shape(g.shape, op.dim, op.sizes[me])
            k = math.prod(shape)
            sink(recv[offset : offset + k].view(shape))
            offset += k

    return finish
