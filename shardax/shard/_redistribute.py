"""The general relayout: every rank sends each other rank the intersection of
its piece with theirs, in one all-to-all. Used between different meshes over
the same ranks, where no single-axis collective applies."""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import attrs
import torch

from ..collectives._backend import Handle, start
from ..collectives._ops import Op, register_transpose
from ._layout import Layout

__all__ = ["Redistribute", "exchanges"]

Box = tuple[tuple[int, int], ...]


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


@functools.lru_cache(maxsize=256)
def exchanges(src: Layout, dst: Layout, shape: tuple[int, ...]) -> list[tuple[int, int, Box]]:
    """``(sender, receiver, global box)`` for every piece that moves (or is
    copied locally) from ``src`` to ``dst``; both layouts without partial axes.

    Each distinct source piece has one sender per receiver: the receiver
    itself when it holds that piece, otherwise a holder chosen round-robin.

    >>> from shardax import AbstractMesh, P
    >>> a, b = AbstractMesh({"x": 2}), AbstractMesh({"y": 2})
    >>> exchanges(Layout(a, P("x")), Layout(b, P(None, "y")), (2, 2))
    [(0, 0, ((0, 1), (0, 1))), (1, 0, ((1, 2), (0, 1))), (0, 1, ((0, 1), (1, 2))), (1, 1, ((1, 2), (1, 2)))]
    """
    n = src.mesh.world_size
    src_boxes = [src.local_bounds(shape, r) for r in range(n)]
    dst_boxes = [dst.local_bounds(shape, r) for r in range(n)]
    holders: dict[Box, list[int]] = {}
    for r, box in enumerate(src_boxes):
        holders.setdefault(box, []).append(r)
    out = []
    for q in range(n):
        for box, ranks in holders.items():
            piece = _intersect(box, dst_boxes[q])
            if piece is None:
                continue
            sender = q if q in ranks else ranks[q % len(ranks)]
            out.append((sender, q, piece))
    return out


def _rel(piece: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(piece, origin, strict=True))


@attrs.frozen
class Redistribute(Op):
    """Move a tensor from ``src`` to ``dst`` (no partial axes) by box
    intersection. ``transposed``: the linear transpose — every piece goes back
    to its sender and is added there (the result is partial over ``src``'s
    replicated axes)."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    transposed: bool = False
    name: ClassVar[str] = "redistribute"

    def start(self, x: torch.Tensor) -> Handle:
        g = self.group
        me = g.rank
        moves = exchanges(self.src, self.dst, self.shape)
        src_box = self.src.local_bounds(self.shape, me)
        dst_box = self.dst.local_bounds(self.shape, me)
        # Forward: senders read from their src piece, receivers write their dst piece.
        mine_in, mine_out = (dst_box, src_box) if self.transposed else (src_box, dst_box)
        sends: list[list[torch.Tensor]] = [[] for _ in range(g.size)]
        recvs: list[list[Box]] = [[] for _ in range(g.size)]
        for sender, receiver, piece in moves:
            frm, to = (receiver, sender) if self.transposed else (sender, receiver)
            if frm == me:
                sends[to].append(x.detach()[_rel(piece, mine_in)].reshape(-1))
            if to == me:
                recvs[frm].append(piece)
        out_shape = tuple(b - a for a, b in mine_out)
        out = x.new_zeros(out_shape)
        in_splits = [sum(t.numel() for t in ts) for ts in sends]
        out_splits = [sum(math.prod(b - a for a, b in p) for p in ps) for ps in recvs]
        send = torch.cat([t for ts in sends for t in ts]) if any(in_splits) else x.new_empty(0)
        recv = x.new_empty(sum(out_splits))

        def finish() -> torch.Tensor:
            flat = iter(
                torch.split(recv, [math.prod(b - a for a, b in p) for ps in recvs for p in ps])
            )
            for ps in recvs:
                for p in ps:
                    block = next(flat).view(tuple(b - a for a, b in p))
                    region = out[_rel(p, mine_out)]
                    region.add_(block) if self.transposed else region.copy_(block)
            return out

        if g.size == 1:
            recv.copy_(send)
            return Handle.ready(finish())
        return start(
            g, "redistribute", lambda b: b.all_to_all(recv, send, out_splits, in_splits, g), finish
        )


register_transpose(
    Redistribute, lambda op: Redistribute(op.group, op.src, op.dst, op.shape, not op.transposed)
)
