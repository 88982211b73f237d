"""Checking and timing a schedule before any rank runs it.

:func:`simulate` runs the schedule as the ranks would: each rank takes its
actions in order, each starting once the rank is free and what it needs is
done (``comm`` later where that came from another rank). :func:`validate`
checks the schedule's shape first, then simulates it with unit costs: a
schedule that cannot finish is a :class:`~shardax.errors.ScheduleError`
naming, for each stuck rank, the action it waits at and what it waits for
— where other libraries hang. Last, it checks that between any two ranks
each rank receives activations and gradients in the order the other sends
them ("crossed sends", which hang where messages are matched in order).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..errors import ScheduleError
from ._schedule import Action, Schedule, expected, input_grad_done, needs

__all__ = ["Event", "Timeline", "simulate", "validate"]

UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@attrs.frozen
class Event:
    """``action`` ran on ``rank`` from ``start`` to ``end``."""

    rank: int
    action: Action
    start: float
    end: float


@attrs.frozen
class Timeline:
    """A simulated run: every action's :class:`Event`, the time the last
    one ends, the bubble (the fraction of ``ranks × makespan`` no rank
    computes) and, per rank, the most micro-batches whose activations it
    holds at once (from a forward's start to the end of its backward — of
    ``W`` where the backward is split)."""

    events: tuple[Event, ...]
    makespan: float
    bubble: float
    peak_activations: tuple[int, ...]


def validate(schedule: Schedule) -> Timeline:
    """Check ``schedule``: every action on the rank of its stage, within
    the stages and micro-batches; every (stage, micro-batch) forwarded once
    and backwarded once (``B``, or ``I`` then ``W``); every rank able
    to run its list to the end; and, between any two ranks, the activations
    (and the gradients) sent one way needed in the order they are sent.
    Returns the unit-cost :class:`Timeline`;
    else a :class:`~shardax.errors.ScheduleError` naming the first bad
    action.

    >>> from shardax import pipeline
    >>> pipeline.validate(pipeline.one_f_one_b(4, 8)).peak_activations
    (4, 3, 2, 1)
    >>> bad = pipeline.Schedule([[pipeline.Action("B", 0, 0), pipeline.Action("F", 0, 0)]], 1, 1, [0])
    >>> pipeline.validate(bad)
    Traceback (most recent call last):
    ...
    shardax.errors.ScheduleError: the schedule cannot finish: rank 0 waits at B0.0 for F0.0 (which runs later on rank 0)
    """
    seen: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(schedule.ranks):
        for i, a in enumerate(row):
            where = f"rank {r}, position {i} ({a})"
            if a.stage >= schedule.stages or a.micro >= schedule.micro_batches:
                raise ScheduleError(
                    f"{where}: the schedule has stages 0..{schedule.stages - 1} and "
                    f"micro-batches 0..{schedule.micro_batches - 1}"
                )
            if schedule.stage_rank[a.stage] != r:
                raise ScheduleError(
                    f"{where}: stage {a.stage} runs on rank {schedule.stage_rank[a.stage]}"
                )
            if a in seen:
                r0, i0 = seen[a]
                raise ScheduleError(f"{where}: already at rank {r0}, position {i0}")
            seen[a] = (r, i)
    for s, m in expected(schedule):
        have = {k for k in ("F", "B", "I", "W") if Action(k, s, m) in seen}  # type: ignore[arg-type]
        if have in ({"F", "B"}, {"F", "I", "W"}):
            continue
        if "F" not in have:
            fix = "a forward F"
        elif "B" in have and have & {"I", "W"}:
            fix = "either B or I and W, not both"
        else:
            fix = "a backward: B, or I and W"
        raise ScheduleError(
            f"stage {s}, micro-batch {m}: the schedule has {' '.join(sorted(have)) or 'nothing'}; "
            f"it needs {fix}"
        )
    timeline = simulate(schedule, UNIT)
    _check_channels(schedule)
    return timeline


def _check_channels(schedule: Schedule) -> None:
    """Messages of one kind from one rank to another are received in the
    order they are sent (the executor's and most libraries' matching): the
    sender's ``F`` (``B``/``I``) that feed the receiver run in the order of
    the receiver's actions that need them."""
    n = len(schedule.ranks)
    for src, dst in ((a, b) for a in range(n) for b in range(n) if a != b):
        for what, kinds, step in (("activation", ("F",), 1), ("gradient", ("B", "I"), -1)):
            sent = _toward(schedule, src, dst, kinds, step)
            taken = _toward(schedule, dst, src, kinds, -step)
            for k, (out, into) in enumerate(zip(sent, taken, strict=True)):
                if (out.stage + step, out.micro) != (into.stage, into.micro):
                    raise ScheduleError(
                        f"crossed sends from rank {src} to rank {dst}: {what} {k + 1} leaves "
                        f"rank {src} from {out}, but rank {dst} needs {what} {k + 1} at {into}; "
                        f"messages between two ranks are matched in the order sent (other "
                        f"libraries hang here): run rank {dst}'s actions that need rank {src}'s "
                        f"{what}s in the order rank {src} sends them"
                    )


