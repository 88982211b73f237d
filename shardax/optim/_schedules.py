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
    "deepspeed_warmup",
    "deepspeed_warmup_cosine",
    "deepspeed_warmup_cosine_schedule",
    "deepspeed_warmup_schedule",
    "linear",
    "linear_schedule",
    "one_cycle",
    "one_cycle_linear",
    "one_cycle_linear_schedule",
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


def one_cycle_linear_schedule(
    init_value: float,
    peak_value: float,
    up_steps: int,
    down_steps: int | None = None,
    *,
    decay_rate: float = 0.0,
    decay_steps: int = 0,
    up_stairs: int = 0,
    down_stairs: int | None = None,
) -> Schedule:
    """The 1cycle policy with linear halves and inverse-time decay (Smith
    2018, "A disciplined approach to neural network hyper-parameters: Part
    1"), as DeepSpeed's ``OneCycle`` scheduler computes it: linearly from
    ``init_value`` up to ``peak_value`` at step ``up_steps``, back down to
    ``init_value`` at step ``up_steps + down_steps`` (``down_steps``
    defaults to ``up_steps``), then
    ``init_value / (1 + decay_rate * (step - cycle) / decay_steps)`` — or
    ``init_value`` from then on when ``decay_rate`` or ``decay_steps`` is 0.

    ``up_stairs`` > 0 moves the value in that many equal stairs over the
    rising half instead of at every step (``down_stairs``, default
    ``up_stairs``, over the falling half). The arithmetic is DeepSpeed's,
    in its order (``deepspeed/runtime/lr_schedules.py``), so the values
    are the same floats: step ``k`` here is the learning rate of the
    ``k``-th update there (the scheduler steps after each update).

    Args:
        init_value: the value at step 0 and the end of the cycle
            (DeepSpeed's ``cycle_min_lr``).
        peak_value: the value at step ``up_steps`` (``cycle_max_lr``).
        up_steps: steps of the rising half (``cycle_first_step_size``).
        down_steps: steps of the falling half (``cycle_second_step_size``).
        decay_rate: ``decay_lr_rate``.
        decay_steps: the decay's step scale (``decay_step_size``).
        up_stairs, down_stairs: stairs of each half
            (``cycle_first_stair_count``, ``cycle_second_stair_count``).

    >>> from shardax.optim._schedules import one_cycle_linear
    >>> s = one_cycle_linear(0.1, 1.0, up_steps=3, decay_rate=0.5, decay_steps=2)
    >>> [round(s(i), 4) for i in range(10)]
    [0.1, 0.4, 0.7, 1.0, 0.7, 0.4, 0.1, 0.08, 0.0667, 0.0571]
    """
    low, high = _number("init_value", init_value), _number("peak_value", peak_value)
    first = float(_steps("up_steps", up_steps))
    second = first if down_steps is None else float(_steps("down_steps", down_steps, minimum=0))
    rate = _number("decay_rate", decay_rate)
    every = _steps("decay_steps", decay_steps, minimum=0)
    stairs_up = _steps("up_stairs", up_stairs, minimum=0)
    stairs_down = stairs_up if down_stairs is None else _steps("down_stairs", down_stairs, 0)
    total = first + second
    ratio = first / total
    decays = every != 0 and rate != 0

    def cycle(step: int) -> float:
        cycles = math.floor(1 + step / total)
        x = 1.0 + step / total - cycles
        if x <= ratio:
            scale, stairs = x / ratio, stairs_up
        else:
            scale, stairs = (x - 1) / (ratio - 1), stairs_down
        if stairs > 0:  # DeepSpeed floors the stair from the integer step, not from scale
            at = step % total
            position = at * stairs / first if at <= first else (total - at) * stairs / second
            scale = math.floor(position) / stairs
        return low + (high - low) * scale

    def schedule(step: int) -> float:
        if step <= total:
            return cycle(max(step, 0))
        if not decays:
            return low
        return low / (1 + rate * ((step - total) / every))

    return schedule


def _deepspeed_warmup(warmup_steps: int, warmup: str) -> Callable[[int], float]:
    """The warmup fraction of DeepSpeed's ``WarmupLR`` family at its
    iteration ``it`` (0 <= it < max(2, warmup_steps)), DeepSpeed's floats:
    ``log(it + 1) / log(n)`` (as ``inverse_log_warm_up * log(it + 1)``) or
    ``it / n``."""
    if warmup not in ("log", "linear"):
        raise ValueError(f"warmup must be 'log' or 'linear'; got {warmup!r}")
    n = max(2, _steps("warmup_steps", warmup_steps))
    inverse_log = 1.0 / math.log(n)
    if warmup == "log":
        return lambda it: inverse_log * math.log(it + 1)
    return lambda it: it / n


