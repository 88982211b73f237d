"""What the experts were given: every :func:`~shardax.moe.dispatch` under
:func:`expert_load` reports its per-expert load and dropped pairs — how
:class:`shardax.monitor.Monitor` draws the load histogram and the dropped
fraction of each step. A no-op costing one context-variable lookup when
nothing listens."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from .. import collectives as C
from ..mesh._mesh import Mesh
from ..shard._keep import uncounted
from ..shard._remat import recomputing

if TYPE_CHECKING:
    from ._dispatch import Plan

__all__ = ["ExpertLoad", "expert_load"]


class ExpertLoad(NamedTuple):
    """The routing of some dispatches, summed over the batch's ranks.

    ``load``: ``[layers, experts]`` (token, choice) pairs routed to each
    expert, before capacity; ``dropped``: ``[layers]`` pairs past capacity.
    """

    load: torch.Tensor
    dropped: torch.Tensor

    @property
    def dropped_fraction(self) -> float:
        """The share of all pairs that were dropped (0 when dropless)."""
        pairs = float(self.load.sum())
        return float(self.dropped.sum()) / pairs if pairs else 0.0

    @property
    def histogram(self) -> list[float]:
        """Each expert's share of the pairs, summed over the layers (1/E each
        when perfectly balanced)."""
        per_expert = self.load.sum(0).double()
        return (per_expert / per_expert.sum().clamp(min=1)).tolist()


class _Listener:
    def __init__(self) -> None:
        self.loads: list[torch.Tensor] = []
        self.dropped: list[int] = []
        self.batch: tuple[str, ...] = ()
        self.mesh: Mesh | None = None


_ACTIVE: contextvars.ContextVar[_Listener | None] = contextvars.ContextVar(
    "shardax_expert_load", default=None
)


def record(plan: Plan, batch: tuple[str, ...]) -> None:
    """Report one dispatch to the listener, if any — once per forward: not
    again when backward recomputes a rematerialised layer."""
    listener = _ACTIVE.get()
    if listener is None or recomputing():
        return
    with uncounted():  # not an op of the forward that a remat policy keeps
        listener.loads.append(plan.load.detach().long())
    listener.dropped.append(plan.dropped)
    if plan.mesh is not None and not listener.batch:
        listener.batch, listener.mesh = batch, plan.mesh


class _Result:
    """Filled when the ``with`` block ends: :meth:`total` sums over ranks."""

    def __init__(self, listener: _Listener) -> None:
        self._listener = listener

    @property
    def dispatches(self) -> int:
        """How many dispatches reported (one per MoE layer per forward)."""
        return len(self._listener.loads)

    def local(self) -> ExpertLoad:
        """This rank's dispatches alone (no communication)."""
        listener = self._listener
        if not listener.loads:
            return ExpertLoad(torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        return ExpertLoad(
            torch.stack(listener.loads).long(), torch.tensor(listener.dropped, dtype=torch.long)
        )

    def load_record(self) -> dict[str, object]:
        """:meth:`total` as a monitor's record: ``expert_load`` (each
        expert's share of the pairs), ``expert_load_max`` (the busiest
        expert's share times the number of experts: 1.0 is balanced) and
        ``dropped_fraction``."""
        load = self.total()
        if load.load.numel() == 0:
            return {}
        shares = load.histogram
        return {
            "expert_load": shares,
            "expert_load_max": max(shares) * len(shares),
            "dropped_fraction": load.dropped_fraction,
        }

    def total(self) -> ExpertLoad:
        """This rank's dispatches summed with the other ranks of the batch
        (one all-reduce over the axes the first dispatch named: call it on
        every rank of those axes)."""
        listener, mine = self._listener, self.local()
        if not listener.loads:
            return mine
        both = torch.cat([mine.load, mine.dropped[:, None]], dim=1)
        mesh, batch = listener.mesh, listener.batch
        if mesh is not None and batch and mesh.size(batch) > 1:
            both = C.psum(both, batch, mesh=mesh)
        return ExpertLoad(both[:, :-1], both[:, -1])


def listener() -> _Result:
    """A fresh, inactive listener (:func:`listening` activates it)."""
    return _Result(_Listener())


@contextlib.contextmanager
def listening(result: _Result) -> Iterator[_Result]:
    """Report the dispatches inside to ``result`` (which may already hold
    some), and to the listener outside, if any (listeners nest)."""
    outer, inner = _ACTIVE.get(), result._listener
    start = len(inner.loads)
    token = _ACTIVE.set(inner)
    try:
        yield result
    finally:
        _ACTIVE.reset(token)
        if outer is not None and outer is not inner:
            outer.loads.extend(inner.loads[start:])
            outer.dropped.extend(inner.dropped[start:])
            if not outer.batch:
                outer.batch, outer.mesh = inner.batch, inner.mesh


@contextlib.contextmanager
def expert_load() -> Iterator[_Result]:
    """Listen to every :func:`~shardax.moe.dispatch` inside: their
    per-expert loads and dropped pairs, totalled over the batch's ranks by
    ``.total()``.

    >>> import torch
    >>> from shardax import moe
    >>> r = moe.route(torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), 1)
    >>> with moe.expert_load() as seen:
    ...     _ = moe.dispatch(torch.ones(3, 4), r, capacity=1)
    >>> load = seen.total()
    >>> load.load.tolist(), load.dropped.tolist(), round(load.dropped_fraction, 3)
    ([[2, 1]], [1], 0.333)
    """
    with listening(listener()) as result:
        yield result
