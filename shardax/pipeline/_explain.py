"""What each pipeline rank holds: its stages and blocks, its parameters,
and the most activations it keeps at once under the schedule."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import nn

from ._schedule import Schedule
from ._simulate import validate
from ._stages import Stages

__all__ = ["RankPlan", "explain"]


@attrs.frozen
class RankPlan:
    """One pipeline rank: its ``stages`` and their ``blocks`` (ranges of
    block indices), the ``params`` (elements) and ``param_bytes`` it holds
    (the outer ones included where it runs the first or the last stage),
    and ``peak_micro_batches``: the most (stage, micro-batch) activations it
    holds at once under the schedule — times ``activation_bytes``, the
    bytes one micro-batch's activations take in one stage, where given."""

    rank: int
    stages: tuple[int, ...]
    blocks: tuple[range, ...]
    params: int
    param_bytes: int
    peak_micro_batches: int
    activation_bytes: int | None


@attrs.frozen
class PipelineExplanation:
    """Per rank, a :class:`RankPlan`; ``str()`` is a table."""

    ranks: tuple[RankPlan, ...]
    schedule: str

    def __str__(self) -> str:
        head = f"{'rank':>4}  {'stages':<10} {'blocks':<16} {'params':>10} {'bytes':>10}  peak activations"
        lines = [self.schedule, head]
        for p in self.ranks:
            blocks = ", ".join(
                f"{b.start}-{b.stop - 1}" if len(b) > 1 else str(b.start) for b in p.blocks
            )
            act = f"{p.peak_micro_batches} micro-batch(es)"
            if p.activation_bytes is not None:
                act += f" = {_human(p.peak_micro_batches * p.activation_bytes)}"
            stages = ", ".join(map(str, p.stages))
            lines.append(
                f"{p.rank:>4}  {stages:<10} {blocks:<16} {p.params:>10,} {_human(p.param_bytes):>10}  {act}"
            )
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def explain(
    model: nn.Module,
    stages: Stages,
    schedule: Schedule,
    *,
    activation_bytes: int | None = None,
) -> PipelineExplanation:
    """Per rank of ``schedule``: the stages and blocks it runs, the
    parameters it holds, and its peak activations (from the schedule's
    unit-cost run, :func:`validate`). ``model`` may be on ``meta``.

    >>> import torch, shardax as sx
    >>> from shardax import pipeline
    >>> model = torch.nn.Sequential(torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4)))
    >>> print(pipeline.explain(model, pipeline.split(model, 2), pipeline.one_f_one_b(2, 8)))
    2 ranks, 2 stages, 8 micro-batches
    rank  stages     blocks               params      bytes  peak activations
       0  0          0-1                      40    160 B  2 micro-batch(es)
       1  1          2-3                      40    160 B  1 micro-batch(es)
    """
    stages.check(schedule)
    timeline = validate(schedule)
    tensors: Mapping[str, torch.Tensor] = dict(model.named_parameters())
    rows = []
    for r in range(len(schedule.ranks)):
        mine = tuple(s for s, at in enumerate(schedule.stage_rank) if at == r)
        held = [t for k, t in tensors.items() if stages.held(k, mine)]
        rows.append(
            RankPlan(
                r,
                mine,
                tuple(stages.block_range(s) for s in mine),
                sum(t.numel() for t in held),
                sum(t.numel() * t.element_size() for t in held),
                timeline.peak_activations[r],
                activation_bytes,
            )
        )
    title = (
        f"{len(schedule.ranks)} ranks, {schedule.stages} stages, "
        f"{schedule.micro_batches} micro-batches"
    )
    return PipelineExplanation(tuple(rows), title)
