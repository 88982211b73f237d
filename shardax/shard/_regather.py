"""Backward's regather (ZeRO-3): gathered parameters are not kept alive
between forward and backward, they are gathered again when backward needs
them (ZeRO, Rajbhandari et al. 2020, stage 3).

A :class:`Regather` is the pair of saved-tensor hooks one :func:`apply` call
runs its model under. While a unit's gathered buffers are held (its forward
runs), a tensor autograd saves that is a view into one of them is packed as
a token instead — the unit, which buffer, and the view's size, stride and
offset. The first time backward unpacks one of a unit's tokens, the unit is
gathered again (and, with prefetch, the unit before it, which backward
reaches next, is started meanwhile); after its last token the gathered
buffers are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import ShardingError
from ._transfer import Batch

__all__ = ["Regather"]


class Regather:
    """Saved-tensor hooks (:meth:`pack`, :meth:`unpack`) that keep a unit's
    gathered tensors as tokens and gather them again in backward with
    ``gather(unit index)``; :meth:`close` finishes what is still in flight."""

    def __init__(self, gather: Callable[[int], Batch], prefetch: bool) -> None:
        self.gather, self.prefetch = gather, prefetch
        self.live: dict[int, Batch] = {}  # unit -> its gathered buffers, while it runs
        self.held: dict[int, tuple[int, int]] = {}  # storage ptr -> (unit, base)
        self.tokens: dict[int, int] = {}  # unit -> its tokens not yet unpacked
        self.regathered: dict[int, Batch] = {}

    def hold(self, unit: int, gathered: Batch) -> None:
        """``gathered`` is ``unit``'s, live while its forward runs: tensors
        saved from its buffers become tokens."""
        self.live[unit] = gathered
        for j, base in enumerate(gathered.bases):
            if base.numel():
                self.held[base.untyped_storage().data_ptr()] = (unit, j)

    def release(self, unit: int) -> None:
        """``unit``'s forward is over: its buffers go when nothing else
        holds them."""
        gathered = self.live.pop(unit, None)
        for base in gathered.bases if gathered is not None else ():
            self.held.pop(base.untyped_storage().data_ptr(), None)

    def pack(self, t: torch.Tensor) -> Any:
        where = self.held.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if where is None:
            return t
        self.tokens[where[0]] = self.tokens.get(where[0], 0) + 1
        return (where, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        (unit, base), size, stride, offset = packed
        gathered = self.regathered.get(unit)
        if gathered is None:
            gathered = self.regathered[unit] = self.gather(unit)
        gathered.wait()
        if self.prefetch:
            self._prefetch(unit - 1)
        left = self.tokens.get(unit, 1) - 1
        self.tokens[unit] = left
        t = gathered.bases[base].as_strided(size, stride, offset)
        if left <= 0:
            self.regathered.pop(unit, None)
        return t

    def _prefetch(self, unit: int) -> None:
        if unit >= 0 and self.tokens.get(unit, 0) > 0 and unit not in self.regathered:
            self.regathered[unit] = self.gather(unit)

    def close(self) -> None:
        """Finish the regathers still in flight (every rank started them),
        and let go of ``gather``: it refers to the run that refers to this,
        a cycle that would keep the run's parameters and gradients alive
        until the garbage collector's next pass."""
        for gathered in self.regathered.values():
            gathered.wait()
        self.regathered.clear()
        self.live.clear()
        self.held.clear()
        self.gather = _closed


def _closed(unit: int) -> Batch:
    raise ShardingError(
        f"backward reached unit {unit} after its value_and_grad call ended: the graph "
        "of an apply under value_and_grad is differentiated once, inside that call; make "
        "what you differentiate part of the loss the function returns, or compute it "
        "again outside value_and_grad"
    )
