"""The published schedules as one table: each is valid (and its sends
never cross) over a grid of sizes or refuses the sizes with the minimum;
each one's bubble and memory match their closed forms, derived for the
costs each paper assumes; the zero-bubble ones idle less than 1F1B.

Costs are per stage. With several stages per rank a stage is a chunk of
what one rank would hold alone, so where a schedule is compared with a
one-stage-per-rank one its chunks cost ``1 / virtual`` as much. Peak
activations count (stage, micro-batch) pairs: a chunk's activations are
``1 / virtual`` of a whole stage's.
"""

from __future__ import annotations

import pytest

from shardax.errors import ScheduleError
from shardax.pipeline import (
    Action,
    Schedule,
    dualpipe_v,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    simulate,
    validate,
    zbv,
    zero_bubble_h1,
)

# name -> (make(ranks, micro_batches), stages per rank, the micro-batch counts it takes)
GENERATORS = {
    "interleaved_1f1b": (lambda p, m: interleaved_1f1b(p, m), 2, lambda p, m: m % p == 0),
    "interleaved_1f1b_v3": (
        lambda p, m: interleaved_1f1b(p, m, virtual=3), 3, lambda p, m: m % p == 0,
    ),
    "looped_bfs": (lambda p, m: looped_bfs(p, m), 2, lambda p, m: True),
    "looped_bfs_v3": (lambda p, m: looped_bfs(p, m, virtual=3), 3, lambda p, m: True),
    "zero_bubble_h1": (zero_bubble_h1, 1, lambda p, m: True),
    "zbv": (zbv, 2, lambda p, m: True),
    "dualpipe_v": (dualpipe_v, 2, lambda p, m: m >= 2 * p),
}  # fmt: skip
GRID = [(p, m) for p in range(1, 5) for m in range(1, 13)]
SPLIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _v_ranks(p):
    return (*range(p), *reversed(range(p)))


@pytest.mark.parametrize("name", list(GENERATORS))
def test_every_schedule_is_valid_or_names_the_minimum(name):
    make, per_rank, takes = GENERATORS[name]
    for p, m in GRID:
        if not takes(p, m):
            with pytest.raises(ScheduleError, match=rf"{name.split('_v3')[0]} with {p} ranks"):
                make(p, m)
            continue
        s = make(p, m)
        validate(s)  # shape, no deadlock, no crossed sends
        assert (len(s.ranks), s.stages, s.micro_batches) == (p, p * per_rank, m), (p, m)
        looped = tuple(x % p for x in range(s.stages))
        assert s.stage_rank in (looped, _v_ranks(p)), (p, m)


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("make", [interleaved_1f1b, looped_bfs])
def test_interleaved_and_looped_bfs_bubble_is_megatrons(make, v):
    """Chunks costing 1/v of a stage (F=1, B=2 for the stage): the busy
    time is 1F1B's, m(F + B), and the idle time (p - 1)(F + B)/v, so the
    bubble is (p - 1)/(vm + p - 1) — exactly, for every count interleaved
    takes, and for looped BFS from m = p on."""
    for p in range(1, 5):
        for m in range(p, 13, p if make is interleaved_1f1b else 1):
            t = simulate(make(p, m, virtual=v), {"F": 1.0 / v, "B": 2.0 / v})
            assert t.makespan == pytest.approx(3 * m + 3 * (p - 1) / v), (p, m)
            assert t.bubble == pytest.approx((p - 1) / (v * m + p - 1)), (p, m)


@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0)])
def test_zb_h1_bubble_is_the_papers(f, i, w):
    """Qi et al.'s T_B is the input half (I here): ZB-H1 idles (p - 1)(T_F
    + T_B - T_W) where 1F1B, with B = I + W whole, idles (p - 1)(T_F + T_B
    + T_W) — for m >= p, with T_W no longer than T_F and T_B as the paper
    assumes."""
    for p in range(1, 5):
        for m in range(p, 13):
            t = simulate(zero_bubble_h1(p, m), {"F": f, "I": i, "W": w})
            assert t.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
            base = simulate(one_f_one_b(p, m), {"F": f, "B": i + w})
            assert base.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i + w))


@pytest.mark.parametrize(
    ("make", "least"), [(zbv, lambda p: 2 * p - 1), (dualpipe_v, lambda p: 2 * p)]
)
def test_the_v_schedules_idle_only_while_the_pipe_starts(make, least):
    """With a chunk's F = I = W = T (B = 2T) the makespan is 6mT + (p - 1)T:
    the last rank cannot start before p - 1 forwards have run and then has
    6mT of work, so no schedule does better (ZB-V's zero bubble)."""
    for p in range(1, 5):
        for m in range(least(p), 13):
            t = simulate(make(p, m), SPLIT)
            assert t.makespan == pytest.approx(6 * m + (p - 1)), (p, m)


