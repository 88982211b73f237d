"""The forward of a stacked-experts module split over an ``ep`` axis, for
a :class:`~shardax.rules.ModuleRule` (``rules.experts`` installs it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..mesh._mesh import Mesh
from ._dispatch import combine, dispatch, swiglu_experts
from ._router import Routing

__all__ = ["expert_parallel"]


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
        buffer, plan = dispatch(
            x, routing, capacity_factor=capacity_factor, axis=axis, batch=batch,
            mesh=mesh if axis is not None or batch is not None else None, num_experts=total,
        )  # fmt: skip
        y = combine(swiglu_experts(buffer, gate_up, down, module.act_fn), plan)
        return y.to(hidden_states.dtype).view_as(hidden_states)

    extra = "" if capacity_factor is None else f", capacity_factor={capacity_factor!r}"
    extra += "" if batch is None else f", batch={batch!r}"
    forward.__name__ = f"expert_parallel({axis!r}{extra})"
    return forward