def _toward(
    schedule: Schedule, rank: int, peer: int, kinds: tuple[str, ...], step: int
) -> list[Action]:
    """``rank``'s actions of ``kinds`` whose stage ``+ step`` is on ``peer``."""
    return [
        a
        for a in schedule.ranks[rank]
        if a.kind in kinds
        and 0 <= a.stage + step < schedule.stages
        and schedule.stage_rank[a.stage + step] == peer
    ]


def simulate(schedule: Schedule, costs: Mapping[str, float], *, comm: float = 0.0) -> Timeline:
    """Time ``schedule`` with ``costs`` (seconds per action kind: ``"F"``,
    ``"B"``, and ``"I"``/``"W"`` where used) and ``comm`` seconds for each
    activation or gradient that crosses ranks. Each rank runs its actions in
    order, each as soon as the rank is free and its inputs are there.

    >>> from shardax import pipeline
    >>> t = pipeline.simulate(pipeline.gpipe(4, 8), {"F": 1.0, "B": 2.0})
    >>> t.makespan, round(t.bubble, 4), 3 / 11
    (33.0, 0.2727, 0.2727272727272727)
    """
    for kind in sorted({a.kind for row in schedule.ranks for a in row}):
        cost = costs.get(kind)
        if not isinstance(cost, int | float) or isinstance(cost, bool) or cost < 0:
            raise ScheduleError(f"costs[{kind!r}] is a number of seconds >= 0; got {cost!r}")
    n = len(schedule.ranks)
    position = [0] * n
    free = [0.0] * n
    done: dict[Action, tuple[int, float]] = {}  # action -> (rank, end)
    events: list[Event] = []
    total = sum(len(row) for row in schedule.ranks)
    while len(events) < total:
        best: tuple[float, int] | None = None
        for r, row in enumerate(schedule.ranks):
            if position[r] == len(row):
                continue
            ready = _ready_at(row[position[r]], r, schedule, done, comm)
            if ready is not None:
                start = max(free[r], ready)
                if best is None or start < best[0]:
                    best = (start, r)
        if best is None:
            raise ScheduleError(_stuck(schedule, position, done))
        start, r = best
        a = schedule.ranks[r][position[r]]
        end = start + float(costs[a.kind])
        events.append(Event(r, a, start, end))
        done[a] = (r, end)
        free[r] = end
        position[r] += 1
    makespan = max((e.end for e in events), default=0.0)
    busy = sum(e.end - e.start for e in events)
    bubble = 1.0 - busy / (n * makespan) if makespan > 0 else 0.0
    return Timeline(tuple(events), makespan, bubble, _peaks(events, n))


def _ready_at(
    a: Action, rank: int, schedule: Schedule, done: dict[Action, tuple[int, float]], comm: float
) -> float | None:
    """When ``a``'s inputs are all on ``rank`` (None: not all done yet)."""
    at = 0.0
    for need in needs(a, schedule):
        if need.kind == "B" and need.stage != a.stage:  # the next stage's input gradient
            need = input_grad_done(done, need.stage, need.micro) or need  # type: ignore[assignment]
        got = done.get(need)
        if got is None:
            return None
        r, end = got
        at = max(at, end + (comm if r != rank else 0.0))
    return at


def _stuck(schedule: Schedule, position: list[int], done: dict[Action, object]) -> str:
    parts = []
    for r, row in enumerate(schedule.ranks):
        if position[r] == len(row):
            continue
        a = row[position[r]]
        waits = []
        for need in needs(a, schedule):
            if need.kind == "B" and need.stage != a.stage:
                if input_grad_done(done, need.stage, need.micro):  # type: ignore[arg-type]
                    continue
                label = f"B{need.stage}.{need.micro} (or I{need.stage}.{need.micro})"
            elif need in done:
                continue
            else:
                label = str(need)
            owner = schedule.stage_rank[need.stage]
            scheduled = any(x.stage == need.stage and x.micro == need.micro and x.kind in (
                need.kind, "I") for x in schedule.ranks[owner])  # fmt: skip
            waits.append(
                f"{label} (which runs later on rank {owner})"
                if scheduled
                else f"{label} (which no rank runs)"
            )
        parts.append(f"rank {r} waits at {a} for {', '.join(waits)}")
    return "the schedule cannot finish: " + "; ".join(parts)


def _peaks(events: list[Event], ranks: int) -> tuple[int, ...]:
    """Per rank, the most micro-batches held at once: from each forward's
    start to the end of the backward that frees it (``W`` when split)."""
    spans: dict[tuple[int, int], list[float]] = {}
    for e in events:
        key = (e.action.stage, e.action.micro)
        span = spans.setdefault(key, [e.rank, float("inf"), float("-inf")])
        if e.action.kind == "F":
            span[1] = e.start
        if e.action.kind in ("B", "W"):
            span[2] = max(span[2], e.end)
    peaks = [0] * ranks
    for r in range(ranks):
        marks = []
        for rank, start, end in spans.values():
            if rank == r:
                marks += [(start, 1), (end, -1)]
        live = 0
        for _, step in sorted(marks, key=lambda m: (m[0], m[1])):
            live += step
            peaks[r] = max(peaks[r], live)
    return tuple(peaks)
