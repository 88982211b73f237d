"""The shardax side of a parity test: AdamW steps under value_and_grad on
this rank's slice of each global batch (split over ``dp`` when the mesh has
it), with the communication of every step counted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import shardax as sx

MEGATRON_CASES = [
    ({"tp": 2}, 0, False),
    ({"dp": 2, "tp": 2}, 1, False),
    ({"dp": 2, "tp": 2}, 3, False),
    ({"tp": 2}, 0, True),
    ({"dp": 2, "tp": 2}, 3, True),
]
"""``(mesh shape, ZeRO stage over dp, sequence parallel)`` every model is
trained on under ``rules.megatron``: the issue's tp=2, dp2×tp2 ZeRO-1/3,
with and without Megatron-SP."""
MEGATRON_IDS = ["tp2", "dp2xtp2-zero1", "dp2xtp2-zero3", "tp2-sp", "dp2xtp2-zero3-sp"]


def adamw_steps(
    params: dict[str, Any],
    loss_fn: Callable[..., torch.Tensor],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    mesh: sx.Mesh,
    hyper: tuple[float, tuple[float, float], float, float],
) -> tuple[list[float], dict[str, Any], list[str]]:
    """``(losses, final params, the collectives seen as "op over axes")``;
    ``hyper`` is ``(lr, betas, eps, weight_decay)``, as torch.optim.AdamW's."""
    lr, (b1, b2), eps, wd = hyper
    opt = sx.optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    opt_state = opt.init(params)
    dp = "dp" in mesh.axis_names
    n, i = (mesh.size("dp"), mesh.axis_index("dp")) if dp else (1, 0)
    losses, ops = [], set()
    for x, y in batches:
        rows = slice(i * len(x) // n, (i + 1) * len(x) // n)
        with sx.collectives.traffic() as seen:
            loss, grads = sx.value_and_grad(loss_fn)(params, x[rows], y[rows])
        ops |= set(seen.summary())
        params, opt_state = sx.optim.step(opt, grads, opt_state, params)  # buffers: grad None
        losses.append(loss.item())
    return losses, params, sorted(ops)


def torch_adamw_steps(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    hyper: tuple[float, tuple[float, float], float, float],
    clip: float = 0.0,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process reference: ``torch.optim.AdamW`` steps of
    ``model`` (clipping the gradient norm to ``clip`` first, when given);
    ``(losses, final parameters)``."""
    lr, betas, eps, wd = hyper
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
