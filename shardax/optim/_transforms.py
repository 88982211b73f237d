"""The small transformations optimizers are chained from.

Stateful ones keep their state in the "opt_state" layout of each Sharded
param and align the incoming updates to it; stateless ones work in the
updates' layout and align the params to that. All the math here is local to
a rank's shard (statistics of whole tensors are in ``_global``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ._base import (
    EmptyState,
    Flat,
    GradientTransformation,
    Schedule,
    by_step,
    cast,
    counts_per_leaf,
    expect_state,
    foreach,
    needs_params,
    new_count,
    new_counts,
    read_steps,
    transformation,
    tree_zeros_state,
    validate,
)
from ._gradless import keep_gradless

__all__ = [
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "ScaleByStddevState",
    "TraceState",
    "add_decayed_weights",
    "identity",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "trace",
]


# -- scaling ------------------------------------------------------------------


# ``_owned`` (scale, scale_by_schedule, scale_by_learning_rate,
# add_decayed_weights), for the aliases' own chains only: the updates it gets
# are buffers the transformation before it just made — not the caller's
# gradients, not anyone's state (so never after ``trace``) — and it writes
# them in place. The chain as a whole stays pure; the pure path of AdamW
# allocates two fewer parameter-sized buffers per step.


def identity() -> GradientTransformation:
    """The updates as they are (optax's ``identity``): a placeholder that
    keeps a chain's state the same shape when a stage of it is done
    elsewhere — under a pipeline, clipping by the whole model's norm.

    >>> import torch
    >>> from shardax import optim
    >>> optim.identity().update([torch.ones(2)], optim.EmptyState())
    ([tensor([1., 1.])], EmptyState())
    """

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        return updates, state

    return transformation(lambda params: EmptyState(), update)


def scale(step_size: float, *, _owned: bool = False) -> GradientTransformation:
    """Multiply the updates by a constant.

    >>> import torch
    >>> from shardax import optim
    >>> optim.scale(-2.0).update([torch.ones(2)], optim.EmptyState())[0]
    [tensor([-2., -2.])]
    """
    factor = validate("step_size", step_size, low=float("-inf"))

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        flat = Flat(updates, "updates")
        return flat.build(_mul(flat.locals, factor, _owned)), state

    return transformation(lambda params: EmptyState(), update)


def _mul(u: list[torch.Tensor], factor: float, owned: bool) -> list[torch.Tensor]:
    """``u * factor``: in place where the buffers are ``owned`` (see above)."""
    if owned:
        foreach(lambda u: _done(torch._foreach_mul_(u, factor), u), u)
        return u
    return foreach(lambda u: torch._foreach_mul(u, factor), u)


def _done(_: None, written: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an in-place ``_foreach_*_`` op wrote (it returns None)."""
    return written


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the step count (0-d int64)."""

    count: torch.Tensor


def scale_by_schedule(step_size_fn: Schedule, *, _owned: bool = False) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)``, count starting at 0.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_schedule(lambda step: 1.0 / (step + 1))
    >>> state = opt.init(None)
    >>> for _ in range(2):
    ...     u, state = opt.update(torch.ones(1), state)
    >>> u, state.count
    (tensor([0.5000]), tensor(2))
    """
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be a callable step -> value; got {step_size_fn!r}")

    def init(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(new_count())

    def update(updates: Any, state: ScaleByScheduleState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, ScaleByScheduleState, what="scale_by_schedule")
        factor = float(step_size_fn(int(state.count)))
        flat = Flat(updates, "updates")
        out = _mul(flat.locals, factor, _owned)
        return flat.build(out), ScaleByScheduleState(state.count + 1)

    return transformation(init, update)


def scale_by_learning_rate(
    lr: float | Schedule, *, flip_sign: bool = True, _owned: bool = False
) -> GradientTransformation:
    """Multiply the updates by ``-lr`` (``lr`` without ``flip_sign``): the
    last step of a descent optimizer. ``lr`` is a number or a schedule
    (step -> value, see :mod:`shardax.optim` schedules).

    >>> import torch
    >>> from shardax import optim
    >>> optim.scale_by_learning_rate(0.1).update(torch.ones(1), optim.EmptyState())[0]
    tensor([-0.1000])
    """
    sign = -1.0 if flip_sign else 1.0
    if callable(lr):
        schedule = lr

        def signed(step: int) -> float:
            value = float(schedule(step))
            if value < 0:
                raise ValueError(f"the learning-rate schedule gave {value} at step {step}; lr >= 0")
            return sign * value

        return scale_by_schedule(signed, _owned=_owned)
    return scale(sign * validate("lr", lr), _owned=_owned)


# -- weight decay, momentum ----------------------------------------------------


def add_decayed_weights(
    weight_decay: float = 0.0, mask: Any = None, *, _owned: bool = False
) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates: decoupled weight decay
    when it comes after the adaptive scaling (AdamW, Loshchilov & Hutter
    2019), L2 regularization when it comes before.

    Args:
        weight_decay: the coefficient (>= 0).
        mask: a pytree of bools shaped like the params (or a prefix of it), or
            a callable ``params -> such a tree``: decay only where True.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.add_decayed_weights(0.5)
    >>> p = {"w": torch.full((2,), 2.0)}
    >>> opt.update({"w": torch.zeros(2)}, opt.init(p), p)[0]
    {'w': tensor([1., 1.])}
    """
    wd = validate("weight_decay", weight_decay)

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        if wd == 0.0:
            return updates, state
        needs_params(params, "add_decayed_weights")
        flat = Flat(updates, "updates")
        u = flat.locals
        p = cast(flat.align(params, "params"), u)
        if _owned:
            foreach(lambda u, p: _done(torch._foreach_add_(u, p, alpha=wd), u), u, p)
            return flat.build(u), state
        return flat.build(foreach(lambda u, p: torch._foreach_add(u, p, alpha=wd), u, p)), state

    inner = transformation(lambda params: EmptyState(), update)
    if mask is None:
        return inner
    from ._wrappers import masked

    return masked(inner, mask)


class TraceState(NamedTuple):
    """State of :func:`trace`: the momentum buffer, like the params."""

    trace: Any


def trace(
    decay: float, nesterov: bool = False, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Momentum: ``t = decay * t + u``; the update is ``t`` (or
    ``u + decay * t`` with Nesterov's correction, Sutskever et al. 2013) —
    torch's SGD momentum with no dampening.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.trace(0.5)
    >>> state = opt.init(torch.zeros(1))
    >>> for _ in range(2):
    ...     u, state = opt.update(torch.ones(1), state)
    >>> u
    tensor([1.5000])
    """
    d = validate("decay", decay)

    def init(params: Any) -> TraceState:
        return TraceState(tree_zeros_state(params, accumulator_dtype))

    def update(updates: Any, state: TraceState, params: Any = None) -> tuple[Any, TraceState]:
        expect_state(state, TraceState, what="trace")
        flat = Flat(state.trace, "state.trace")
        t = flat.locals
        g = cast(flat.align(updates, "updates"), t)

        def math(t: list, g: list) -> tuple[list, list]:
            t = torch._foreach_mul(t, d)
            torch._foreach_add_(t, g)
            return (torch._foreach_add(g, t, alpha=d) if nesterov else t), t

        u, t = foreach(math, t, g, nout=2)
        return flat.build(u), TraceState(flat.build(t))

    return transformation(init, update)


# -- adaptive scalings ---------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: the step counts — one 0-d int64 per
    leaf, like the params, advanced only where a gradient came (as
    ``torch.optim``'s per-parameter ``state["step"]``) — and the first and
    second moments."""

    count: Any
    mu: Any
    nu: Any


class ScaleByAmsgradState(NamedTuple):
    """State of :func:`scale_by_adam` with ``amsgrad=True``: also the running
    maximum of the second moment."""

    count: Any
    mu: Any
    nu: Any
    nu_max: Any


def _beta(name: str, value: float) -> float:
    return validate(name, value, low=0.0, high=1.0)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    nesterov: bool = False,
    amsgrad: bool = False,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Rescale by Adam's bias-corrected moments (Kingma & Ba 2015):
    ``m̂ / (sqrt(v̂ + eps_root) + eps)``.

    The arithmetic follows ``torch.optim.Adam``: ``amsgrad`` keeps the
    running maximum of the raw second moment (Reddi et al. 2018);
    ``nesterov`` uses Nesterov momentum as in NAdam (Dozat 2016, without
    momentum decay, as optax does). Each leaf keeps its own step count ``t``
    for the bias correction, advanced only when the leaf gets a gradient: a
    leaf whose update is None keeps its moments and its count, as
    ``torch.optim`` skips a parameter whose ``grad`` is None.

    Args:
        b1, b2: decay rates of the first and second moments, in [0, 1).
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root.
        mu_dtype: dtype of the first moment (default: the param's).
        nesterov: use Nesterov momentum.
        amsgrad: use the AMSGrad maximum.
        bias_correction: divide the moments by ``1 - b1**t`` and
            ``1 - b2**t``; False gives ``m / (sqrt(v + eps_root) + eps)``, as
            DeepSpeed's and apex's ``FusedAdam(bias_correction=False)``.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_adam()
    >>> u, state = opt.update(torch.tensor([2.0, -3.0]), opt.init(torch.zeros(2)))
    >>> u.round(decimals=4)        # the first step is sign(g) (up to eps)
    tensor([ 1., -1.])
    >>> u, _ = optim.scale_by_adam(bias_correction=False).update(torch.tensor([2.0]), opt.init(torch.zeros(1)))
    >>> u                          # (0.1 * 2) / sqrt(0.001 * 4)
    tensor([3.1623])
    """
    b1, b2 = _beta("b1", b1), _beta("b2", b2)
    eps, eps_root = validate("eps", eps), validate("eps_root", eps_root)
    if not isinstance(bias_correction, bool):
        raise TypeError(f"bias_correction must be a bool; got {bias_correction!r}")

    def correction(b: float, t: int) -> float:
        return 1.0 - b**t if bias_correction else 1.0

    def init(params: Any) -> ScaleByAdamState | ScaleByAmsgradState:
        mu, nu = tree_zeros_state(params, mu_dtype), tree_zeros_state(params)
        if amsgrad:
            return ScaleByAmsgradState(new_counts(params), mu, nu, tree_zeros_state(params))
        return ScaleByAdamState(new_counts(params), mu, nu)

    def math(t: int, mu: list, nu: list, nu_max: list, g: list) -> tuple[list, ...]:
        # new moments: the state passed in keeps its values
        bc1, bc2 = correction(b1, t), correction(b2, t)
        gm, gv = cast(g, mu), cast(g, nu)
        mu = torch._foreach_lerp(mu, gm, 1.0 - b1)
        nu = torch._foreach_mul(nu, b2)
        torch._foreach_addcmul_(nu, gv, gv, 1.0 - b2)
        nu_max = torch._foreach_maximum(nu_max, nu) if amsgrad else nu
        if eps_root:
            denom = torch._foreach_add(nu_max, eps_root * bc2)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(nu_max)
        torch._foreach_div_(denom, bc2**0.5)
        torch._foreach_add_(denom, eps)
        if nesterov:
            num = torch._foreach_mul(mu, b1 / correction(b1, t + 1))
            torch._foreach_add_(num, gm, alpha=(1.0 - b1) / bc1)
            u = torch._foreach_div(num, cast(denom, num))
        elif all(d.dtype == m.dtype for d, m in zip(denom, mu, strict=True)):
            torch._foreach_div_(denom, mu)  # the update, in the denominator's buffer
            torch._foreach_reciprocal_(denom)
            torch._foreach_mul_(denom, 1.0 / bc1)
            u = denom
        else:
            u = torch._foreach_div(mu, cast(denom, mu))
            torch._foreach_mul_(u, 1.0 / bc1)
        return u, mu, nu, nu_max

    @keep_gradless
    def step(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        flat = Flat(state.nu, "state.nu")
        nu = flat.locals
        mu = flat.same(state.mu, "state.mu")
        nu_max = flat.same(state.nu_max, "state.nu_max") if amsgrad else nu
        counts = flat.same(state.count, "state.count")
        g = flat.align(updates, "updates")
        steps = [t + 1 for t in read_steps(counts)] if bias_correction else None
        u, mu, nu, nu_max = by_step(steps, math, mu, nu, nu_max, g, nout=4)
        count = optree.tree_unflatten(flat.spec, torch._foreach_add(counts, 1) if counts else [])
        if amsgrad:
            new = ScaleByAmsgradState(count, flat.build(mu), flat.build(nu), flat.build(nu_max))
            return flat.build(u), new
        return flat.build(u), ScaleByAdamState(count, flat.build(mu), flat.build(nu))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        expect_state(
            state, ScaleByAmsgradState if amsgrad else ScaleByAdamState, what="scale_by_adam"
        )
        # a state whose one count stands for every leaf: each leaf its copy, then the rule
        return step(updates, state._replace(count=counts_per_leaf(state.count, state.nu)), params)

    return transformation(init, update, own_none=True)


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion`: step count and momentum."""

    count: torch.Tensor
    mu: Any


def scale_by_lion(
    b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Lion's update direction (Chen et al. 2023, "Symbolic Discovery of
    Optimization Algorithms"): ``sign(b1 * m + (1 - b1) * g)``, then
    ``m = b2 * m + (1 - b2) * g``.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_lion()
    >>> opt.update(torch.tensor([0.5, -2.0, 0.0]), opt.init(torch.zeros(3)))[0]
    tensor([ 1., -1.,  0.])
    """
    b1, b2 = _beta("b1", b1), _beta("b2", b2)

    def init(params: Any) -> ScaleByLionState:
        return ScaleByLionState(new_count(), tree_zeros_state(params, mu_dtype))

    def update(updates: Any, state: ScaleByLionState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, ScaleByLionState, what="scale_by_lion")
        flat = Flat(state.mu, "state.mu")
        mu = flat.locals
        g = cast(flat.align(updates, "updates"), mu)

        def math(mu: list, g: list) -> tuple[list, list]:
            u = torch._foreach_lerp(mu, g, 1.0 - b1)
            torch._foreach_sign_(u)
            return u, torch._foreach_lerp(mu, g, 1.0 - b2)

        u, mu = foreach(math, mu, g, nout=2)
        return flat.build(u), ScaleByLionState(state.count + 1, flat.build(mu))

    return transformation(init, update)


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms`: the mean of squared updates."""

    nu: Any


class ScaleByStddevState(NamedTuple):
    """State of :func:`scale_by_rms` with ``centered=True``: the means of the
    updates and of their squares."""

    mu: Any
    nu: Any


def scale_by_rms(
    decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0, centered: bool = False
) -> GradientTransformation:
    """RMSProp's scaling (Hinton's lecture 6e, 2012): ``g / (sqrt(v) + eps)``
    with ``v = decay * v + (1 - decay) * g²``; ``centered`` subtracts the
    squared mean (Graves 2013). As ``torch.optim.RMSprop``, ``eps`` is added
    outside the square root.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_rms(decay=0.75, eps=0.0)
    >>> opt.update(torch.tensor([2.0]), opt.init(torch.zeros(1)))[0]   # 2 / sqrt(0.25 * 2²)
    tensor([2.])
    """
    d = _beta("decay", decay)
    eps = validate("eps", eps)
    initial_scale = validate("initial_scale", initial_scale)

    def init(params: Any) -> ScaleByRmsState | ScaleByStddevState:
        nu = tree_zeros_state(params)
        if initial_scale:
            flat = Flat(nu, "nu")
            nu = flat.build([t.fill_(initial_scale) for t in flat.locals])
        return ScaleByStddevState(tree_zeros_state(params), nu) if centered else ScaleByRmsState(nu)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        expect_state(
            state, ScaleByStddevState if centered else ScaleByRmsState, what="scale_by_rms"
        )
        flat = Flat(state.nu, "state.nu")
        nu = flat.locals
        mu = flat.same(state.mu, "state.mu") if centered else nu
        g = cast(flat.align(updates, "updates"), nu)

        def math(nu: list, mu: list, g: list) -> tuple[list, list, list]:
            nu = torch._foreach_mul(nu, d)
            torch._foreach_addcmul_(nu, g, g, 1.0 - d)
            if centered:
                mu = torch._foreach_lerp(mu, g, 1.0 - d)
                denom = torch._foreach_addcmul(nu, mu, mu, -1.0)
                torch._foreach_sqrt_(denom)
            else:
                denom = torch._foreach_sqrt(nu)
            torch._foreach_add_(denom, eps)
            return torch._foreach_div(g, denom), nu, mu

        u, nu, mu = foreach(math, nu, mu, g, nout=3)
        if centered:
            return flat.build(u), ScaleByStddevState(flat.build(mu), flat.build(nu))
        return flat.build(u), ScaleByRmsState(flat.build(nu))

    return transformation(init, update)


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: the running sum of squared updates."""

    sum_of_squares: Any


def scale_by_rss(
    initial_accumulator_value: float = 0.0, eps: float = 1e-10
) -> GradientTransformation:
    """Adagrad's scaling (Duchi et al. 2011): ``g / (sqrt(Σ g²) + eps)``,
    ``eps`` outside the square root as in ``torch.optim.Adagrad``.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_rss(eps=0.0)
    >>> state = opt.init(torch.zeros(1))
    >>> for g in (3.0, 4.0):
    ...     u, state = opt.update(torch.tensor([g]), state)
    >>> u, state.sum_of_squares
    (tensor([0.8000]), tensor([25.]))
    """
    init_value = validate("initial_accumulator_value", initial_accumulator_value)
    eps = validate("eps", eps)

    def init(params: Any) -> ScaleByRssState:
        acc = tree_zeros_state(params)
        if init_value:
            flat = Flat(acc, "sum_of_squares")
            acc = flat.build([t.fill_(init_value) for t in flat.locals])
        return ScaleByRssState(acc)

    def update(updates: Any, state: ScaleByRssState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, ScaleByRssState, what="scale_by_rss")
        flat = Flat(state.sum_of_squares, "state.sum_of_squares")
        acc = flat.locals
        g = cast(flat.align(updates, "updates"), acc)

        def math(acc: list, g: list) -> tuple[list, list]:
            acc = torch._foreach_addcmul(acc, g, g)
            denom = torch._foreach_sqrt(acc)
            torch._foreach_add_(denom, eps)
            return torch._foreach_div(g, denom), acc

        u, acc = foreach(math, acc, g, nout=2)
        return flat.build(u), ScaleByRssState(flat.build(acc))

    return transformation(init, update)
