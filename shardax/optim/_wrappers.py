"""Transformations of transformations: ``masked``, ``inject_hyperparams``,
``apply_if_finite``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from .._tree import flatten_with_paths
from ._base import (
    GradientTransformation,
    expect_state,
    flatten,
    is_sharded,
    local,
    new_count,
    structure_error,
    transformation,
)
from ._gradless import gradless
from ._norms import all_finite

__all__ = [
    "ApplyIfFiniteState",
    "InjectHyperparamsState",
    "MaskedState",
    "apply_if_finite",
    "inject_hyperparams",
    "masked",
]


# -- masked -------------------------------------------------------------------


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner state, over the selected leaves
    only (None elsewhere)."""

    inner_state: Any


def _mask_flags(mask: Any, tree: Any, what: str) -> list[bool]:
    """One bool per leaf of ``tree`` (in flattening order)."""
    _, spec = flatten(tree, what)
    mask_tree = mask(tree) if callable(mask) else mask
    try:
        full = optree.tree_broadcast_prefix(mask_tree, tree, is_leaf=is_sharded)
    except ValueError as err:
        paths = flatten_with_paths(tree, is_leaf=is_sharded)[0]
        raise ValueError(
            f"the mask's structure does not match the {what} ({err}); give a pytree of bools "
            f"shaped like the {what} (or a prefix of it: one bool per subtree), or a callable "
            f"{what} -> such a tree; the {what} have leaves {paths[:8]!r}"
            + ("..." if len(paths) > 8 else "")
        ) from None
    flags = spec.flatten_up_to(full)
    for i, f in enumerate(flags):
        if isinstance(f, torch.Tensor) and f.dtype == torch.bool and f.numel() == 1:
            flags[i] = bool(f)
        elif not isinstance(f, bool | np.bool_):
            path = flatten_with_paths(tree, is_leaf=is_sharded)[0][i]
            raise TypeError(f"mask entry for {path!r} is {f!r}; mask entries are bools")
    return [bool(f) for f in flags]


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; pass the other
    updates through unchanged. ``inner`` sees (and keeps state for) only the
    selected leaves: the others are None in the trees it gets.

    Args:
        inner: the transformation to apply where the mask is True.
        mask: a pytree of bools shaped like the params (or a prefix of it),
            or a callable ``params -> such a tree``.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.masked(optim.scale(0.0), {"w": True, "b": False})
    >>> opt.update({"w": torch.ones(1), "b": torch.ones(1)}, opt.init(None))[0]
    {'w': tensor([0.]), 'b': tensor([1.])}
    """

    def select(tree: Any, flags: list[bool], spec: Any, like: Any) -> Any:
        try:
            leaves = spec.flatten_up_to(tree)
        except ValueError:
            raise structure_error(tree, like, "params", "updates") from None
        return optree.tree_unflatten(
            spec, [x if f else None for x, f in zip(leaves, flags, strict=True)]
        )

    def init(params: Any) -> MaskedState:
        if params is None:
            return MaskedState(inner.init(None))
        _, spec = flatten(params, "params")
        flags = _mask_flags(mask, params, "params")
        return MaskedState(inner.init(select(params, flags, spec, params)))

    def update(updates: Any, state: MaskedState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, MaskedState, what="masked")
        # a mask function sees the whole params; a leaf whose update is None (no
        # gradient) is None in the params the inner transformation gets
        mask_tree = mask(updates if params is None else params) if callable(mask) else mask
        found = gradless(updates)
        if found is not None:
            params = found.cut(params)
        leaves, spec = flatten(updates, "updates")
        flags = _mask_flags(mask_tree, updates if params is None else params, "params")
        sub_params = None if params is None else select(params, flags, spec, updates)
        sub_updates = select(updates, flags, spec, updates)
        new_sub, inner_state = inner.update(sub_updates, state.inner_state, sub_params)
        new_leaves = spec.flatten_up_to(new_sub)
        out = [n if f else x for x, n, f in zip(leaves, new_leaves, flags, strict=True)]
        return optree.tree_unflatten(spec, out), MaskedState(inner_state)

    return transformation(init, update, own_none=True)


# -- inject_hyperparams ---------------------------------------------------------


class InjectHyperparamsState(NamedTuple):
    """State of :func:`inject_hyperparams`: the step count, the current
    hyperparameters (0-d float64 tensors, by name; change them between steps)
    and the inner state."""

    count: torch.Tensor
    hyperparams: dict[str, torch.Tensor]
    inner_state: Any


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: tuple[str, ...] = ()
) -> Callable[..., GradientTransformation]:
    """Wrap an optimizer factory so that its numeric hyperparameters live in
    the state, where they can be read and changed between steps; callables
    passed for them are schedules (step -> value), evaluated every step.

    ``inject_hyperparams(adamw)(lr=warmup_cosine(1e-3, 10, 100))`` behaves
    like ``adamw(lr=...)``, and ``state.hyperparams["lr"]`` holds the value
    used at the last step; assign ``state.hyperparams["lr"] = 1e-4`` (or
    build a new state with ``_replace``) to change it. Arguments that are
    not numbers or callables (bools, None, dtypes) are passed as they are;
    name callables that are not schedules (masks) in ``static_args``.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.inject_hyperparams(optim.sgd)(lr=0.1)
    >>> params = torch.ones(1)
    >>> state = opt.init(params)
    >>> state.hyperparams["lr"] = torch.tensor(0.5, dtype=torch.float64)
    >>> opt.update(torch.ones(1), state, params)[0]
    tensor([-0.5000])
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        if signature is not None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
        elif args:
            raise TypeError("inject_hyperparams: pass the hyperparameters by name")
        else:
            given = dict(kwargs)
        for name in static_args:
            if name not in given:
                raise TypeError(f"static_args names {name!r}, which the factory does not take")
        schedules = {k: v for k, v in given.items() if k not in static_args and callable(v)}
        numeric = {
            k: v
            for k, v in given.items()
            if k not in static_args and not isinstance(v, bool) and _is_number(v)
        }
        static = {k: v for k, v in given.items() if k not in schedules and k not in numeric}
        ints = {k for k, v in numeric.items() if isinstance(v, int | np.integer)}

        def values(hps: dict[str, Any], count: int) -> dict[str, float]:
            out = {k: float(v) for k, v in hps.items() if k in numeric}
            out |= {k: float(fn(count)) for k, fn in schedules.items()}
            return {k: int(v) if k in ints else v for k, v in out.items()}

        def store(values: dict[str, float]) -> dict[str, torch.Tensor]:
            return {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}

        def init(params: Any) -> InjectHyperparamsState:
            hps = values(numeric, 0)
            return InjectHyperparamsState(
                new_count(), store(hps), factory(**static, **hps).init(params)
            )

        def update(
            updates: Any, state: InjectHyperparamsState, params: Any = None
        ) -> tuple[Any, Any]:
            expect_state(state, InjectHyperparamsState, what="inject_hyperparams")
            unknown = set(state.hyperparams) - set(numeric) - set(schedules)
            if unknown:
                raise ValueError(
                    f"state.hyperparams has {sorted(unknown)}, which this optimizer does not "
                    f"inject (it injects {sorted({*numeric, *schedules})})"
                )
            hps = values({**numeric, **state.hyperparams}, int(state.count))
            updates, inner_state = factory(**static, **hps).update(
                updates, state.inner_state, params
            )
            return updates, InjectHyperparamsState(state.count + 1, store(hps), inner_state)

        return GradientTransformation(init, update)

    return wrapped


