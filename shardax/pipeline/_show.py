"""A simulated run drawn as text: one row per rank, each action over its
span of time with its label (``F0.1``: forward of stage 0 on micro-batch
1), idle time as ``.``; then the makespan, the bubble and each rank's peak
activations. What ``shardax pipeline show`` prints.
"""

from __future__ import annotations

import math

from ..errors import ScheduleError
from ._simulate import Event, Timeline

__all__ = ["render"]


def render(timeline: Timeline, width: int | None = None) -> str:
    """``timeline`` as text, ``width`` columns for the time from 0 to the
    makespan (by default as many as let the shortest action show its whole
    label); a span too short for its label shows the action's kind alone.

    >>> from shardax import pipeline
    >>> t = pipeline.simulate(pipeline.one_f_one_b(2, 2), {"F": 1.0, "B": 2.0})
    >>> print(pipeline.render(t))
    rank 0 |F0.0 F0.1 ..........B0.0      ...............B0.1      |
    rank 1 |.....F1.0 B1.0      F1.1 B1.1      ..........|
    makespan: 9
    bubble: 0.3333 (33.3% of 2 ranks x 9)
    peak activations per rank (micro-batches held, counted per stage): 2 1
    """
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise ScheduleError(f"render: width is a number of columns >= 1; got {width!r}")
    ranks = len(timeline.peak_activations)
    if timeline.makespan <= 0:
        rows = ["" for _ in range(ranks)]
        scale = 0.0
    else:
        scale = (width or _natural_width(timeline)) / timeline.makespan
        columns = round(timeline.makespan * scale)
        rows = [
            _row([e for e in timeline.events if e.rank == r], scale, columns) for r in range(ranks)
        ]
    label = max(len(f"rank {ranks - 1}"), 4)
    lines = [f"{f'rank {r}':<{label}} |{row}|" for r, row in enumerate(rows)]
    lines += [
        f"makespan: {timeline.makespan:g}",
        f"bubble: {timeline.bubble:.4f} ({timeline.bubble:.1%} of {ranks} ranks x "
        f"{timeline.makespan:g})",
        "peak activations per rank (micro-batches held, counted per stage): "
        + " ".join(str(n) for n in timeline.peak_activations),
    ]
    return "\n".join(lines)


def _natural_width(timeline: Timeline) -> int:
    """Columns for the whole run such that the shortest action gets its
    longest label and a space."""
    spans = [e.end - e.start for e in timeline.events if e.end > e.start]
    longest = max(len(str(e.action)) for e in timeline.events)
    per_second = (longest + 1) / min(spans)
    return max(1, math.ceil(timeline.makespan * per_second - 1e-9))


def _row(events: list[Event], scale: float, columns: int) -> str:
    cells = ["."] * columns
    for e in events:
        start, end = round(e.start * scale), round(e.end * scale)
        if end > start:
            cells[start:end] = _label(str(e.action), end - start)
    return "".join(cells)


def _label(text: str, n: int) -> str:
    """``text`` and a space in ``n`` columns, or where they do not fit its
    kind alone (``F``)."""
    return text.ljust(n) if n > len(text) else text[0].ljust(n)
