"""Expert parallelism as rules: stacked expert weights split over ``ep``."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ShardingError
from ..moe._parallel import expert_parallel
from ..shard._matching import Rule, Rules
from ..shard._modules import ModuleRule, Relayout
from ..shard._spec import P, blocks

__all__ = ["experts"]


def experts(
    axis: str = "ep",
    module: str = r"(?:.*\.)?experts",
    *,
    tp: str | None = None,
    capacity_factor: float | None = None,
    batch: str | Sequence[str] | None = None,
) -> Rules:
    """Expert parallelism over ``axis``: the stacked weights of each experts
    module (the modules whose path fully matches ``module``; Hugging Face
    Mixtral and Qwen2-MoE: ``model.layers.N.mlp.experts``) split on dim 0 —
    the expert — with ``P(axis)`` in every role, so each rank holds, runs and
    updates only its experts; their forward replaced by
    :func:`shardax.moe.expert_parallel`, which sends each token to its
    experts' ranks and back. Everything else (attention, the router, shared
    experts) is left to the other rules: compose with ``+``, e.g.
    ``rules.experts("ep") + rules.zero(1, ("dp", "ep"))``.

    ``tp``: tensor parallelism inside each expert as well (``ep × tp``),
    Megatron's MLP split — each expert's gate and up rows split over ``tp``
    block by block (``gate_up_proj``: ``P(axis, blocks(2, tp), None)``, so
    each rank keeps its rows of both), ``down_proj`` on its input features
    (``P(axis, None, tp)``), the experts' partial outputs summed over
    ``tp`` once, after the tokens are back. Every ``tp`` rank routes the
    same tokens (activations are whole over ``tp``, as Megatron's): compose
    with ``rules.megatron(tp, names="auto")`` for the rest of the model.

    ``capacity_factor`` (and ``batch``, the axes the batch is split over:
    default ``axis``): token dropping as GShard's, the capacity counted
    over the whole batch so that the dropped pairs are those of one
    process (:func:`shardax.moe.expert_parallel`); None: dropless.

    >>> import shardax as sx
    >>> rules = sx.rules.experts("ep")
    >>> rules.match("model.layers.0.mlp.experts.gate_up_proj").spec
    P('ep')
    >>> both = sx.rules.experts("ep", tp="tp")
    >>> [both.match(f"layers.0.experts.{w}").spec for w in ("gate_up_proj", "down_proj")]
    [P('ep', blocks(2, 'tp'), None), P('ep', None, 'tp')]
    """
    forward = expert_parallel(axis, capacity_factor=capacity_factor, batch=batch)
    if tp is None:
        weights = rf"{module}\.(?:gate_up_proj|down_proj)"
        return Rules(Rule(weights, P(axis)), ModuleRule(module, forward=forward))
    if tp == axis:
        raise ShardingError(f"rules.experts: tp is another axis than the experts' {axis!r}")
    return Rules(
        Rule(rf"{module}\.gate_up_proj", P(axis, blocks(2, tp), None)),
        Rule(rf"{module}\.down_proj", P(axis, None, tp)),
        ModuleRule(module, forward=forward, output=Relayout(P(), P(), partial=tp)),
        divisible=True,
        tensor_parallel=tp,
    )
