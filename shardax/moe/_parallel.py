"""The forward of a stacked-experts module split over an ``ep`` axis, for
a :class:`~shardax.rules.ModuleRule` (``rules.experts`` installs it)."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, Mesh
from ._dispatch import combine, dispatch, swiglu_experts
from ._router import Routing

__all__ = ["expert_parallel"]

_NEEDS = ("gate_up_proj", "down_proj", "num_experts", "act_fn")


def expert_parallel(
    axis: str | None = "ep",
    *,
    capacity_factor: float | None = None,
    batch: str | Sequence[str] | None = None,
) -> Any:
    """A ``forward`` for :class:`~shardax.rules.ModuleRule` that runs a
    Hugging Face experts module (Mixtral's, Qwen2-MoE's: ``gate_up_proj``
    ``[E, 2f, d]``, ``down_proj`` ``[E, d, f]``, ``act_fn``, called with
    the hidden states and each token's chosen experts and weights) whose
    experts are split over ``axis``: this rank's tokens go to their
    experts' ranks (:func:`dispatch`), each rank runs its experts as two
    batched matmuls, and the outputs come back (:func:`combine`).
    ``axis=None``: every expert here (one process, or the reference run).

    ``capacity_factor``: each expert takes ``capacity_of(tokens, E, k,
    factor)`` of the batch's pairs, the batch being the tokens of every
    rank of ``batch`` (default: ``axis``; name every axis the batch is
    split over, e.g. ``("dp", "ep")``); those past it add nothing (the
    residual carries them) — the same pairs one process drops from the
    whole batch (under context parallelism, the same number: a zigzag piece
    is not in token order). None: the module's own ``capacity_factor`` attribute if it
    has one (Hugging Face's experts have none: dropless).

    >>> import torch, shardax as sx
    >>> forward = sx.moe.expert_parallel("ep")
    >>> forward.__name__
    "expert_parallel('ep')"
    """

    def forward(
        module: nn.Module,
        mesh: Mesh,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        missing = [a for a in _NEEDS if not hasattr(module, a)]
        if missing:
            raise ShardingError(
                f"expert_parallel over {axis!r}: {type(module).__name__} has no "
                f"{', '.join(missing)}; it runs experts stacked as Hugging Face's Mixtral and "
                f"Qwen2-MoE store them ({', '.join(_NEEDS)}, called with the hidden states and "
                "each token's chosen experts and weights): match rules.experts(module=...) to "
                "such a module"
            )
        gate_up, down = module.gate_up_proj, module.down_proj
        n, total = (1 if axis is None else mesh.size(axis)), int(module.num_experts)
        if gate_up.shape[0] * n != total or down.shape[0] * n != total:
            raise ShardingError(
                f"expert_parallel over {axis!r}: the module holds {gate_up.shape[0]} of its "
                f"{total} experts' gate_up_proj and {down.shape[0]} of their down_proj; each rank "
                f"of {axis!r} (size {n}) holds {total // max(n, 1)}: shard the stacked weights "
                f"with P({axis!r}) on dim 0 (rules.experts does)"
            )
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = Routing(top_k_index.reshape(x.shape[0], -1), top_k_weights, torch.empty(0))
        factor = capacity_factor
        if factor is None:  # the module's own, if it has one (the example GPT's experts)
            factor = getattr(module, "capacity_factor", None)
        buffer, plan = dispatch(
            x, routing, capacity_factor=factor, axis=axis, batch=batch,
            mesh=mesh if axis is not None or batch is not None else None, num_experts=total,
            layout="rows",
        )  # fmt: skip
        y = combine(
            swiglu_experts(buffer, gate_up, down, module.act_fn, offsets=plan.offsets), plan
        )
        return y.to(hidden_states.dtype).view_as(hidden_states)

    forward.explain = functools.partial(_explain, axis)  # type: ignore[attr-defined]
    extra = "" if capacity_factor is None else f", capacity_factor={capacity_factor!r}"
    extra += "" if batch is None else f", batch={batch!r}"
    forward.__name__ = f"expert_parallel({axis!r}{extra})"
    return forward


def _explain(
    axis: str | None,
    pattern: str,
    tensors: dict[str, tuple[tuple[int, ...], int]],
    mesh: AbstractMesh,
) -> list[str]:
    """What :func:`shardax.explain` prints of the experts modules matching
    ``pattern``: experts per rank, and the bytes each token moves."""
    regex = re.compile(pattern)
    stacks = [
        (path, shape, size)
        for path, (shape, size) in tensors.items()
        if path.endswith(".gate_up_proj") and regex.fullmatch(path[: -len(".gate_up_proj")])
    ]
    if not stacks:
        return []
    _, (experts, _, d), size = stacks[0]
    n = mesh.size(axis) if axis is not None and axis in mesh.axis_names else 1
    local = experts // n if experts % n == 0 else experts / n
    per_layer = 4 * (n - 1) / n * d * size  # out and back, forward and backward, per choice
    return [
        f"experts over {axis!r} ({n} ranks): {len(stacks)} layers of {experts} experts "
        f"(d={d}), {local:g} per rank — rank r holds experts {local:g}·r … {local:g}·(r+1)−1",
        f"  moved per token, per layer: 4·k·(n−1)/n·d·{size} B (its hidden state out to each "
        f"of its k experts on another rank and back, forward and backward, routing even) = "
        f"{per_layer:,.0f}·k B; {per_layer * len(stacks):,.0f}·k B over the {len(stacks)} layers",
    ]
