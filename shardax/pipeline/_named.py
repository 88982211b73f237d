"""Schedules by name: what a run config (``parallel.pp_schedule``), the
example's ``--schedule`` and ``shardax pipeline show`` accept."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ScheduleError
from ._generators import dualpipe_v, interleaved_1f1b, looped_bfs, zbv, zero_bubble_h1
from ._schedule import Schedule, gpipe, one_f_one_b

__all__ = ["SCHEDULES", "schedule"]

SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": lambda p, m, v: zero_bubble_h1(p, m),
    "zbv": lambda p, m, v: zbv(p, m),
    "dualpipe_v": lambda p, m, v: dualpipe_v(p, m),
}
"""Name → ``(ranks, micro_batches, virtual) -> Schedule`` (``virtual``:
stages per rank, for the schedules that take it; the V schedules always
place two)."""


def schedule(name: str, ranks: int, micro_batches: int, *, virtual: int = 2) -> Schedule:
    """The schedule ``name`` (a key of :data:`SCHEDULES`) for ``ranks``
    ranks and ``micro_batches`` micro-batches.

    >>> from shardax import pipeline
    >>> print(pipeline.schedule("1f1b", 2, 2))
    rank 0: F0.0 F0.1 B0.0 B0.1
    rank 1: F1.0 B1.0 F1.1 B1.1
    """
    make = SCHEDULES.get(name)
    if make is None:
        raise ScheduleError(f"no schedule named {name!r}; the schedules: {', '.join(SCHEDULES)}")
    return make(ranks, micro_batches, virtual)
