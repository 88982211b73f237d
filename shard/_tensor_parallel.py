"""Functional helpers for the parts of a transformer that compute differently
when a tensor-parallel axis splits them: an embedding whose vocabulary is
split over ``tp``, and the cross-entropy of logits split over the vocabulary
(which never materialises the full logits on one rank).

Both follow the gradient convention of :mod:`shardax.collectives`: their
collectives are ``psum``/``pmax``, whose transposes keep gradients exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..collectives import _api as C
from ..collectives._api import Axis
from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh
from ._layout import Layout
from ._spec import P

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_embedding"]


def _piece(n: int, axis: Axis, mesh: Any) -> tuple[int, int]:
    """``[start, stop)`` of this rank's piece of ``n`` rows split over ``axis``."""
    rank = getattr(mesh, "rank", 0)
    return Layout(mesh, P(axis)).local_bounds((n,), rank)[0]


def vocab_parallel_embedding(axis: Axis = "tp") -> Any:
    """A ``forward`` for :class:`ModuleRule` that runs an ``nn.Embedding``
    whose weight rows (the vocabulary) are split over ``axis``: each rank
    looks up the ids in its rows and zeros the others — a partial sum over
    ``axis``, which the rule's ``output`` relayout completes (a ``psum``, or
    with sequence parallelism a ``psum_scatter``): Megatron-LM's
    vocab-parallel embedding.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"tp": 1})
    >>> emb = torch.nn.Embedding(5, 2)
    >>> forward = sx.vocab_parallel_embedding("tp")
    >>> torch.equal(forward(emb, mesh, torch.tensor([4, 0])), emb(torch.tensor([4, 0])))
    True
    """

    def forward(module: nn.Module, mesh: AbstractMesh, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(module, nn.Embedding):
            raise ShardingError(
                f"vocab_parallel_embedding runs nn.Embedding modules; got {type(module).__name__}"
            )
        start, stop = _piece(module.num_embeddings, axis, mesh)
        weight = module.weight
        if weight.shape[0] != stop - start:
            raise ShardingError(
                f"vocab_parallel_embedding over {axis!r}: the weight holds {weight.shape[0]} rows, "
                f"this rank's piece of {module.num_embeddings} is {stop - start}; shard the "
                f"embedding weight with P({axis!r}, None) (rules.megatron does)"
            )
        local = ids - start
        inside = (local >= 0) & (local < stop - start)
        rows = F.embedding(local.clamp(0, max(stop - start - 1, 0)), weight)
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    forward.__name__ = f"vocab_parallel_embedding({axis!r})"
    return forward


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    axis: Axis = "tp",
    *,
    mesh: Any = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` whose last dim (the
    vocabulary) is split over ``axis`` — this rank's piece, in
    ``torch.chunk`` order — against global ``targets``; the same value on
    every rank of ``axis``. The vocabulary splits evenly (``rules.megatron``
    checks it). Only this rank's piece of the logits, and a few
    per-position numbers, exist on any rank: memory is about ``1/size`` of
    the full logits'. Targets equal to ``ignore_index`` do not count.

    Computed in fp32: ``log Σ exp(z - max) + max - z[target]`` with the max,
    the sum and the target logit each completed by one collective over ``axis``.

    >>> import torch, torch.nn.functional as F, shardax as sx
    >>> mesh = sx.Mesh({"tp": 1})
    >>> logits, y = torch.randn(3, 7), torch.tensor([1, 6, 0])
    >>> loss = sx.vocab_parallel_cross_entropy(logits, y, "tp", mesh=mesh)
    >>> torch.allclose(loss, F.cross_entropy(logits, y))
    True
    """
    if logits.shape[:-1] != targets.shape:
        raise ShardingError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} need targets of shape "
            f"{tuple(logits.shape[:-1])}; got {tuple(targets.shape)}"
        )
    m = C._resolve_mesh(mesh, "vocab_parallel_cross_entropy")
    n = logits.shape[-1]
    start = C.axis_index(axis, mesh=m) * n  # vocabularies split evenly (rules.megatron checks)
    z = logits.float()
    top = C.pmax(z.detach().amax(-1), axis, mesh=m)  # for stability only: no gradient
    z = z - top.unsqueeze(-1)
    sum_exp = C.psum(z.exp().sum(-1), axis, mesh=m)
    local = targets - start
    inside = (local >= 0) & (local < n)
    picked = z.gather(-1, local.clamp(0, max(n - 1, 0)).unsqueeze(-1)).squeeze(-1)
    target = C.psum(picked * inside.to(z.dtype), axis, mesh=m)
    per_token = sum_exp.log() - target
    keep = targets != ignore_index
    return (per_token * keep).sum() / keep.sum().clamp(min=1)
