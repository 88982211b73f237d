"""The schedules with more than one stage per rank, or a split backward:
Megatron's interleaved 1F1B, looped BFS, ZB-H1, ZB-V and DualPipeV. Each
returns a plain :class:`Schedule` that :func:`validate` accepts; sizes a
schedule cannot take are a :class:`~shardax.errors.ScheduleError` naming
the smallest (or the nearest) number of micro-batches that works.
"""

from __future__ import annotations

from ..errors import ScheduleError
from ._schedule import Action, Kind, Schedule

__all__ = ["dualpipe_v", "interleaved_1f1b", "looped_bfs", "v_placement", "zbv", "zero_bubble_h1"]


def _check_ints(what: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{what}: {name} is an int >= 1; got {value!r}")


def _too_few(what: str, ranks: int, micro_batches: int, minimum: int, why: str) -> ScheduleError:
    return ScheduleError(
        f"{what} with {ranks} ranks needs at least {minimum} micro-batches ({why}); "
        f"got {micro_batches}"
    )


def v_placement(ranks: int) -> tuple[int, ...]:
    """The rank of each of ``2 * ranks`` stages laid out in a V: down the
    ranks, then back up, so rank ``r`` holds stages ``r`` and
    ``2 * ranks - 1 - r`` and the last rank hands over to itself.

    >>> v_placement(3)
    (0, 1, 2, 2, 1, 0)
    """
    return (*range(ranks), *reversed(range(ranks)))


def _looped(ranks: int, virtual: int) -> list[int]:
    """Stage ``s`` of ``ranks * virtual`` on rank ``s % ranks``."""
    return [s % ranks for s in range(ranks * virtual)]


class _Row:
    """One rank's list as it is built: each stage's next micro-batch for a
    forward and for a backward, and the weight halves owed (oldest first)
    by the backwards that were split. Micro-batches from ``micro_batches``
    on count but are left out (ZB-V is built for at least ``2p - 1``)."""

    def __init__(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        self.actions: list[Action] = []
        self._next: dict[tuple[str, int], int] = {}
        self._owed: list[tuple[int, int]] = []

    def f(self, stage: int) -> _Row:
        return self._put("F", stage, self._take("F", stage))

    def b(self, stage: int) -> _Row:
        """The next backward of ``stage``, whole."""
        return self._put("B", stage, self._take("B", stage))

    def i(self, stage: int) -> _Row:
        """The next backward of ``stage``: its input half, the weight half owed."""
        micro = self._take("B", stage)
        self._owed.append((stage, micro))
        return self._put("I", stage, micro)

    def w(self, stage: int | None = None) -> _Row:
        """The oldest weight half owed (of ``stage`` if given); none owed: nothing."""
        for k, (s, micro) in enumerate(self._owed):
            if stage is None or s == stage:
                del self._owed[k]
                return self._put("W", s, micro)
        return self

    def forwards(self, stage: int) -> int:
        """How many forwards of ``stage`` are in (or cut from) the row."""
        return self._next.get(("F", stage), 0)

    def owes(self, stage: int) -> bool:
        return any(s == stage for s, _ in self._owed)

    def _take(self, kind: str, stage: int) -> int:
        micro = self._next.get((kind, stage), 0)
        self._next[(kind, stage)] = micro + 1
        return micro

    def _put(self, kind: Kind, stage: int, micro: int) -> _Row:
        if micro < self.micro_batches:
            self.actions.append(Action(kind, stage, micro))
        return self


def interleaved_1f1b(ranks: int, micro_batches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021, "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM"): ``ranks *
    virtual`` stages, stage ``s`` on rank ``s % ranks``. Megatron's order:
    micro-batches go in groups of ``ranks``; a rank's ``k``-th forward is
    chunk ``(k // ranks) % virtual`` of micro-batch ``(k // (ranks *
    virtual)) * ranks + k % ranks``, its ``k``-th backward the same with the
    chunks reversed. Rank ``r`` warms up with ``2 * (ranks - r - 1) +
    (virtual - 1) * ranks`` forwards (all of them when ``micro_batches ==
    ranks``), then runs one forward and one backward in turn.

    With each chunk costing ``1 / virtual`` of a whole stage the bubble is
    ``(p - 1) / (virtual * m + p - 1)``: ``virtual`` times less idle time
    than 1F1B's. Rank ``r`` holds ``(virtual + 1) p - 2r - 1``
    chunk-micro-batches (all ``virtual * m`` when ``m == p``). Megatron's
    rule: ``micro_batches`` a multiple of ``ranks``.

    >>> from shardax import pipeline
    >>> print(pipeline.interleaved_1f1b(2, 4))
    rank 0: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3
    rank 1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3
    """
    _check_ints("interleaved_1f1b", ranks=ranks, micro_batches=micro_batches, virtual=virtual)
    if virtual < 2:
        raise ScheduleError(
            f"interleaved_1f1b: virtual is the number of stages per rank, >= 2; got {virtual} "
            "(one stage per rank is one_f_one_b)"
        )
    if micro_batches % ranks:
        raise _interleaved_sizes(ranks, micro_batches)
    total = virtual * micro_batches
    rows = []
    for r in range(ranks):
        warmup = 2 * (ranks - r - 1) + (virtual - 1) * ranks
        warmup = total if micro_batches == ranks else min(warmup, total)
        order: list[tuple[Kind, int]] = [("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [("F", warmup + k), ("B", k)]
        order += [("B", k) for k in range(total - warmup, total)]
        rows.append([_interleaved_action(kind, k, r, ranks, virtual) for kind, k in order])
    return Schedule(rows, ranks * virtual, micro_batches, _looped(ranks, virtual))


def _interleaved_sizes(ranks: int, micro_batches: int) -> ScheduleError:
    if micro_batches < ranks:
        return _too_few(
            "interleaved_1f1b", ranks, micro_batches, ranks,
            f"Megatron's rule: a multiple of {ranks}, the micro-batches go through the ranks "
            f"in groups of {ranks}",
        )  # fmt: skip
    lower = micro_batches - micro_batches % ranks
    return ScheduleError(
        f"interleaved_1f1b with {ranks} ranks needs a multiple of {ranks} micro-batches "
        f"(Megatron's rule: they go through the ranks in groups of {ranks}); got "
        f"{micro_batches}: use {lower} or {lower + ranks}"
    )


def _interleaved_action(kind: Kind, k: int, rank: int, ranks: int, virtual: int) -> Action:
    """Megatron's ``k``-th forward or backward on ``rank``."""
    chunk = (k // ranks) % virtual
    if kind == "B":
        chunk = virtual - 1 - chunk
    micro = (k // (ranks * virtual)) * ranks + k % ranks
    return Action(kind, chunk * ranks + rank, micro)


def looped_bfs(ranks: int, micro_batches: int, virtual: int = 2) -> Schedule:
    """Looped BFS (Lamy-Poirier, 2023, "Breadth-First Pipeline
    Parallelism"; torch's ``ScheduleLoopedBFS``): ``ranks * virtual``
    stages, stage ``s`` on rank ``s % ranks``. Each rank runs every
    micro-batch's forward through its first stage, then through its next,
    and so on; then the backwards, last stage first, each stage's
    micro-batches last first. GPipe's memory (every micro-batch on every
    stage held at once: ``virtual * m`` chunk-micro-batches) for
    interleaved 1F1B's bubble, ``(p - 1) / (virtual * m + p - 1)`` with
    each chunk costing ``1 / virtual`` of a stage, from ``m >= p`` on. Any
    number of micro-batches.

    >>> from shardax import pipeline
    >>> print(pipeline.looped_bfs(2, 2))
    rank 0: F0.0 F0.1 F2.0 F2.1 B2.1 B2.0 B0.1 B0.0
    rank 1: F1.0 F1.1 F3.0 F3.1 B3.1 B3.0 B1.1 B1.0
    """
    _check_ints("looped_bfs", ranks=ranks, micro_batches=micro_batches, virtual=virtual)
    rows = []
    for r in range(ranks):
        local = range(r, ranks * virtual, ranks)
        row = [Action("F", s, m) for s in local for m in range(micro_batches)]
        row += [Action("B", s, m) for s in reversed(local) for m in reversed(range(micro_batches))]
        rows.append(row)
    return Schedule(rows, ranks * virtual, micro_batches, _looped(ranks, virtual))


def zero_bubble_h1(ranks: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): 1F1B
    with each backward split into its input half ``I`` (what the previous
    stage waits for) and its weight half ``W``. One stage per rank. Rank
    ``r`` warms up with ``ranks - r`` forwards as 1F1B does, then repeats
    ``I``, ``W``, ``F`` — but holds back its first ``r`` weight halves,
    each ``W`` running ``r`` micro-batches late, and runs those held back
    at the end, where 1F1B idles.

    With the paper's ``T_B`` for ``I``, from ``m >= p`` on and with ``T_W``
    no longer than ``T_F`` and ``T_B``: idle time ``(p - 1)(T_F + T_B -
    T_W)`` instead of 1F1B's ``(p - 1)(T_F + T_B + T_W)``, a third when the
    three are equal. Every rank holds at most ``min(p, m)``
    micro-batches (from forward to ``W``): 1F1B's peak, on every rank
    instead of the first. Any number of micro-batches.

    >>> from shardax import pipeline
    >>> print(pipeline.zero_bubble_h1(2, 3))
    rank 0: F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2
    rank 1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2
    """
    _check_ints("zero_bubble_h1", ranks=ranks, micro_batches=micro_batches)
    rows = []
    for r in range(ranks):
        row = _Row(micro_batches)
        warmup = min(ranks - r, micro_batches)
        for _ in range(warmup):
            row.f(r)
        for k in range(micro_batches):
            row.i(r)
            if k >= r:
                row.w()
            if warmup + k < micro_batches:
                row.f(r)
        for _ in range(min(r, micro_batches)):
            row.w()
        rows.append(row.actions)
    return Schedule(rows, ranks, micro_batches, range(ranks))


def zbv(ranks: int, micro_batches: int) -> Schedule:
    """ZB-V (Qi et al., 2024, "Pipeline Parallelism with Controllable
    Memory", and the V schedule of "Zero Bubble Pipeline Parallelism";
    torch's ``ScheduleZBVZeroBubble``): ``2 * ranks`` stages in a V
    (:func:`v_placement`), split backwards. Rank ``r`` with stages ``a =
    r`` (going down) and ``b = 2p - 1 - r`` (coming back up) runs:
    ``2(p - r) - 1`` forwards of ``a``; ``r`` times ``F b, F a``; ``p - r``
    times ``F b, I b, W b``; then, while forwards remain, ``F a, I a, W a,
    F b, I b, W b``; then ``r`` times ``I a, I b``; ``p - r`` times ``I a,
    W a``; and the weight halves still owed, ``b``'s first. Built for at
    least ``2p - 1`` micro-batches and cut to ``micro_batches``, as torch
    does.

    With the same cost ``T`` for a chunk's ``F``, ``I`` and ``W`` and
    ``micro_batches >= 2p - 1``, the makespan is ``6mT + (p - 1)T``: the
    only idle time is the ``p - 1`` forwards before the last rank can
    start, which no schedule avoids. Rank ``r`` holds at most ``min(2p, 2m,
    m + r + 1)`` chunk-micro-batches: ``2p`` half-size ones, 1F1B's peak.
    Any number of micro-batches; under ``2p - 1`` the pipe never fills.

    >>> from shardax import pipeline
    >>> print(pipeline.zbv(2, 3))
    rank 0: F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I3.1 W3.1 I0.0 W0.0 F3.2 I3.2 W3.2 I0.1 W0.1 I0.2 W0.2
    rank 1: F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 F1.2 I1.0 W1.0 F2.2 I2.1 W2.1 I1.1 I2.2 I1.2 W1.1 W2.2 W1.2
    """
    _check_ints("zbv", ranks=ranks, micro_batches=micro_batches)
    built = max(2 * ranks - 1, micro_batches)
    return Schedule(
        [_zbv_row(r, ranks, built, micro_batches) for r in range(ranks)],
        2 * ranks, micro_batches, v_placement(ranks),
    )  # fmt: skip


def _zbv_row(r: int, ranks: int, built: int, micro_batches: int) -> list[Action]:
    a, b = r, 2 * ranks - 1 - r
    row = _Row(micro_batches)
    for _ in range(2 * (ranks - r) - 1):
        row.f(a)
    for _ in range(r):
        row.f(b).f(a)
    for _ in range(ranks - r):
        row.f(b).i(b).w(b)
    while row.forwards(b) < row.forwards(a) or row.forwards(a) < built:
        if row.forwards(a) < built:
            row.f(a)
        row.i(a).w(a).f(b).i(b).w(b)
    for _ in range(r):
        row.i(a).i(b)
    for _ in range(ranks - r):
        row.i(a).w(a)
    for stage in (b, a):
        while row.owes(stage):
            row.w(stage)
    return row.actions


def dualpipe_v(ranks: int, micro_batches: int) -> Schedule:
    """DualPipeV (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report": DualPipe
    cut in half into a V; torch's ``ScheduleDualPipeV``): ``2 * ranks``
    stages placed as :func:`zbv` places them. DualPipe's fused step, one
    chunk's forward overlapped with the other's backward, is written here
    as that ``F`` followed by that ``B``. Rank ``r`` with stages ``a = r``
    and ``b = 2p - 1 - r`` runs: ``2(p - r - 1)`` forwards of ``a``; ``r +
    1`` times ``F a, F b``; ``p - r - 1`` times ``I b, W, F b``; ``m - 2p +
    r + 1`` times ``F a, B b, F b, B a``; ``p - r - 1`` times ``B b, F b,
    B a``; ``r + 1`` times ``B b, B a`` switching to split backwards
    halfway; ``p - r - 1`` times ``W, I a``; the weight halves still owed
    (``W`` is always the oldest owed).

    With a chunk's ``F = I = W = T`` and ``B = 2T`` the makespan is ``6mT
    + (p - 1)T``, the start-up alone, as ZB-V's; every rank holds ``2p + 1``
    chunk-micro-batches. Needs ``micro_batches >= 2
    * ranks``, as DeepSeek's and torch's DualPipeV do.

    >>> from shardax import pipeline
    >>> print(pipeline.dualpipe_v(1, 2))
    rank 0: F0.0 F1.0 F0.1 B1.0 F1.1 B0.0 B1.1 I0.1 W0.1
    """
    _check_ints("dualpipe_v", ranks=ranks, micro_batches=micro_batches)
    if micro_batches < 2 * ranks:
        raise _too_few(
            "dualpipe_v", ranks, micro_batches, 2 * ranks,
            "one per stage of its V, as DeepSeek's and torch's DualPipeV",
        )  # fmt: skip
    return Schedule(
        [_dualpipe_v_row(r, ranks, micro_batches) for r in range(ranks)],
        2 * ranks, micro_batches, v_placement(ranks),
    )  # fmt: skip


def _dualpipe_v_row(r: int, ranks: int, micro_batches: int) -> list[Action]:
    a, b = r, 2 * ranks - 1 - r
    rest = ranks - r - 1
    row = _Row(micro_batches)
    for _ in range(2 * rest):
        row.f(a)
    for _ in range(r + 1):
        row.f(a).f(b)
    for _ in range(rest):
        row.i(b).w().f(b)
    for _ in range(micro_batches - 2 * ranks + r + 1):
        row.f(a).b(b).f(b).b(a)
    for _ in range(rest):
        row.b(b).f(b).b(a)
    half = (r + 1) // 2
    for k in range(r + 1):  # split from the middle on: b's first on odd ranks
        (row.i(b) if k > half or (k == half and r % 2) else row.b(b))
        (row.i(a) if k >= half else row.b(a))
    for _ in range(rest):
        row.w().i(a)
    for _ in range(r + 1):
        row.w()
    return row.actions
