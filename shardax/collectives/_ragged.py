"""``ragged_all_to_all``: every member sends each other member its own
number of rows — the token exchange of expert parallelism, where each rank
sends each expert's rank the tokens routed to it.

The op is a value like the others (:class:`RaggedAllToAll`), and its
transpose — the exchange back, send and receive sizes swapped — is in the
one table (:func:`shardax.collectives.transpose`): the gradient of the
dispatch is the combine, with no extra code."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from ..errors import CollectiveError
from ..mesh._mesh import Mesh
from ._api import Axis, _call, _group
from ._backend import Handle, start
from ._ops import Op, _check_len, _check_out, register_transpose

__all__ = ["RaggedAllToAll", "exchange_sizes", "ragged_all_to_all"]


@attrs.frozen
class RaggedAllToAll(Op):
    """Rows (dim 0) in runs: ``send_sizes[j]`` rows go to member ``j``, and
    ``recv_sizes[j]`` rows arrive from member ``j``, concatenated in member
    order. With ``out``, received into ``out``."""

    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    out: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    name: ClassVar[str] = "ragged_all_to_all"

    def __attrs_post_init__(self) -> None:
        n, g = self.group.size, self.group
        for what, sizes in (("send_sizes", self.send_sizes), ("recv_sizes", self.recv_sizes)):
            if len(sizes) != n or any(s < 0 for s in sizes):
                raise CollectiveError(
                    f"ragged_all_to_all over {g.label}: {what} {list(sizes)} must be {n} row "
                    "counts (one per member of the axis, none negative)"
                )

    def start(self, x: torch.Tensor) -> Handle:
        g, dest = self.group, self.out
        if x.dim() == 0:
            raise CollectiveError(
                f"ragged_all_to_all over {g.label}: its input needs a dim 0 of rows; got a scalar"
            )
        _check_len("ragged_all_to_all", g, x, 0, sum(self.send_sizes))
        shape = (sum(self.recv_sizes), *x.shape[1:])
        if dest is not None:
            _check_out("ragged_all_to_all", g, x, dest, shape)
        if g.size == 1:
            if self.send_sizes != self.recv_sizes:
                raise CollectiveError(
                    f"ragged_all_to_all over {g.label}: the one member sends itself "
                    f"{self.send_sizes[0]} rows but expects {self.recv_sizes[0]}"
                )
            return Handle.ready(x if dest is None else dest.copy_(x))
        row = math.prod(x.shape[1:])
        send = x.detach().contiguous().view(-1)
        direct = (
            dest is not None
            and dest.is_contiguous()
            and dest.untyped_storage().data_ptr() != send.untyped_storage().data_ptr()
        )
        out = dest.view(-1) if direct else send.new_empty(shape[0] * row)
        in_splits = [s * row for s in self.send_sizes]
        out_splits = [r * row for r in self.recv_sizes]

        def finish() -> torch.Tensor:
            if direct:
                return dest  # type: ignore[return-value]
            result = out.view(shape)
            return result if dest is None else dest.copy_(result)

        return start(
            g,
            "ragged_all_to_all",
            lambda b: b.all_to_all(out, send, out_splits, in_splits, g),
            finish,
        )


register_transpose(
    RaggedAllToAll, lambda op: RaggedAllToAll(op.group, op.recv_sizes, op.send_sizes)
)


def exchange_sizes(
    send_sizes: Sequence[int], axis: Axis, *, mesh: Mesh | None = None
) -> tuple[int, ...]:
    """What each member of ``axis`` sends this one, given what this one
    sends each (``send_sizes[j]``: to member ``j``): one all-to-all of the
    counts. The ``recv_sizes`` of :func:`ragged_all_to_all`.

    >>> import shardax as sx
    >>> sx.collectives.exchange_sizes([3], "ep", mesh=sx.Mesh({"ep": 1}))
    (3,)
    """
    group = _group(axis, mesh, "exchange_sizes")
    counts = [int(s) for s in send_sizes]
    if len(counts) != group.size or any(c < 0 for c in counts):
        raise CollectiveError(
            f"exchange_sizes over {group.label}: send_sizes {counts} must be {group.size} row "
            "counts (one per member of the axis, none negative)"
        )
    if group.size == 1:
        return tuple(counts)
    mine = torch.tensor(counts, dtype=torch.int64)
    got = RaggedAllToAll(group, (1,) * group.size, (1,) * group.size).run(mine)
    return tuple(int(c) for c in got.tolist())


def ragged_all_to_all(
    x: torch.Tensor,
    axis: Axis,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int] | None = None,
    *,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Send the rows of ``x`` (dim 0) in runs — the first ``send_sizes[0]``
    to member 0 of ``axis``, the next ``send_sizes[1]`` to member 1, … —
    and concatenate what arrives, member by member, on dim 0. Every member
    may send every other a different number of rows (zero included).

    ``recv_sizes[j]``, the rows member ``j`` sends this one, is exchanged
    first (:func:`exchange_sizes`) unless given; given, it must be what
    the senders send (checked where the group checks its collectives: on
    CPU by default). Backward: the exchange back, the sizes swapped.
    ``out``/``async_op``: the return rule (:mod:`shardax.collectives`).

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"ep": 1})  # launched on N ranks: {"ep": N}, N sizes
    >>> sx.collectives.ragged_all_to_all(torch.arange(6.0).view(3, 2), "ep", [3], mesh=mesh)
    tensor([[0., 1.],
            [2., 3.],
            [4., 5.]])
    """
    group = _group(axis, mesh, "ragged_all_to_all")
    sends = tuple(int(s) for s in send_sizes)
    if recv_sizes is None:
        recvs = exchange_sizes(sends, axis, mesh=mesh)
    else:
        recvs = tuple(int(r) for r in recv_sizes)
    return _call(x, RaggedAllToAll(group, sends, recvs, out=out), async_op, out)