def deepspeed_warmup_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int | None = None,
    *,
    end_value: float | None = None,
    warmup: str = "log",
) -> Schedule:
    """DeepSpeed's ``WarmupLR`` (``decay_steps`` None) and ``WarmupDecayLR``
    (``decay_steps``: its ``total_num_steps``), update by update.

    DeepSpeed sets the learning rate to ``init_value`` when it builds the
    scheduler and steps the scheduler after each update, so update ``k``
    (0-based, optax's count) runs at the value of iteration ``k - 1``:
    ``init_value`` for the first two updates, then, with
    ``n = max(2, warmup_steps)``, a warmup fraction ``log(k) / log(n)``
    (``warmup="log"``, reaching the peak at ``k = n``) or ``(k - 1) / n``
    (``"linear"``, at ``k = n + 1``); then ``peak_value``, or, with
    ``decay_steps``, a linear decay ``(decay_steps - (k - 1)) / (decay_steps
    - n)`` of the way from ``end_value`` (DeepSpeed: ``init_value``, the
    default) to the peak, down to ``end_value`` at ``k = decay_steps + 1``.
    The arithmetic is DeepSpeed's, in its order
    (``deepspeed/runtime/lr_schedules.py``), so the values are the same
    floats.

    Args:
        init_value: ``warmup_min_lr``.
        peak_value: ``warmup_max_lr``.
        warmup_steps: ``warmup_num_steps`` (>= 1; DeepSpeed warms up over
            at least 2).
        decay_steps: ``total_num_steps`` of ``WarmupDecayLR``.
        end_value: where the decay ends (DeepSpeed's is ``init_value``).
        warmup: ``warmup_type``, ``"log"`` or ``"linear"``.

    >>> from shardax.optim._schedules import deepspeed_warmup
    >>> s = deepspeed_warmup(0.0, 1.0, 4, warmup="linear")
    >>> [s(k) for k in range(7)]
    [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    >>> s = deepspeed_warmup(0.1, 1.0, 2, decay_steps=5)
    >>> [round(s(k), 4) for k in range(9)]
    [0.1, 0.1, 1.0, 1.0, 0.7, 0.4, 0.1, 0.1, 0.1]
    """
    low, high = _number("init_value", init_value), _number("peak_value", peak_value)
    end = low if end_value is None else _number("end_value", end_value)
    fraction = _deepspeed_warmup(warmup_steps, warmup)
    n = max(2, warmup_steps)
    total = None if decay_steps is None else _steps("decay_steps", decay_steps)
    delta, fall = high - low, high - end

    def schedule(step: int) -> float:
        it = step - 1  # DeepSpeed's last_batch_iteration while update `step` runs
        if it < 0:
            return low  # set when DeepSpeed builds the scheduler
        if it < n:
            return low + delta * fraction(it)
        if total is None:
            return low + delta * 1.0
        return end + fall * max(0.0, float(total - it) / float(max(1.0, total - n)))

    return schedule


def deepspeed_warmup_cosine_schedule(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    *,
    init_ratio: float = 0.0,
    end_ratio: float = 1e-4,
    warmup: str = "log",
) -> Schedule:
    """DeepSpeed's ``WarmupCosineLR``, update by update: ``peak_value`` (the
    optimizer's learning rate) times a ratio.

    DeepSpeed sets the learning rate to 0 when it builds the scheduler and
    steps it after each update, so update ``k`` (0-based, optax's count)
    runs at 0 for ``k = 0``, then at the ratio of iteration ``k - 1``: with
    ``n = max(2, warmup_steps)``, ``init_ratio`` plus the warmup fraction
    (``log(k) / log(n)`` or ``(k - 1) / n``, as
    :func:`deepspeed_warmup_schedule`) of the way to 1, then from ``k = n +
    1`` the cosine ``end_ratio + (1 - end_ratio) * (1 + cos(pi * p)) / 2``
    with ``p = min(1, (k - n) / (decay_steps - n))`` — already one step into
    the decay at ``k = n + 1``, so a linear warmup never reaches the peak.
    The arithmetic is DeepSpeed's, in its order
    (``deepspeed/runtime/lr_schedules.py``), so the values are the same
    floats.

    Args:
        peak_value: the optimizer's learning rate.
        warmup_steps: ``warmup_num_steps`` (>= 1).
        decay_steps: ``total_num_steps``.
        init_ratio: ``warmup_min_ratio``.
        end_ratio: ``cos_min_ratio``.
        warmup: ``warmup_type``, ``"log"`` or ``"linear"``.

    >>> from shardax.optim._schedules import deepspeed_warmup_cosine
    >>> s = deepspeed_warmup_cosine(1.0, 2, 4, init_ratio=0.5, end_ratio=0.0, warmup="linear")
    >>> [s(k) for k in range(6)]
    [0.0, 0.5, 0.75, 0.5, 0.0, 0.0]
    """
    peak = _number("peak_value", peak_value)
    start, end = _number("init_ratio", init_ratio), _number("end_ratio", end_ratio)
    fraction = _deepspeed_warmup(warmup_steps, warmup)
    n = max(2, warmup_steps)
    span = max(1, _steps("decay_steps", decay_steps) - n)

    def schedule(step: int) -> float:
        it = step - 1  # DeepSpeed's last_batch_iteration while update `step` runs
        if it < 0:
            return 0.0  # set when DeepSpeed builds the scheduler
        if it < n:
            ratio = start + fraction(it) * (1.0 - start)
        else:
            progress = min(1.0, (it - n + 1) / span)
            cosine = (1 + math.cos(math.pi * progress)) / 2
            ratio = max(0.0, end + (1.0 - end) * cosine)
        return peak * ratio

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
one_cycle_linear = one_cycle_linear_schedule
deepspeed_warmup = deepspeed_warmup_schedule
deepspeed_warmup_cosine = deepspeed_warmup_cosine_schedule
piecewise = piecewise_constant_schedule
