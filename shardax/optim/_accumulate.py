"""Gradient accumulation: ``MultiSteps``."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..errors import ShardingError
from ..shard._sharded import Sharded
from ._base import (
    Flat,
    GradientTransformation,
    cast,
    expect_state,
    foreach,
    is_sharded,
    local,
    new_count,
    new_counts,
    read_steps,
    transformation,
    zeros_like_state,
)
from ._gradless import gradless
from ._partial import align_partial
from ._wrappers import zeros_like_updates

__all__ = ["MultiStepsState", "MultiSteps"]


class MultiStepsState(NamedTuple):
    """State of :func:`MultiSteps`: micro-steps since the last update, updates
    done, the inner state, the sum of the micro-steps' gradients so far
    (in at least fp32, sharded like the optimizer state), and per leaf how
    many of those micro-steps gave it a gradient (0-d int64; None in a
    state from before: every leaf, if any micro-step was taken)."""

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_state: Any
    acc_grads: Any
    acc_count: Any = None


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

    A gradient that is None at a micro-step adds nothing (its update is
    None); at the update, a leaf no micro-step gave a gradient is None to
    ``inner`` — kept, with its state — and one that got some is stepped by
    their sum over ``every_k``, as ``torch.optim`` steps ``p.grad``
    accumulated over the micro-batches of a loss divided by ``every_k``.
    Wrap the rest of the optimizer (``with_master_weights`` included) in
    ``MultiSteps``, not the other way round: an outer wrapper keeps a leaf
    whose gradient is None at the last micro-step.

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
        counts = new_counts(params)
        return MultiStepsState(new_count(), new_count(), inner.init(params), acc, counts)

    def update(updates: Any, state: MultiStepsState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, MultiStepsState, what="MultiSteps")
        counts_tree = state.acc_count
        if counts_tree is None:  # a state from before: no micro-step yet, or every leaf one
            some = int(state.mini_step) > 0
            counts_tree = optree.tree_map(lambda _: torch.tensor(int(some)), state.acc_grads,
                                          is_leaf=is_sharded)  # fmt: skip
        found = gradless(updates)  # leaves without a gradient now: nothing added
        view = state.acc_grads if found is None else found.cut(state.acc_grads)
        flat = Flat(view, "state.acc_grads")
        acc = flat.locals
        kept = align_partial(flat, updates, "updates")  # each rank's own, for the 1-bit optimizers
        if kept is not None and found is not None:
            raise ShardingError(
                "MultiSteps: gradients left partial (value_and_grad(unreduced=...)) with leaves "
                "that got no gradient this micro-step: the partial sums of those leaves would be "
                "mixed with whole ones; give every leaf a gradient (leave frozen ones out)"
            )
        g = cast(flat.align(updates, "updates") if kept is None else [local(x) for x in kept], acc)
        acc = foreach(lambda a, g: torch._foreach_add(a, g), acc, g)
        counted = flat.same(
            counts_tree if found is None else found.cut(counts_tree), "state.acc_count"
        )
        counted = optree.tree_unflatten(
            flat.spec, torch._foreach_add(counted, 1) if counted else []
        )
        acc_grads, acc_count = flat.build(acc), counted
        if found is not None:
            acc_grads = found.keep(acc_grads, state.acc_grads)
            acc_count = found.keep(acc_count, counts_tree)
        mini = int(state.mini_step) + 1
        if mini < every_k:
            zeros = zeros_like_updates(updates, params)
            return zeros, state._replace(
                mini_step=state.mini_step + 1, acc_grads=acc_grads, acc_count=acc_count
            )
        whole = Flat(acc_grads, "state.acc_grads")
        stepped = read_steps(whole.same(acc_count, "state.acc_count"))
        mean = foreach(lambda a: torch._foreach_div(a, float(every_k)), whole.locals)
        grads = whole.build(mean)
        if kept is not None:  # still each rank's own sums, partial as they came
            grads = optree.tree_unflatten(whole.spec, [
                Sharded(m, x.layout, x.shape) if isinstance(x, Sharded) else m
                for m, x in zip(mean, kept, strict=True)
            ])  # fmt: skip
        if not all(stepped):  # a leaf no micro-step gave a gradient: None to inner
            leaves, spec = optree.tree_flatten(grads, none_is_leaf=True)
            it = iter(stepped)
            grads = optree.tree_unflatten(
                spec, [None if x is None or not next(it) else x for x in leaves]
            )
        new_updates, inner_state = inner.update(grads, state.inner_state, params)
        return new_updates, MultiStepsState(
            torch.zeros_like(state.mini_step),
            state.gradient_step + 1,
            inner_state,
            whole.build([torch.zeros_like(a) for a in whole.locals]),
            optree.tree_unflatten(whole.spec, [new_count() for _ in stepped]),
        )

    return transformation(init, update, own_none=True)
