"""Schedules: functions ``step -> value`` (plain Python floats), to pass
where a learning rate or another hyperparameter is expected. Steps count
from 0 (the first update)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ._base import validate

__all__ = [
    "constant",
    "constant_schedule",
    "cosine",
    "cosine_decay_schedule",
    "linear",
    "linear_schedule",
    "one_cycle",
    "one_cycle_schedule",
    "piecewise",
    "piecewise_constant_schedule",
    "warmup_cosine",
    "warmup_cosine_decay_schedule",
    "warmup_linear_decay",
    "warmup_linear_decay_schedule",
]

Schedule = Callable[[int], float]


def _steps(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def _number(name: str, value: float) -> float:
    return validate(name, value, low=float("-inf"))


def constant_schedule(value: float) -> Schedule:
    """The same value at every step.

    >>> from shardax import optim
    >>> optim.constant_schedule(0.1)(1000)
    0.1
    """
    v = _number("value", value)
    return lambda step: v


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """``init_value`` until ``transition_begin``, then linearly to
    ``end_value`` over ``transition_steps`` steps, then ``end_value``.

    >>> from shardax import optim
    >>> s = optim.linear_schedule(1.0, 0.0, transition_steps=4)
    >>> [s(i) for i in range(6)]
    [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    a, b = _number("init_value", init_value), _number("end_value", end_value)
    n = _steps("transition_steps", transition_steps)
    begin = _steps("transition_begin", transition_begin, minimum=0)

    def schedule(step: int) -> float:
        f = min(max(step - begin, 0), n) / n
        return a * (1.0 - f) + b * f

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay (Loshchilov & Hutter 2017, "SGDR") from ``init_value`` to
    ``alpha * init_value`` over ``decay_steps`` steps, constant after.

    >>> from shardax import optim
    >>> s = optim.cosine_decay_schedule(1.0, decay_steps=4)
    >>> [round(s(i), 4) for i in range(6)]
    [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    v = _number("init_value", init_value)
    n = _steps("decay_steps", decay_steps)
    alpha = validate("alpha", alpha, high=1.0, high_open=False)
    exponent = validate("exponent", exponent, low_open=True)

    def schedule(step: int) -> float:
        k = min(max(step, 0), n)
        c = 0.5 * (1.0 + math.cos(math.pi * k / n))
        return v * ((1.0 - alpha) * c**exponent + alpha)

    return schedule


def _warmup_args(
    peak_value: float, warmup_steps: int, decay_steps: int, init_value: float, end_value: float
) -> tuple[float, int, int, float, float]:
    """The checked arguments of a warmup-then-decay schedule."""
    peak = _number("peak_value", peak_value)
    warm = _steps("warmup_steps", warmup_steps, minimum=0)
    total = _steps("decay_steps", decay_steps)
    if total <= warm:
        raise ValueError(
            f"decay_steps ({total}) counts the warmup too; it must exceed warmup_steps ({warm})"
        )
    return peak, warm, total, _number("init_value", init_value), _number("end_value", end_value)


def warmup_cosine_decay_schedule(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    *,
    init_value: float = 0.0,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over
    ``warmup_steps``, then cosine decay to ``end_value`` at step
    ``decay_steps`` (counted from 0, warmup included), constant after.

    >>> from shardax import optim
    >>> s = optim.warmup_cosine(1.0, 2, 6)      # peak, warmup steps, total steps
    >>> [round(s(i), 4) for i in range(8)]
    [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    peak, warm, total, init, end = _warmup_args(
        peak_value, warmup_steps, decay_steps, init_value, end_value
    )
    exponent = validate("exponent", exponent, low_open=True)

    def schedule(step: int) -> float:
        if step < warm:
            f = max(step, 0) / warm
            return init * (1.0 - f) + peak * f
        k = min(step - warm, total - warm)
        c = (0.5 * (1.0 + math.cos(math.pi * k / (total - warm)))) ** exponent
        return end * (1.0 - c) + peak * c

    return schedule


def warmup_linear_decay_schedule(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    *,
    init_value: float = 0.0,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over
    ``warmup_steps``, then linear decay to ``end_value`` at step
    ``decay_steps`` (warmup included), constant after — the BERT schedule.

    >>> from shardax import optim
    >>> s = optim.warmup_linear_decay(1.0, 2, 6)
    >>> [s(i) for i in range(8)]
    [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    peak, warm, total, init, end = _warmup_args(
        peak_value, warmup_steps, decay_steps, init_value, end_value
    )

    def schedule(step: int) -> float:
        if step < warm:
            f = max(step, 0) / warm
            return init * (1.0 - f) + peak * f
        f = min(step - warm, total - warm) / (total - warm)
        return peak * (1.0 - f) + end * f

    return schedule


def one_cycle_schedule(
    peak_value: float,
    total_steps: int,
    *,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The 1cycle policy (Smith & Topin 2018, "Super-Convergence"), as
    ``torch.optim.lr_scheduler.OneCycleLR`` with cosine annealing: from
    ``peak_value / div_factor`` up to ``peak_value`` at step
    ``pct_start * total_steps - 1``, then down to
    ``peak_value / div_factor / final_div_factor`` at step
    ``total_steps - 1``, constant after.

    >>> from shardax import optim
    >>> s = optim.one_cycle(1.0, total_steps=10, pct_start=0.5, div_factor=4.0, final_div_factor=2.0)
    >>> s(0), s(4), s(9)
    (0.25, 1.0, 0.125)
    """
    peak = validate("peak_value", peak_value)
    total = _steps("total_steps", total_steps, minimum=2)
    pct = validate("pct_start", pct_start, low_open=True, high=1.0)
    div = validate("div_factor", div_factor, low_open=True)
    final_div = validate("final_div_factor", final_div_factor, low_open=True)
    start, low = peak / div, peak / div / final_div
    mid = float(pct * total) - 1.0
    end = float(total - 1)
    if not 0.0 < mid < end:
        raise ValueError(f"pct_start={pct} with total_steps={total} leaves no room for both phases")

    def anneal(a: float, b: float, frac: float) -> float:
        return b + (a - b) / 2.0 * (math.cos(math.pi * min(max(frac, 0.0), 1.0)) + 1.0)

    def schedule(step: int) -> float:
        if step <= mid:
            return anneal(start, peak, step / mid)
        return anneal(peak, low, (step - mid) / (end - mid))

    return schedule


def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """``init_value`` times the product of the scales of every boundary
    reached: from step ``b`` on, the value is multiplied by
    ``boundaries_and_scales[b]`` (as ``torch.optim.lr_scheduler.MultiStepLR``).

    >>> from shardax import optim
    >>> s = optim.piecewise_constant_schedule(1.0, {2: 0.5, 4: 0.1})
    >>> [s(i) for i in range(6)]
    [1.0, 1.0, 0.5, 0.5, 0.05, 0.05]
    """
    v = _number("init_value", init_value)
    pairs = []
    for b, s in sorted((boundaries_and_scales or {}).items()):
        pairs.append((_steps("boundary", b, minimum=0), _number(f"scale at {b}", s)))

    def schedule(step: int) -> float:
        out = v
        for b, s in pairs:
            if step >= b:
                out *= s
        return out

    return schedule


constant = constant_schedule
linear = linear_schedule
cosine = cosine_decay_schedule
warmup_cosine = warmup_cosine_decay_schedule
warmup_linear_decay = warmup_linear_decay_schedule
one_cycle = one_cycle_schedule
piecewise = piecewise_constant_schedule