@pytest.mark.parametrize(("make", "per_rank"), [(zero_bubble_h1, 1), (zbv, 2), (dualpipe_v, 2)])
def test_zero_bubble_schedules_idle_less_than_1f1b(make, per_rank):
    """The same model either way: a V's chunk costs half a 1F1B stage."""
    for p in range(2, 5):
        for m in range(2 * p, 13):
            stage = {k: c * per_rank for k, c in SPLIT.items()}
            base = simulate(one_f_one_b(p, m), stage)
            t = simulate(make(p, m), SPLIT)
            assert t.bubble < base.bubble, (p, m)
            assert t.makespan < base.makespan, (p, m)


def test_what_each_schedule_holds():
    """Peak (stage, micro-batch) pairs per rank, from each forward to the
    end of its backward (its W where split)."""
    for p, m in GRID:
        if m % p == 0:
            held = [2 * m if m == p else 3 * p - 2 * r - 1 for r in range(p)]
            assert validate(interleaved_1f1b(p, m)).peak_activations == tuple(held), (p, m)
        assert validate(looped_bfs(p, m)).peak_activations == (2 * m,) * p
        assert validate(zero_bubble_h1(p, m)).peak_activations == (min(p, m),) * p  # 1F1B's peak
        held = [min(2 * p, 2 * m, m + r + 1) for r in range(p)]
        assert validate(zbv(p, m)).peak_activations == tuple(held), (p, m)
        if m >= 2 * p:
            assert validate(dualpipe_v(p, m)).peak_activations == (2 * p + 1,) * p


def test_interleaved_1f1b_is_megatrons_order():
    """Two ranks, four micro-batches in groups of two: rank 0 warms up with
    2(p - r - 1) + (v - 1)p = 4 forwards, then one forward, one backward."""
    s = interleaved_1f1b(2, 4)
    assert str(s).splitlines()[0] == (
        "rank 0: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"
    )


def test_zb_h1_defers_rank_r_weights_by_r():
    rows = str(zero_bubble_h1(3, 4)).splitlines()
    assert rows[0] == "rank 0: F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3"
    assert rows[2] == "rank 2: F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 W2.0 F2.3 I2.3 W2.1 W2.2 W2.3"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: interleaved_1f1b(4, 3), r"interleaved_1f1b with 4 ranks needs at least 4 micro-batches"),
        (lambda: interleaved_1f1b(4, 6), r"needs a multiple of 4 micro-batches .*got 6: use 4 or 8"),
        (lambda: dualpipe_v(4, 5), r"dualpipe_v with 4 ranks needs at least 8 micro-batches .*; got 5"),
        (lambda: dualpipe_v(1, 1), r"dualpipe_v with 1 ranks needs at least 2 micro-batches"),
        (lambda: interleaved_1f1b(2, 4, virtual=1), r"virtual .* >= 2; got 1 \(one stage per rank is one_f_one_b\)"),
        (lambda: looped_bfs(0, 4), r"looped_bfs: ranks is an int >= 1; got 0"),
        (lambda: zbv(2, 0), r"zbv: micro_batches is an int >= 1; got 0"),
        (lambda: zero_bubble_h1(2.0, 4), r"zero_bubble_h1: ranks is an int >= 1; got 2.0"),
    ],
    ids=["interleaved-few", "interleaved-multiple", "dualpipe_v-few", "dualpipe_v-one-rank",
         "virtual-1", "no-ranks", "no-micro-batches", "float"],
)  # fmt: skip
def test_bad_sizes_name_the_minimum(call, match):
    with pytest.raises(ScheduleError, match=match):
        call()


def test_crossed_sends_are_refused():
    """Rank 1 runs its forwards in another order than rank 0 sends the
    activations: matched in order, micro-batch 1 would get micro-batch 0's
    activation. Both directions, activations and gradients."""
    a = Action
    rows = [[a("F", 0, 0), a("F", 0, 1), a("B", 0, 0), a("B", 0, 1)],
            [a("F", 1, 1), a("F", 1, 0), a("B", 1, 0), a("B", 1, 1)]]  # fmt: skip
    with pytest.raises(
        ScheduleError,
        match=r"crossed sends from rank 0 to rank 1: activation 1 leaves rank 0 from F0.0, "
        r"but rank 1 needs activation 1 at F1.1",
    ):
        validate(Schedule(rows, 2, 2, [0, 1]))
    rows[1] = [a("F", 1, 0), a("F", 1, 1), a("B", 1, 1), a("B", 1, 0)]
    with pytest.raises(
        ScheduleError, match=r"from rank 1 to rank 0: gradient 1 leaves rank 1 from B1.1"
    ):
        validate(Schedule(rows, 2, 2, [0, 1]))
