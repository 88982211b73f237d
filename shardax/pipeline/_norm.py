"""The global gradient norm of a pipelined model, and clipping by it.

Each rank holds its stages' gradients, so the norm of the whole model's
gradients is a sum over the pipeline axis — with the outer parameters,
which the first and the last stage (and, for the shared ones, every stage)
hold with the same gradient, counted once. ``optim.clip_by_global_norm``
inside an optimizer sees one rank's part only: under a pipeline, clip with
:func:`clip_by_global_norm` here before the optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import collectives as C
from ..mesh._mesh import Mesh
from ..optim._norms import global_norm as _norm_of
from ..shard._sharded import Sharded
from ._schedule import Schedule
from ._stages import Stages

__all__ = ["clip_by_global_norm", "global_norm"]


def global_norm(
    grads: dict[str, Any], stages: Stages, schedule: Schedule, *, mesh: Mesh, axis: str = "pp"
) -> torch.Tensor:
    """The L2 norm of the whole model's gradients (every parameter once),
    the same on every rank; ``grads`` is this rank's, as the pipeline's
    ``value_and_grad`` returns them.

    >>> import torch, shardax as sx
    >>> from shardax import pipeline
    >>> stages = pipeline.Stages("blocks", (1,))  # one stage: block 0 and the outer parameters
    >>> grads = {"blocks.0.w": torch.tensor([3.0]), "head.w": torch.tensor([4.0])}
    >>> pipeline.global_norm(grads, stages, pipeline.gpipe(1, 1), mesh=sx.Mesh({"pp": 1}))
    tensor(5.)
    """
    rank, first = mesh.axis_index(axis), schedule.stage_rank[0]
    counted = {
        k: g
        for k, g in grads.items()
        if g is not None and (stages.stage_of(k) is not None or rank == first)
    }
    square = _norm_of(counted).square() if counted else torch.zeros((), dtype=torch.float32)
    return C.psum(square, axis, mesh=mesh).sqrt()


def clip_by_global_norm(
    grads: dict[str, Any],
    max_norm: float,
    stages: Stages,
    schedule: Schedule,
    *,
    mesh: Mesh,
    axis: str = "pp",
) -> tuple[dict[str, Any], torch.Tensor]:
    """``grads`` scaled by ``min(1, max_norm / (norm + 1e-6))`` — as
    ``torch.nn.utils.clip_grad_norm_`` and ``optim.clip_by_global_norm`` —
    with the norm of the whole pipeline's gradients; and that norm.

    >>> import torch, shardax as sx
    >>> from shardax import pipeline
    >>> grads = {"blocks.0.w": torch.tensor([3.0, 4.0])}
    >>> pipeline.clip_by_global_norm(grads, 1.0, pipeline.Stages("blocks", (1,)),
    ...                              pipeline.gpipe(1, 1), mesh=sx.Mesh({"pp": 1}))
    ({'blocks.0.w': tensor([0.6000, 0.8000])}, tensor(5.))
    """
    norm = global_norm(grads, stages, schedule, mesh=mesh, axis=axis)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    def scaled(g: Any) -> Any:
        if g is None:
            return None
        if isinstance(g, Sharded):
            return g.with_local(g.local * coef.to(g.local.dtype))
        return g * coef.to(g.dtype)

    return {k: scaled(g) for k, g in grads.items()}, norm
