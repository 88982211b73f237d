"""ZeRO stages 0–3 as rules: ``ShardOver`` entries over the data axes."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ShardingError
from ..shard._matching import Rules
from ..shard._placement import ShardOver

__all__ = ["zero"]


_STAGES = {
    0: (),
    1: ("opt_state",),
    2: ("grads", "opt_state"),
    3: ("params", "grads", "opt_state"),
}


def zero(stage: int, axis: str | Iterable[str] = "dp") -> Rules:
    """ZeRO (Rajbhandari et al., 2020) as rules: stage 1 splits the optimizer
    state over ``axis``, stage 2 also the gradients (reduced with
    ``psum_scatter``, never a full replicated gradient), stage 3 also the
    parameters (gathered module by module in :func:`shardax.apply`). Stage 0
    is plain data parallelism. Compose with rules on other axes with ``+``.

    >>> import shardax as sx
    >>> sx.rules.zero(2)
    Rules(ShardOver('dp', roles=('grads', 'opt_state')))
    >>> rules = sx.rules.zero(3)
    >>> mesh = sx.AbstractMesh({"dp": 4})
    >>> [rules.spec_for("w", (8, 3), mesh, role) for role in ("params", "compute")]
    [P('dp'), P()]
    """
    if isinstance(stage, bool) or stage not in _STAGES:
        raise ShardingError(f"ZeRO stage is 0, 1, 2 or 3; got {stage!r}")
    roles = _STAGES[stage]
    return Rules(ShardOver(axis, roles=roles)) if roles else Rules()