def _is_number(v: Any) -> bool:
    if isinstance(v, int | float | np.number):
        return True
    return isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()


# -- apply_if_finite -------------------------------------------------------------


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`: consecutive and total non-finite
    steps, whether the last step was finite, and the inner state."""

    notfinite_count: int
    last_finite: bool
    total_notfinite: int
    inner_state: Any


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int = 5
) -> GradientTransformation:
    """Skip steps whose updates hold a NaN or inf: the updates become zeros
    and the inner state is left as it was. The check is agreed by all ranks
    (see :func:`all_finite`), so a non-finite value in one rank's shard skips
    the step everywhere. After ``max_consecutive_errors`` skipped steps in a
    row the inner update is applied anyway, so a diverged run shows itself.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.apply_if_finite(optim.sgd(0.1))
    >>> params = torch.ones(1)
    >>> u, state = opt.update(torch.tensor([float("nan")]), opt.init(params), params)
    >>> u, state.last_finite, state.total_notfinite
    (tensor([0.]), False, 1)
    """
    if isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int):
        raise TypeError(f"max_consecutive_errors must be an int; got {max_consecutive_errors!r}")
    if max_consecutive_errors < 0:
        raise ValueError(f"max_consecutive_errors must be >= 0; got {max_consecutive_errors}")

    def init(params: Any) -> ApplyIfFiniteState:
        return ApplyIfFiniteState(0, True, 0, inner.init(params))

    def update(updates: Any, state: ApplyIfFiniteState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, ApplyIfFiniteState, what="apply_if_finite")
        finite = all_finite(updates)
        if finite or state.notfinite_count >= max_consecutive_errors:
            new_updates, inner_state = inner.update(updates, state.inner_state, params)
        else:
            new_updates, inner_state = zeros_like_updates(updates, params), state.inner_state
        return new_updates, ApplyIfFiniteState(
            0 if finite else state.notfinite_count + 1,
            finite,
            state.total_notfinite + (not finite),
            inner_state,
        )

    return transformation(init, update, own_none=True)  # the whole params, to inner


def zeros_like_updates(updates: Any, params: Any) -> Any:
    """Zero updates, in the params' layouts when there are params (nothing to
    gather when they are applied), else in the updates'; None where the
    update is None (a leaf without a gradient)."""
    tree = params if params is not None else updates
    found = gradless(updates)
    if found is not None:
        tree = found.cut(tree)
    leaves, spec = flatten(tree, "params" if params is not None else "updates")
    zeros = [
        x.with_local(torch.zeros_like(x.local)) if is_sharded(x) else torch.zeros_like(local(x))
        for x in leaves
    ]
    return optree.tree_unflatten(spec, zeros)
