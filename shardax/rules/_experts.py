"""Expert parallelism as rules: stacked expert weights split over ``ep``."""

from __future__ import annotations

from ..moe._parallel import expert_parallel
from ..shard._matching import Rule, Rules
from ..shard._modules import ModuleRule
from ..shard._spec import P

__all__ = ["experts"]


def experts(axis: str = "ep", module: str = r"(?:.*\.)?experts") -> Rules:
    """Expert parallelism over ``axis``: the stacked weights of each experts
    module (the modules whose path fully matches ``module``; Hugging Face
    Mixtral and Qwen2-MoE: ``model.layers.N.mlp.experts``) split on dim 0 —
    the expert — with ``P(axis)`` in every role, so each rank holds, runs and
    updates only its experts; their forward replaced by
    :func:`shardax.moe.expert_parallel`, which sends each token to its
    experts' ranks and back. Everything else (attention, the router, shared
    experts) is left to the other rules: compose with ``+``, e.g.
    ``rules.experts("ep") + rules.zero(1, ("dp", "ep"))``.

    >>> import shardax as sx
    >>> rules = sx.rules.experts("ep")
    >>> rules.match("model.layers.0.mlp.experts.gate_up_proj").spec
    P('ep')
    """
    weights = rf"{module}\.(?:gate_up_proj|down_proj)"
    return Rules(Rule(weights, P(axis)), ModuleRule(module, forward=expert_parallel(axis)))
