"""The torch.distributed backend: gloo on CPU, NCCL on GPU.

gloo lacks a real reduce-scatter (torch emulates it with a full all-reduce
plus a copy), so on gloo ``reduce_scatter`` is an ``all_to_all_single``
followed by a local sum — each rank receives only its own slice from every
peer, half the bytes of an all-reduce — accumulated in float32 for 16-bit
floats. gloo's ``all_gather`` needs equal sizes: ``_ops`` pads uneven pieces.
Member order differing from torch's group-rank order (axes named out of mesh
order) is handled here by permuting chunks.

On gloo every tensor handed to torch.distributed is a fresh alias, anchored
while gloo may hold it (:mod:`._lent`): gloo's worker thread may drop a
finished work last, and must never need the GIL for that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..mesh._groups import Group, PGState
from ._agree import Call, agree
from ._backend import Pending
from ._lent import LOANS

__all__ = ["TORCH_BACKEND", "TorchBackend"]

# torch 2.13 renamed the flat collectives; older releases have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _loan(
    group: Group, *tensors: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """What to hand torch.distributed for ``tensors``, and what the
    ``Pending`` anchors while the work may hold it: aliases of them on gloo
    (whose worker threads may drop a finished work last: :mod:`._lent`);
    the tensors themselves, nothing lent, elsewhere."""
    if _backend_name(group) != "gloo":
        return tensors, ()
    aliases = LOANS.lend(*tensors)
    return aliases, aliases


def _member_rows(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows of ``t`` (indexed by member) reordered into torch group-rank order."""
    order = [group.member_of_torch_rank(r) for r in range(group.size)]
    return t[order]


class TorchBackend:
    """Collectives through ``torch.distributed`` process groups."""

    name = "torch"

    def attach(self, state: PGState, store: Any) -> None:
        """Nothing to set up: the mesh's process group is the transport."""

    def describe(self, group: Group) -> str:
        """How collectives on ``group`` run here, in words.

        >>> import shardax as sx
        >>> TORCH_BACKEND.describe(sx.Mesh({"x": 1}).group("x"))
        'local (one member)'
        """
        if group.state is None:
            return "local (one member)"
        return f"torch.distributed ({_backend_name(group)}) over ranks {group.members}"

    def all_reduce(self, x: torch.Tensor, op: str, group: Group) -> Pending:
        (a,), lent = _loan(group, x)
        work = dist.all_reduce(a, op=_REDUCE_OPS[op], group=group.pg, async_op=True)
        return Pending([work], lent=lent)

    def all_reduce_out(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> Pending:
        if out.data_ptr() != x.data_ptr():  # torch reduces in place
            out.copy_(x)
        return self.all_reduce(out, op, group)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        if group.in_torch_order:
            (o, a), lent = _loan(group, out, x)
            return Pending([_all_gather_flat(o, a, group=group.pg, async_op=True)], lent=lent)
        tmp = torch.empty_like(out)
        (t, a), lent = _loan(group, tmp, x)
        work = _all_gather_flat(t, a, group=group.pg, async_op=True)

        def after() -> None:
            rows, tmp_rows = out.view(group.size, -1), tmp.view(group.size, -1)
            rows.copy_(tmp_rows[[group.torch_rank(i) for i in range(group.size)]])

        return Pending([work], after, lent)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        if not group.in_torch_order:
            x = _member_rows(x, group)
        if _backend_name(group) != "gloo":
            work = _reduce_scatter_flat(out, x, group=group.pg, async_op=True)
            return Pending([work])
        recv = torch.empty_like(x)
        (r, a), lent = _loan(group, recv, x)
        work = dist.all_to_all_single(r, a, group=group.pg, async_op=True)

        def after() -> None:
            if recv.dtype in (torch.float16, torch.bfloat16):
                out.copy_(recv.float().sum(dim=0))
            else:
                torch.sum(recv, dim=0, out=out)

        return Pending([work], after, lent)

    def all_to_all(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
    ) -> Pending:
        if group.in_torch_order:
            (o, a), lent = _loan(group, out, x)
            work = dist.all_to_all_single(
                o, a, list(out_splits), list(in_splits), group=group.pg, async_op=True
            )
            return Pending([work], lent=lent)
        # Reorder chunks into torch group-rank order, and back on arrival.
        torder = [group.member_of_torch_rank(r) for r in range(group.size)]
        in_chunks = list(torch.split(x, list(in_splits)))
        x_t = torch.cat([in_chunks[m] for m in torder])
        out_t = torch.empty_like(out)
        out_sizes_t = [out_splits[m] for m in torder]
        (o, a), lent = _loan(group, out_t, x_t)
        work = dist.all_to_all_single(
            o, a, out_sizes_t, [in_splits[m] for m in torder], group=group.pg, async_op=True
        )

        def after() -> None:
            chunks = dict(zip(torder, torch.split(out_t, out_sizes_t), strict=True))
            out.copy_(torch.cat([chunks[m] for m in range(group.size)]))

        return Pending([work], after, lent)

    def broadcast(self, x: torch.Tensor, root: int, group: Group) -> Pending:
        (a,), lent = _loan(group, x)
        work = dist.broadcast(a, src=group.members[root], group=group.pg, async_op=True)
        return Pending([work], lent=lent)

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        group: Group,
        tag: int = 0,
    ) -> Pending:
        sent, lent_s = _loan(group, *(t for _, t in sends))
        got, lent_r = _loan(group, *(t for _, t in recvs))
        ops = [
            dist.P2POp(dist.isend, t, group.members[m], group.pg, tag)
            for (m, _), t in zip(sends, sent, strict=True)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, group.members[m], group.pg, tag)
            for (m, _), t in zip(recvs, got, strict=True)
        ]
        return Pending(dist.batch_isend_irecv(ops) if ops else [], lent=lent_s + lent_r)

    def barrier(self, group: Group) -> Pending:
        return Pending([dist.barrier(group=group.pg, async_op=True)])

    def agreed(
        self, sig: Sequence[int], call: Call, group: Group, issue: Callable[[], Pending]
    ) -> Pending:
        agree(self, sig, call, group)  # blocking: gloo aborts on buffers that do not fit
        return issue()


def _backend_name(group: Group) -> str:
    return str(dist.get_backend(group.pg))


TORCH_BACKEND = TorchBackend()
