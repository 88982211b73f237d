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


def zero(
    stage: int,
    axis: str | Iterable[str] = "dp",
    *,
    quantize_weights: bool = False,
    secondary: str | Iterable[str] | None = None,
    quantize_grads: bool = False,
    persist_below: int = 0,
    keep_gathered: bool = False,
) -> Rules:
    """ZeRO (Rajbhandari et al., 2020) as rules: stage 1 splits the optimizer
    state over ``axis``, stage 2 also the gradients (reduced with
    ``psum_scatter``, never a full replicated gradient), stage 3 also the
    parameters (gathered module by module in :func:`shardax.apply`). Stage 0
    is plain data parallelism. Compose with rules on other axes with ``+``.

    ZeRO++ (Wang et al., 2023), for stage 3 across slow links:

    - ``quantize_weights=True`` (qwZ): the parameter gathers send blockwise
      int8 (one fp32 scale per 256 values): about a quarter of fp32's bytes.
      Every rank computes with the same dequantized weights; the fp32 shards,
      gradients and optimizer stay exact.
    - ``secondary="local"`` (hpZ): the forward keeps a second copy of each
      gathered parameter split over ``secondary`` — the axes within a node,
      some of ``axis`` — and backward gathers it over those only: its
      gathers never cross nodes, for ``1/size(secondary)`` of the parameters
      held per rank from forward to backward.
    - ``quantize_grads=True`` (qgZ, stage 2 or 3, over two axes: across
      nodes, then within): gradients are reduce-scattered in blockwise
      int4, by an all-to-all within each node, a sum, and one across nodes
      (:func:`shardax.collectives.quantized_psum_scatter`). Lossy: each
      contribution is off by up to half an int4 step of its block.

    ``persist_below=N`` (stage 3): parameters of fewer than ``N`` elements
    stay whole on every rank — no gathers for them in forward or backward,
    their gradients reduce-scattered and their optimizer state split as
    the others', each update all-gathered once: two gradient-sized
    transfers a step instead of three, for their (small) memory on every
    rank. DeepSpeed's ``stage3_param_persistence_threshold`` (default
    100000 there; 0 here: every parameter split).

    ``keep_gathered=True`` (stage 3): the parameters the forward gathers
    stay until backward has used them, instead of being gathered again —
    FSDP2's ``reshard_after_forward=False``, and what DeepSpeed does where
    ``stage3_max_reuse_distance`` covers the model: two transfers a step
    instead of three, for the whole parameters held from a block's
    forward to its backward (ZeRO-2's memory for them during the step;
    they are split between steps).

    >>> import shardax as sx
    >>> sx.rules.zero(2)
    Rules(ShardOver('dp', roles=('grads', 'opt_state')))
    >>> rules = sx.rules.zero(3)
    >>> mesh = sx.AbstractMesh({"dp": 4})
    >>> [rules.spec_for("w", (8, 3), mesh, role) for role in ("params", "compute")]
    [P('dp'), P()]
    >>> zpp = sx.rules.zero(3, ("node", "local"), quantize_weights=True, secondary="local")
    >>> zpp.placement("w", (8, 3), sx.AbstractMesh({"node": 2, "local": 2}))
    Placement(compute=P(), grads=P(('node', 'local')), opt_state=P(('node', 'local')), weights='int8', secondary=P('local'))
    >>> small = sx.rules.zero(3, persist_below=100_000)
    >>> [small.spec_for(p, s, mesh, "params") for p, s in (("fc.weight", (512, 512)), ("fc.bias", (512,)))]
    [P('dp'), P()]
    >>> small.spec_for("fc.bias", (512,), mesh, "grads")
    P('dp')
    """
    if isinstance(stage, bool) or stage not in _STAGES:
        raise ShardingError(f"ZeRO stage is 0, 1, 2 or 3; got {stage!r}")
    if stage < 2 and quantize_grads:
        raise ShardingError(
            f"rules.zero({stage}, quantize_grads=True): qgZ reduce-scatters split gradients, and "
            "stages 0 and 1 all-reduce whole ones; use rules.zero(2 or 3, ...)"
        )
    if stage != 3 and persist_below:
        raise ShardingError(
            f"rules.zero({stage}, persist_below={persist_below!r}): it keeps small parameters "
            "whole where stage 3 would split them, and stages 0-2 keep every parameter whole; "
            "use rules.zero(3, persist_below=...)"
        )
    if stage != 3 and keep_gathered:
        raise ShardingError(
            f"rules.zero({stage}, keep_gathered=True): it keeps gathered parameters for backward, "
            "and only stage 3 gathers them; use rules.zero(3, keep_gathered=True)"
        )
    if stage != 3 and (quantize_weights or secondary):
        raise ShardingError(
            f"rules.zero({stage}, quantize_weights=..., secondary=...): ZeRO++'s weight options "
            "change how split parameters are gathered, and only stage 3 splits them; use "
            "rules.zero(3, ...)"
        )
    roles = _STAGES[stage]
    if not roles:
        return Rules()
    return Rules(
        ShardOver(
            axis,
            roles=roles,
            quantize_weights=quantize_weights,
            secondary=secondary or (),
            quantize_grads=quantize_grads,
            persist_below=persist_below,
            keep_gathered=keep_gathered,
        )
    )
