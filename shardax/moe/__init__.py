"""Mixture of experts: routing as pure functions, dispatch to stacked
experts (one batched matmul for all of them) and back, over an ``ep`` axis
with :func:`~shardax.collectives.ragged_all_to_all` (issue 22).

>>> import torch
>>> from shardax import moe
>>> x, router = torch.randn(6, 4), torch.randn(3, 4)       # 6 tokens, 3 experts
>>> routing = moe.route(x @ router.t(), k=2)
>>> buffer, plan = moe.dispatch(x, routing)                # [experts, slots, 4]
>>> gate_up, down = torch.randn(3, 8, 4), torch.randn(3, 4, 4)
>>> moe.combine(moe.swiglu_experts(buffer, gate_up, down), plan).shape
torch.Size([6, 4])
"""

from ._dispatch import Plan as Plan
from ._dispatch import capacity_of as capacity_of
from ._dispatch import combine as combine
from ._dispatch import dispatch as dispatch
from ._dispatch import swiglu_experts as swiglu_experts
from ._parallel import expert_parallel as expert_parallel
from ._router import Routing as Routing
from ._router import load_balancing_loss as load_balancing_loss
from ._router import route as route
from ._router import update_bias as update_bias
from ._router import z_loss as z_loss
from ._stats import ExpertLoad as ExpertLoad
from ._stats import expert_load as expert_load

__all__ = [
    "ExpertLoad",
    "Plan",
    "Routing",
    "capacity_of",
    "combine",
    "dispatch",
    "expert_load",
    "expert_parallel",
    "load_balancing_loss",
    "route",
    "swiglu_experts",
    "update_bias",
    "z_loss",
]
