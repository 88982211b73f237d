"""A pipeline's step time and in-flight activations, from
:func:`shardax.pipeline.simulate`, cheaply enough to search with.

The schedule is simulated with the stage's forward time as the unit (so one
simulation serves every layout with the same backward/forward ratio and
transfer/forward ratio, both rounded to three digits), and with at most
``2·ranks`` micro-batches plus the remainder: past its warm-up every rank
runs one forward and one backward per extra micro-batch back to back, so
more micro-batches add exactly their compute.
"""

from __future__ import annotations

import functools

from ..errors import PlanError, ScheduleError
from ..pipeline import schedule as make_schedule
from ..pipeline import simulate

__all__ = ["pipeline_time"]


def _three_digits(x: float) -> float:
    return float(f"{x:.3g}")


@functools.lru_cache(maxsize=1024)
def _unit_run(name: str, ranks: int, micro: int, virtual: int, ratio: float, comm: float
              ) -> tuple[float, int, int]:  # fmt: skip
    """(makespan in forward units, most stage-micro-batches in flight on a
    rank, stages per rank)."""
    sched = make_schedule(name, ranks, micro, virtual=virtual)
    chunks = sched.stages // ranks  # stages per rank: each a 1/chunks share of the rank's layers
    f, b = 1.0 / chunks, ratio / chunks
    timeline = simulate(sched, {"F": f, "B": b, "I": b / 2, "W": b / 2}, comm=comm)
    return timeline.makespan, max(timeline.peak_activations), chunks


# Screening: the bubble in (forward + backward) units of one rank's micro-batch,
# and the stage-micro-batches held, per schedule (a rank's chunks: ``v``).
_CLOSED = {
    "gpipe": (lambda p, v: p - 1, lambda p, m, v: m),
    "1f1b": (lambda p, v: p - 1, lambda p, m, v: min(m, p)),
    "interleaved_1f1b": (lambda p, v: (p - 1) / v, lambda p, m, v: min(m * v, p * v + p)),
    "looped_bfs": (lambda p, v: (p - 1) / v, lambda p, m, v: m * v),
    "zb_h1": (lambda p, v: (p - 1) / 3, lambda p, m, v: min(m, p)),
    "zbv": (lambda p, v: (p - 1) / 6, lambda p, m, v: min(2 * m, 2 * p)),
    "dualpipe_v": (lambda p, v: (p - 1) / 6, lambda p, m, v: min(2 * m, 2 * p + 2)),
}


@functools.lru_cache(maxsize=4096)
def _refused(name: str, ranks: int, micro: int, virtual: int) -> str:
    """Why the schedule cannot be made ('' where it can)."""
    try:
        make_schedule(name, ranks, micro, virtual=virtual)
    except ScheduleError as err:
        return str(err)
    return ""


def pipeline_time(
    name: str,
    ranks: int,
    micro: int,
    virtual: int,
    forward: float,
    backward: float,
    comm: float,
    *,
    exact: bool = True,
) -> tuple[float, float, int]:
    """``(step time, bubble time, stage-micro-batches held at once)`` of
    schedule ``name`` on ``ranks`` ranks over ``micro`` micro-batches, where
    a rank's layers take ``forward`` and ``backward`` seconds per
    micro-batch and an activation crosses ranks in ``comm`` seconds.

    ``exact=False`` takes a closed form of each schedule's bubble instead
    of simulating it (to screen many layouts).

    >>> t, bubble, held = pipeline_time("1f1b", 4, 8, 1, 1.0, 2.0, 0.0)
    >>> t, bubble, held   # (8 + 4 - 1) x 3: the 1F1B bubble of (p - 1)/(m + p - 1)
    (33.0, 9.0, 4)
    """
    if forward <= 0:
        raise PlanError(f"a stage's forward time is positive; got {forward}")
    base = micro if micro <= 2 * ranks else 2 * ranks + micro % ranks
    if not exact:  # a closed form, to screen candidates before simulating the best
        problem = _refused(name, ranks, base, virtual)
        if problem:
            raise PlanError(f"pipeline {name} on {ranks} ranks, {micro} micro-batches: {problem}")
        bubble, held = _CLOSED[name]
        v = virtual if name in ("interleaved_1f1b", "looped_bfs") else 1
        idle = bubble(ranks, v) * (forward + backward) + 2 * (ranks - 1) * comm
        return micro * (forward + backward) + idle, idle, held(ranks, micro, v)
    ratio, c = _three_digits(backward / forward), _three_digits(comm / forward)
    try:
        span, held, chunks = _unit_run(name, ranks, base, virtual, ratio, c)
    except ScheduleError as err:
        raise PlanError(f"pipeline {name} on {ranks} ranks, {micro} micro-batches: {err}") from None
    extra = micro - base
    span = span * forward + extra * (forward + backward)
    if extra and held >= base * chunks:  # every micro-batch in flight (GPipe): the extra too
        held = held * micro // base
    return span, span - micro * (forward + backward), held
