"""Updates that are each rank's own (0/1 Adam's local steps) make their
params each rank's own: :func:`diverging`, for ``apply_updates``."""

from __future__ import annotations

from typing import Any

import attrs
import optree

from ..shard._layout import Layout
from ..shard._sharded import Sharded

__all__ = ["diverging"]


def _is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def diverging(params: Any, updates: Any) -> Any:
    """``params`` with each Sharded leaf whose update is diverged over axes
    it is replicated on laid out diverged there too: the sum of a replica
    and a rank's own change is that rank's own copy, never a replica."""
    p_leaves, spec = optree.tree_flatten(params, is_leaf=_is_sharded, none_is_leaf=True)
    u_leaves, u_spec = optree.tree_flatten(updates, is_leaf=_is_sharded, none_is_leaf=True)
    if u_spec != spec or not any(isinstance(u, Sharded) and u.layout.diverged for u in u_leaves):
        return params
    out = []
    for p, u in zip(p_leaves, u_leaves, strict=True):
        if isinstance(p, Sharded) and isinstance(u, Sharded):
            more = tuple(a for a in u.layout.diverged if a in p.layout.replicated)
            if more:
                lay = p.layout
                wider = Layout(lay.sharding, partial=lay.partial, diverged=lay.diverged + more)
                p = attrs.evolve(p, layout=wider)
        out.append(p)
    return optree.tree_unflatten(spec, out)
