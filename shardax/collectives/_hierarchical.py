"""Reductions over groups that span nodes, in three steps: over shared
memory among the members on each node, between one leader per node over
the torch backend (gloo), and back to the node's members over shared
memory. Each node's data crosses the network once per leader, not once per
member.

The leaders trade their node's result with every other leader and combine
them all in node order, so every leader — and every member — ends with the
same bits. That moves ``(nodes - 1)`` buffers per leader: made for the few
nodes of a CPU cluster (a ring would move two, at any node count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..mesh._groups import Group, PGState
from ._backend import Pending

__all__ = ["Hierarchy", "hierarchy"]

_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "sum": lambda acc, x: acc.add_(x),
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
}


@attrs.frozen
class Hierarchy:
    """How one group spanning nodes reduces, seen by one member.

    ``local`` is the group of this member's node (None when it is alone
    there), ``leaders`` the first member (global rank) of each node in node
    order, ``leader`` this node's.
    """

    local: Group | None
    leaders: tuple[int, ...]
    leader: int
    nodes: int

    def describe(self) -> str:
        sizes = f"{self.nodes} nodes"
        return f"hierarchical: shm within each node, the torch backend across {sizes}"


def hierarchy(ranks: Sequence[int], nodes: Sequence[str], me: int, state: PGState) -> Hierarchy:
    """The hierarchy of the group of ``ranks`` (sorted global ranks; member
    ``i`` on node ``nodes[i]``) for global rank ``me``."""
    order = list(dict.fromkeys(nodes))  # nodes by their lowest rank
    leaders = tuple(
        next(r for r, n in zip(ranks, nodes, strict=True) if n == node) for node in order
    )
    mine = nodes[list(ranks).index(me)]
    local_ranks = tuple(r for r, n in zip(ranks, nodes, strict=True) if n == mine)
    local = None
    if len(local_ranks) > 1:
        local_state = PGState(None, local_ranks, state.timeout)
        label = f"the members on this node of a group of ranks {tuple(ranks)}"
        local = Group(local_ranks, me, local_state, label)
    return Hierarchy(local, leaders, local_ranks[0], len(order))


def all_reduce(
    backend: Any, hier: Hierarchy, out: torch.Tensor, x: torch.Tensor, op: str, group: Group
) -> Pending:
    """``out`` ← reduction of every member's ``x`` over ``group``, by node."""
    if hier.local is not None:
        backend.all_reduce_out(out, x, op, hier.local).wait()
    elif out is not x:
        out.copy_(x)
    if group.rank == hier.leader:
        others = [r for r in hier.leaders if r != group.rank]
        index = {r: group.members.index(r) for r in others}
        got = {r: torch.empty_like(out) for r in others}
        backend.fallback.send_recv(
            [(index[r], out) for r in others], [(index[r], got[r]) for r in others], group
        ).wait()
        parts = [out if r == group.rank else got[r] for r in hier.leaders]
        total = parts[0]  # the accumulator: out itself, or a buffer received
        for part in parts[1:]:
            _COMBINE[op](total, part)
        if total is not out:
            out.copy_(total)
    if hier.local is not None:
        backend.broadcast(out, hier.local.members.index(hier.leader), hier.local).wait()
    return Pending()
