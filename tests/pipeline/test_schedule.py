"""Pipeline schedules as data: the classic schedules' bubble and memory
against their closed forms, hand-written schedules (split backwards), and
every malformed schedule a typed error naming the culprit."""

from __future__ import annotations

import pytest

from shardax.errors import ScheduleError
from shardax.pipeline import Action, Schedule, gpipe, one_f_one_b, simulate, validate

SIZES = [(1, 1), (2, 1), (2, 5), (4, 4), (4, 8), (3, 7), (8, 3)]


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_the_bubble_of_gpipe_and_1f1b_is_the_papers(make, p, m):
    f, b = 1.0, 2.0
    t = simulate(make(p, m), {"F": f, "B": b})
    assert t.makespan == pytest.approx((m + p - 1) * (f + b))
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_1f1b_holds_fewer_micro_batches_than_gpipe(p, m):
    assert validate(gpipe(p, m)).peak_activations == (m,) * p
    assert validate(one_f_one_b(p, m)).peak_activations == tuple(min(p - r, m) for r in range(p))


def test_crossing_ranks_costs_the_latency_each_way():
    p, m, c = 4, 6, 0.5
    t = simulate(gpipe(p, m), {"F": 1.0, "B": 2.0}, comm=c)
    assert t.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * c)


def test_a_hand_written_schedule_with_split_backwards():
    """Two stages, backward split into I (what stage 0 waits for) and W:
    stage 1 defers its weight gradients, so stage 0 starts its backward
    earlier than with full backwards."""
    rows = [
        [Action("F", 0, 0), Action("F", 0, 1), Action("I", 0, 0), Action("W", 0, 0),
         Action("I", 0, 1), Action("W", 0, 1)],
        [Action("F", 1, 0), Action("I", 1, 0), Action("F", 1, 1), Action("I", 1, 1),
         Action("W", 1, 0), Action("W", 1, 1)],
    ]  # fmt: skip
    split = Schedule(rows, 2, 2, [0, 1])
    timeline = validate(split)
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    assert simulate(split, costs).makespan < simulate(one_f_one_b(2, 2), costs).makespan
    w = next(e for e in timeline.events if e.action == Action("W", 1, 0))
    i = next(e for e in timeline.events if e.action == Action("I", 1, 0))
    assert w.start >= i.end


def test_a_schedule_is_a_value_that_prints_and_rebuilds():
    s = one_f_one_b(3, 4)
    assert eval(repr(s), {"Schedule": Schedule, "Action": Action}) == s
    assert str(s).splitlines()[2] == "rank 2: F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3"


def _one(rows, stages=2, micro=1, stage_rank=(0, 1)):
    return Schedule([[Action(*a) for a in row] for row in rows], stages, micro, stage_rank)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (
            [[("F", 1, 0), ("B", 1, 0)], [("F", 0, 0), ("B", 0, 0)]],
            r"rank 0, position 0 \(F1.0\): stage 1 runs on rank 1",
        ),
        ([[("F", 0, 0), ("B", 0, 0)], [("F", 1, 1), ("B", 1, 0)]], r"micro-batches 0..0"),
        (
            [[("F", 0, 0), ("F", 0, 0), ("B", 0, 0)], [("F", 1, 0), ("B", 1, 0)]],
            r"position 1 \(F0.0\): already at rank 0, position 0",
        ),
        (
            [[("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]],
            r"stage 0, micro-batch 0: the schedule has F; it needs a backward",
        ),
        (
            [[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)], [("F", 1, 0), ("B", 1, 0)]],
            "either B or I and W, not both",
        ),
        ([[("B", 0, 0)], [("F", 1, 0), ("B", 1, 0)]], "it needs a forward F"),
        (
            [[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]],
            r"cannot finish: rank 0 waits at B0.0 for F0.0 \(which runs later on rank 0\), "
            r"B1.0 \(or I1.0\) \(which runs later on rank 1\); rank 1 waits at F1.0 for F0.0",
        ),
    ],
    ids=[
        "wrong-rank",
        "micro-out-of-range",
        "twice",
        "no-backward",
        "B-and-W",
        "no-forward",
        "deadlock",
    ],
)
def test_a_bad_schedule_names_the_culprit(rows, match):
    with pytest.raises(ScheduleError, match=match):
        validate(_one(rows))


def test_bad_values_are_typed_errors():
    with pytest.raises(ScheduleError, match="kind is one of"):
        Action("X", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="micro is an int >= 0"):
        Action("F", 0, -1)
    with pytest.raises(ScheduleError, match="the rank of each of the 2 stages"):
        Schedule([[], []], 2, 1, [0])
    with pytest.raises(ScheduleError, match="stage 1 is placed on rank 5"):
        Schedule([[], []], 2, 1, [0, 5])
    with pytest.raises(ScheduleError, match="rank 0, position 0: 'F' is not an Action"):
        Schedule([["F"]], 1, 1, [0])
    with pytest.raises(ScheduleError, match="gpipe: micro_batches is an int >= 1"):
        gpipe(2, 0)
    with pytest.raises(ScheduleError, match=r"costs\['B'\] is a number of seconds"):
        simulate(gpipe(2, 2), {"F": 1.0})
