"""Offload as a rule: a role of the matching parameters in another memory kind."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ShardingError
from ..shard._matching import Rules
from ..shard._memory import Offload

__all__ = ["offload"]


def offload(
    role: str | Sequence[str] = "opt_state",
    kind: str = "disk",
    *,
    path: str | None = None,
    pattern: str = ".*",
) -> Rules:
    """Keep ``role`` of the parameters whose key path fully matches
    ``pattern`` in memory ``kind``: ``"disk"`` (files in the folder
    ``path``, one per tensor, unlinked as they are made; also written
    ``"disk:PATH"``), ``"host"`` (pinned CPU memory beside a GPU) or
    ``"device"``. The roles: ``"opt_state"`` (the optimizer's state — Adam's
    moments, the fp32 master weights of ``optim.with_master_weights``),
    ``"params"`` (each rank's shards of the parameters) and ``"grads"`` (the
    reduced gradients, each written to its file as its reduction lands).

    The fused step (``optim.fused_step``) streams disk-resident state
    through the native kernel in waves, reading the next wave ahead while it
    updates this one and handing each back to its file once written: the
    rank holds a wave or two of the state, not all of it. ``optim.step``
    (pure), and the fused step where the kernels do not cover the
    optimizer, page the whole state in for the step and write the new state
    into files again. Compose with the model's rules: ``rules.zero(3) +
    rules.offload("opt_state", "disk", path="/scratch/opt")``.

    >>> import shardax as sx
    >>> sx.rules.offload("opt_state", "disk", path="/tmp/opt")
    Rules(Offload('opt_state', 'disk:/tmp/opt'))
    """
    if kind == "disk":
        if not path:
            raise ShardingError(
                "rules.offload(kind='disk') needs the folder for the files: path='/scratch/opt' "
                "(a local disk with room for the state)"
            )
        kind = f"disk:{path}"
    elif path is not None and not kind.startswith("disk:"):
        raise ShardingError(f"rules.offload: path= is for kind 'disk'; got kind {kind!r}")
    return Rules(Offload(role, kind, pattern))
