"""Gradient accumulation: ``MultiSteps``."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ._base import (
    Flat,
    GradientTransformation,
    cast,
    expect_state,
    foreach,
    new_count,
    transformation,
    zeros_like_state,
)
from ._wrappers import zeros_like_updates

__all__ = ["MultiStepsState", "MultiSteps"]


class MultiStepsState(NamedTuple):
    """State of :func:`MultiSteps`: micro-steps since the last update, updates
    done, the inner state, and the sum of the micro-steps' gradients so far
    (in at least fp32, sharded like the optimizer state)."""

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_state: Any
    acc_grads: Any


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def MultiSteps(inner: GradientTransformation, every_k: int) -> GradientTransformation:
    """Accumulate gradients over ``every_k`` micro-steps, then apply ``inner``
    once to their mean; the other micro-steps return zero updates and leave
    the inner state alone. (The name is optax's.)

    The sum is kept in at least fp32, in each Sharded param's "opt_state"
    layout — under ZeRO-2 the accumulator is sharded like the optimizer
    state. Zero updates come in the params' layouts when ``params`` are
    given, so applying them moves no data. ``state.mini_step == 0`` after an
    update step.

    Args:
        inner: the optimizer to apply every ``every_k`` micro-steps.
        every_k: micro-steps per update (>= 1).

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.MultiSteps(optim.sgd(1.0), every_k=2)
    >>> params = torch.zeros(1)
    >>> state = opt.init(params)
    >>> u, state = opt.update(torch.tensor([1.0]), state, params)
    >>> u, int(state.mini_step)
    (tensor([0.]), 1)
    >>> u, state = opt.update(torch.tensor([3.0]), state, params)
    >>> u, int(state.mini_step), int(state.gradient_step)
    (tensor([-2.]), 0, 1)
    """
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"every_k must be an int >= 1; got {every_k!r}")

    def init(params: Any) -> MultiStepsState:
        flat = Flat(params, "params")
        acc = optree.tree_unflatten(
            flat.spec, [zeros_like_state(x, _acc_dtype(x.dtype)) for x in flat.leaves]
        )
        return MultiStepsState(new_count(), new_count(), inner.init(params), acc)

    def update(updates: Any, state: MultiStepsState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, MultiStepsState, what="MultiSteps")
        flat = Flat(state.acc_grads, "state.acc_grads")
        acc = flat.locals
        g = cast(flat.align(updates, "updates"), acc)
        acc = foreach(lambda a, g: torch._foreach_add(a, g), acc, g)
        mini = int(state.mini_step) + 1
        if mini < every_k:
            zeros = zeros_like_updates(updates, params)
            return zeros, state._replace(mini_step=state.mini_step + 1, acc_grads=flat.build(acc))
        mean = foreach(lambda a: torch._foreach_div(a, float(every_k)), acc)
        new_updates, inner_state = inner.update(flat.build(mean), state.inner_state, params)
        fresh = [torch.zeros_like(a) for a in acc]
        return new_updates, MultiStepsState(
            torch.zeros_like(state.mini_step),
            state.gradient_step + 1,
            inner_state,
            flat.build(fresh),
        )

    return transformation(init, update)
