"""Pipeline schedules as data: for each rank, the ordered list of compute
actions it runs — forward (``F``), full backward (``B``), or backward split
into its input half (``I``, what the previous stage waits for) and its
weight half (``W``) — each naming a stage and a micro-batch.

Sending an activation after ``F`` and a gradient after ``B``/``I``, and
receiving them before the action that needs them, is implied by the stage
order (stage ``s`` feeds stage ``s + 1``), so a schedule is just the
compute order. :func:`gpipe` and :func:`one_f_one_b` make the classic ones;
:func:`validate` checks any schedule; :func:`simulate` times it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import attrs

from ..errors import ScheduleError

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b"]

Kind = Literal["F", "B", "I", "W"]
KINDS = ("F", "B", "I", "W")


def _non_negative(_: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScheduleError(f"an Action's {attribute.name} is an int >= 0; got {value!r}")


@attrs.frozen(repr=False)
class Action:
    """One compute action: ``kind`` (``"F"`` forward, ``"B"`` full
    backward, ``"I"`` backward for the input, ``"W"`` backward for the
    weights) of ``stage`` on micro-batch ``micro``.

    >>> from shardax.pipeline import Action
    >>> Action("F", 0, 3)
    Action('F', 0, 3)
    >>> str(Action("I", 1, 0))
    'I1.0'
    """

    kind: Kind = attrs.field()
    stage: int = attrs.field(validator=_non_negative)
    micro: int = attrs.field(validator=_non_negative)

    @kind.validator
    def _check_kind(self, _: attrs.Attribute, value: str) -> None:
        if value not in KINDS:
            raise ScheduleError(
                f"an Action's kind is one of {KINDS} (forward, full backward, backward "
                f"for the input, backward for the weights); got {value!r}"
            )

    def __repr__(self) -> str:
        return f"Action({self.kind!r}, {self.stage}, {self.micro})"

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro}"


def _as_rows(value: Iterable[Iterable[Action]]) -> tuple[tuple[Action, ...], ...]:
    rows = tuple(tuple(row) for row in value)
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}, position {i}: {a!r} is not an Action")
    return rows


@attrs.frozen(repr=False)
class Schedule:
    """What each rank runs, in order: ``ranks[r]`` is rank ``r``'s actions.
    ``stages`` stages (stage ``s`` on rank ``stage_rank[s]``) over
    ``micro_batches`` micro-batches. A plain value: print it, compare it,
    build one by hand.

    >>> from shardax import pipeline
    >>> print(pipeline.gpipe(2, 2))
    rank 0: F0.0 F0.1 B0.0 B0.1
    rank 1: F1.0 F1.1 B1.0 B1.1
    """

    ranks: tuple[tuple[Action, ...], ...] = attrs.field(converter=_as_rows)
    stages: int = attrs.field(validator=_non_negative)
    micro_batches: int = attrs.field(validator=_non_negative)
    stage_rank: tuple[int, ...] = attrs.field(converter=tuple)

    @stage_rank.validator
    def _check_stage_rank(self, _: attrs.Attribute, value: tuple[int, ...]) -> None:
        if len(value) != self.stages:
            raise ScheduleError(
                f"stage_rank names the rank of each of the {self.stages} stages; got {value!r}"
            )
        bad = [s for s, r in enumerate(value) if not 0 <= r < len(self.ranks)]
        if bad:
            raise ScheduleError(
                f"stage {bad[0]} is placed on rank {value[bad[0]]}; the schedule has "
                f"{len(self.ranks)} ranks (0..{len(self.ranks) - 1})"
            )

    def __repr__(self) -> str:
        return (
            f"Schedule(ranks={self.ranks!r}, stages={self.stages}, "
            f"micro_batches={self.micro_batches}, stage_rank={self.stage_rank!r})"
        )

    def __str__(self) -> str:
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in row) for r, row in enumerate(self.ranks)
        )


def _check_sizes(stages: int, micro_batches: int, what: str) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{what}: {name} is an int >= 1; got {value!r}")


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe (Huang et al., 2019): every rank runs its stage's forwards for
    all micro-batches, then their backwards. One stage per rank; each rank
    holds the activations of every micro-batch at once.

    >>> from shardax import pipeline
    >>> pipeline.gpipe(4, 8).ranks[3][:3]
    (Action('F', 3, 0), Action('F', 3, 1), Action('F', 3, 2))
    """
    _check_sizes(stages, micro_batches, "gpipe")
    rows = [
        [Action("F", s, m) for m in range(micro_batches)]
        + [Action("B", s, m) for m in range(micro_batches)]
        for s in range(stages)
    ]
    return Schedule(rows, stages, micro_batches, range(stages))


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021; DeepSpeed's and
    Megatron's default): rank ``r`` runs ``stages - r`` forwards to fill the
    pipe, then alternates one backward and one forward, then drains the
    backwards. The same bubble as GPipe, but rank ``r`` holds at most
    ``min(stages - r, micro_batches)`` micro-batches' activations.

    >>> from shardax import pipeline
    >>> print(pipeline.one_f_one_b(2, 3))
    rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
    rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
    """
    _check_sizes(stages, micro_batches, "one_f_one_b")
    rows = []
    for s in range(stages):
        warmup = min(stages - s, micro_batches)
        row = [Action("F", s, m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            row += [Action("B", s, m), Action("F", s, warmup + m)]
        row += [Action("B", s, m) for m in range(micro_batches - warmup, micro_batches)]
        rows.append(row)
    return Schedule(rows, stages, micro_batches, range(stages))


def needs(action: Action, schedule: Schedule) -> tuple[Action, ...]:
    """The actions ``action`` waits for: the forward of the stage before
    (same micro-batch), its own stage's forward (for a backward), the
    backward-for-input (or full backward) of the stage after, and for ``W``
    its own ``I``."""
    s, m, last = action.stage, action.micro, schedule.stages - 1
    if action.kind == "F":
        return (Action("F", s - 1, m),) if s > 0 else ()
    if action.kind == "W":
        return (Action("I", s, m),)
    after: tuple[Action, ...] = ()
    if s < last:
        after = (Action("B", s + 1, m),)  # or its "I": resolved by the caller
    return (Action("F", s, m), *after)


def input_grad_done(done: dict[Action, object], stage: int, micro: int) -> Action | None:
    """The action that produced stage ``stage``'s input gradient for
    ``micro`` (its full backward or its backward-for-input), if done."""
    for kind in ("B", "I"):
        a = Action(kind, stage, micro)  # type: ignore[arg-type]
        if a in done:
            return a
    return None


def expected(schedule: Schedule) -> Sequence[tuple[int, int]]:
    """Every (stage, micro-batch) pair a complete schedule covers."""
    return [(s, m) for s in range(schedule.stages) for m in range(schedule.micro_batches)]
