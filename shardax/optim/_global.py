"""Transformations driven by statistics of whole tensors — the global norm
of all updates, each leaf's norm or RMS — which on Sharded leaves are
reduced over the shard axes, so every rank scales by the same factor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._base import (
    EmptyState,
    Flat,
    GradientTransformation,
    foreach,
    global_numel,
    leaf_path,
    needs_params,
    transformation,
    validate,
)
from ._norms import global_norm, sums_of_squares

__all__ = [
    "clip_by_block_rms",
    "clip_by_global_norm",
    "scale_by_param_block_rms",
    "scale_by_trust_ratio",
]


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates down so that their global norm is at most
    ``max_norm`` (Pascanu et al. 2013), as ``torch.nn.utils.clip_grad_norm_``:
    ``u * min(1, max_norm / (norm + 1e-6))``. The norm is that of the global
    tensors (see :func:`global_norm`), the same on every rank.

    >>> import torch
    >>> from shardax import optim
    >>> optim.clip_by_global_norm(1.0).update([torch.tensor([3.0, 4.0])], optim.EmptyState())[0]
    [tensor([0.6000, 0.8000])]
    """
    limit = validate("max_norm", max_norm, low_open=True)

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        flat = Flat(updates, "updates")
        if not len(flat):
            return updates, state
        coef = torch.clamp(limit / (global_norm(updates) + 1e-6), max=1.0)

        def clip(u: list[torch.Tensor]) -> list[torch.Tensor]:
            return torch._foreach_mul(u, coef.to(u[0].device, u[0].dtype))

        return flat.build(foreach(clip, flat.locals)), state

    return transformation(lambda params: EmptyState(), update)


def _per_leaf_factor(
    updates: Any, params: Any, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Any:
    flat = Flat(updates, "updates")
    u = flat.locals
    p_leaves = flat.align_leaves(params, "params")
    n = len(u)

    def describe(i: int) -> str:
        return (
            f"updates {leaf_path(updates, i)!r}"
            if i < n
            else f"params {leaf_path(params, i - n)!r}"
        )

    sq = sums_of_squares([*flat.leaves, *p_leaves], describe)
    out = [x * fn(sq[i], sq[n + i]).to(x.device, x.dtype) for i, x in enumerate(u)]
    return flat.build(out)


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> GradientTransformation:
    """LAMB's layer-wise trust ratio (You et al. 2020, "Large Batch
    Optimization for Deep Learning: Training BERT in 76 minutes"): scale each
    leaf's update by ``trust_coefficient * ||p|| / (||u|| + eps)``, or by 1
    where either norm is 0. The norms are those of the global tensors.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_trust_ratio()
    >>> p = [torch.tensor([6.0, 8.0])]
    >>> opt.update([torch.tensor([0.0, 2.0])], opt.init(p), p)[0]
    [tensor([ 0., 10.])]
    """
    min_norm = validate("min_norm", min_norm)
    coef = validate("trust_coefficient", trust_coefficient)
    eps = validate("eps", eps)

    def ratio(u_sq: torch.Tensor, p_sq: torch.Tensor) -> torch.Tensor:
        u_norm = u_sq.sqrt().clamp(min=min_norm)
        p_norm = p_sq.sqrt().clamp(min=min_norm)
        r = coef * p_norm / (u_norm + eps)
        return torch.where((u_norm == 0) | (p_norm == 0), torch.ones_like(r), r)

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        needs_params(params, "scale_by_trust_ratio")
        return _per_leaf_factor(updates, params, ratio), state

    return transformation(lambda params: EmptyState(), update)


def _describe(what: str, tree: Any) -> Callable[[int], str]:
    return lambda i: f"{what} {leaf_path(tree, i)!r}"


def _rms(leaves: list[Any], sq: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(s / max(global_numel(x), 1)).sqrt() for x, s in zip(leaves, sq, strict=True)]


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Divide each leaf's update by ``max(1, rms(u) / threshold)`` — the
    update clipping of Adafactor (Shazeer & Stern 2018), RMS over the global
    tensor.

    >>> import torch
    >>> from shardax import optim
    >>> optim.clip_by_block_rms(1.0).update([torch.full((4,), 3.0)], optim.EmptyState())[0]
    [tensor([1., 1., 1., 1.])]
    """
    limit = validate("threshold", threshold, low_open=True)

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        flat = Flat(updates, "updates")
        rms = _rms(flat.leaves, sums_of_squares(flat.leaves, _describe("updates", updates)))
        out = [
            u / torch.clamp(r / limit, min=1.0).to(u.device, u.dtype)
            for u, r in zip(flat.locals, rms, strict=True)
        ]
        return flat.build(out), state

    return transformation(lambda params: EmptyState(), update)


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Multiply each leaf's update by ``max(rms(p), min_scale)`` — Adafactor's
    relative step size (Shazeer & Stern 2018), RMS over the global tensor.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_param_block_rms()
    >>> p = [torch.full((2,), -3.0)]
    >>> opt.update([torch.ones(2)], opt.init(p), p)[0][0].round(decimals=4)
    tensor([3., 3.])
    """
    floor = validate("min_scale", min_scale)

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        needs_params(params, "scale_by_param_block_rms")
        flat = Flat(updates, "updates")
        p_leaves = flat.align_leaves(params, "params")
        rms = _rms(p_leaves, sums_of_squares(p_leaves, _describe("params", params)))
        out = [
            u * torch.clamp(r, min=floor).to(u.device, u.dtype)
            for u, r in zip(flat.locals, rms, strict=True)
        ]
        return flat.build(out), state

    return transformation(lambda params: EmptyState(), update)
