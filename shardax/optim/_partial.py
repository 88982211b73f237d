"""Gradients left partial (``value_and_grad(unreduced=...)``: each rank's
own contribution, for the 1-bit optimizers, which sum them themselves)
through the wrappers that relay gradients to their state's layouts
(``with_master_weights``, ``MultiSteps``): relaying would sum them."""

from __future__ import annotations

from typing import Any

from ..shard._layout import Layout
from ..shard._sharded import Sharded
from ..shard._transfer import transfer
from ._base import Flat, Leaf, flatten

__all__ = ["align_partial"]


def align_partial(flat: Flat, tree: Any, what: str) -> list[Leaf] | None:
    """``tree``'s leaves in the shardings of ``flat``'s leaves, those left
    partial still partial; None where none is partial
    (:meth:`Flat.align_leaves` then)."""
    leaves, spec = flatten(tree, what)
    if spec != flat.spec or not any(isinstance(x, Sharded) and x.partial for x in leaves):
        return None
    out: list[Leaf] = []
    for x, ref in zip(leaves, flat.leaves, strict=True):
        if isinstance(x, Sharded) and isinstance(ref, Sharded):
            target = Layout(ref.layout.sharding, partial=x.partial)
            out.append(x if x.layout == target else transfer(x, target))
        else:
            out.append(x.local if isinstance(x, Sharded) else x)
    return out
