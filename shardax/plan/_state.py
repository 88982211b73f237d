"""The optimizer state the planner counts per element: each optimizer's
moments, an fp32 master copy under half precision, and under Muon 4 bytes
on its matrices, Adam's 8 elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import RunConfig

# muon: its matrices' momentum (Adam's 8 elsewhere: per leaf where the model is known)
OPT_STATE_BYTES = {
    "adam": 8,
    "adamw": 8,
    "lamb": 8,
    "lion": 4,
    "adagrad": 4,
    "rmsprop": 4,
    "muon": 4,
}


def _optimizer_bytes(config: RunConfig) -> int:
    """Optimizer state bytes per element: the moments, and an fp32 master
    copy for half-precision params."""
    o, prec = config.optimizer, config.precision
    state = OPT_STATE_BYTES.get(o.type, 4 if o.momentum else 0)
    if o.type == "rmsprop" and o.momentum:
        state += 4
    if prec.params != "fp32" and prec.master_weights:
        state += 4
    return state


def _leaf_state_bytes(config: RunConfig) -> Any:
    """:func:`_optimizer_bytes`, per leaf under Muon: 4 bytes of momentum on
    its matrices, Adam's 8 elsewhere (a leaf it refuses counted as Adam's)."""
    if config.optimizer.type != "muon":
        return _optimizer_bytes(config)
    from ..optim._muon import muon_state_bytes

    master = _optimizer_bytes(config) - OPT_STATE_BYTES["muon"]

    def per_leaf(path: str, shape: tuple[int, ...]) -> int:
        try:
            return muon_state_bytes(path, shape) + master
        except ValueError:  # ShardingError: a leaf muon would refuse
            return 8 + master

    return per_leaf
