"""Mixed precision: fp32 master weights in the optimizer state, and dynamic
loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision
Training")."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..shard._memory import allocate, is_disk, release
from ..shard._placement import memory_kind
from ..shard._sharded import Sharded
from ..shard._transfer import transfer
from ._base import (
    Flat,
    Fusible,
    GradientTransformation,
    MasterFusion,
    apply_updates,
    expect_state,
    flatten,
    needs_params,
    role_layout,
    transformation,
)
from ._gradless import gradless
from ._norms import all_finite
from ._partial import align_partial

__all__ = ["DynamicLossScale", "MasterWeightsState", "with_master_weights"]


# -- master weights -------------------------------------------------------------


class MasterWeightsState(NamedTuple):
    """State of :func:`with_master_weights`: the high-precision copy of the
    params (sharded like the optimizer state) and the inner state."""

    master: Any
    inner_state: Any


def _master_leaf(x: Any, dtype: torch.dtype) -> Any:
    if not isinstance(x, Sharded):
        return x.detach().to(dtype, copy=True)
    layout = role_layout(x, "opt_state")
    if x.device.type == "meta":
        shape = layout.local_shape(x.shape, layout.mesh.rank)  # type: ignore[attr-defined]
        return Sharded(torch.empty(shape, dtype=dtype, device="meta"), layout, x.shape)
    moved = x if layout == x.layout else transfer(x, layout)
    master = allocate(moved.local.shape, dtype, memory_kind(x, "opt_state"), moved.local.device)
    master.copy_(moved.local.detach())
    if is_disk(master):
        release(master)  # written: to its file, out of this process
    # the param's placement: the inner state follows its memory kind too
    return Sharded(master, layout, x.shape, placement=x.placement)


def with_master_weights(
    inner: GradientTransformation, dtype: torch.dtype = torch.float32
) -> GradientTransformation:
    """Run ``inner`` on a ``dtype`` copy of the params kept in the state —
    fp32 master weights for bf16/fp16 params.

    ``init`` stores the copy, each Sharded leaf in its "opt_state" layout (so
    under ZeRO the master weights are sharded like the rest of the state) and
    initializes ``inner`` on it. ``update`` casts the gradients to ``dtype``,
    runs ``inner`` against the master copy, updates it, and returns updates
    (in ``dtype``) such that :func:`apply_updates` gives the new master
    weights rounded to the params' dtype (exactly, unless a value changes by
    more than a factor 2**16 in one step). Around an optimizer with a native
    kernel, :func:`fused_step` steps the fp32 master copy in place and
    writes the bf16/fp16 params from it, rounded, in the same pass.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.with_master_weights(optim.sgd(1e-3))
    >>> params = torch.ones(2, dtype=torch.bfloat16)
    >>> state = opt.init(params)
    >>> for _ in range(3):   # each step alone would round away in bf16
    ...     u, state = opt.update(torch.ones(2, dtype=torch.bfloat16), state, params)
    ...     params = optim.apply_updates(params, u)
    >>> params, state.master
    (tensor([0.9961, 0.9961], dtype=torch.bfloat16), tensor([0.9970, 0.9970]))
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype; got {dtype!r}")

    def init(params: Any) -> MasterWeightsState:
        leaves, spec = flatten(params, "params")
        master = optree.tree_unflatten(spec, [_master_leaf(x, dtype) for x in leaves])
        return MasterWeightsState(master, inner.init(master))

    def update(updates: Any, state: MasterWeightsState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, MasterWeightsState, what="with_master_weights")
        needs_params(params, "with_master_weights")
        # None gradients stay None: the inner optimizer keeps those leaves
        found = gradless(updates)
        flat = Flat(state.master if found is None else found.cut(state.master), "state.master")
        grads = _cast_gradients(flat, updates, dtype)
        # the inner optimizer sees the whole master copy (MultiSteps may step a leaf whose
        # gradient came at an earlier micro-step), and says which leaves it updates
        inner_updates, inner_state = inner.update(grads, state.inner_state, state.master)
        new_master = apply_updates(state.master, inner_updates)
        kept = gradless(inner_updates)
        if kept is not None:
            new_view, params = kept.cut(new_master), kept.cut(params)
        else:
            new_view = new_master
        done = Flat(new_view, "master")
        out = [
            m.to(x.dtype).to(dtype) - x.to(dtype)
            for m, x in zip(done.locals, done.align(params, "params"), strict=True)
        ]
        return done.build(out), MasterWeightsState(new_master, inner_state)

    reference = transformation(init, update, own_none=True)
    if isinstance(inner, Fusible):
        return Fusible(reference.init, reference.update, MasterFusion(inner, dtype))
    return reference


def _cast_gradients(flat: Flat, updates: Any, dtype: torch.dtype) -> Any:
    """``updates`` cast to ``dtype`` in the layouts of ``flat``'s leaves —
    keeping the partial axes of gradients left partial
    (:func:`~shardax.optim._partial.align_partial`): relaying them would sum them."""
    kept = align_partial(flat, updates, "updates")
    if kept is None:
        return flat.build([g.to(dtype) for g in flat.align(updates, "updates")])
    cast = [
        x.with_local(x.local.to(dtype)) if isinstance(x, Sharded) else x.to(dtype) for x in kept
    ]
    return optree.tree_unflatten(flat.spec, cast)


# -- dynamic loss scaling ------------------------------------------------------------


class _LossScaleFields(NamedTuple):
    scale: float
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    growth_tracker: int
    finite: bool
    skipped: int
    hysteresis: int
    min_scale: float
    hysteresis_left: int


class DynamicLossScale(_LossScaleFields):
    """Dynamic loss scaling for fp16 training, with the semantics of
    ``torch.amp.GradScaler``: multiply the loss by ``scale``; unscale the
    gradients; if any is NaN or inf — on *any* rank — skip the step and
    multiply the scale by ``backoff_factor``; after ``growth_interval``
    finite steps in a row, multiply it by ``growth_factor``. DeepSpeed's
    two refinements are options: ``hysteresis`` (back off only at the
    ``hysteresis``-th non-finite step since the scale last grew; the steps
    are skipped all the same) and ``min_scale`` (the scale never backs off
    below it).

    A frozen value (a NamedTuple, so a pytree you can checkpoint): each
    method returns a new one. ``finite`` says whether the last step was
    taken; ``skipped`` counts the skipped steps.

    Args:
        scale: the initial scale.
        growth_interval: finite steps in a row before the scale grows.
        growth_factor: the growth multiplier (> 1).
        backoff_factor: the multiplier after a non-finite step (in (0, 1)).
        hysteresis: non-finite steps that back off the scale only at the
            last of them (DeepSpeed's ``hysteresis``; 1: at once).
        min_scale: the floor of backing off (DeepSpeed's ``min_loss_scale``).

    >>> import torch
    >>> from shardax import optim
    >>> ls = optim.DynamicLossScale(2.0**10, growth_interval=2)
    >>> grads, ls = ls.unscale_and_adjust({"w": torch.tensor([1024.0, float("inf")])})
    >>> ls.finite, ls.scale, ls.skipped
    (False, 512.0, 1)
    >>> grads, ls = ls.unscale_and_adjust({"w": torch.tensor([512.0])})
    >>> grads, ls.finite, ls.scale
    ({'w': tensor([1.])}, True, 512.0)
    """

    __slots__ = ()

    def __new__(
        cls,
        scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_tracker: int = 0,
        finite: bool = True,
        skipped: int = 0,
        hysteresis: int = 1,
        min_scale: float = 0.0,
        hysteresis_left: int | None = None,
    ) -> DynamicLossScale:
        scale = float(scale)
        if not (scale > 0 and scale != float("inf")):
            raise ValueError(f"the loss scale must be a positive finite number; got {scale!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"growth_interval must be an int; got {growth_interval!r}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1; got {growth_interval}")
        if not float(growth_factor) > 1.0:
            raise ValueError(f"growth_factor must be > 1; got {growth_factor!r}")
        if not 0.0 < float(backoff_factor) < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1); got {backoff_factor!r}")
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1; got {hysteresis!r}")
        if not 0.0 <= float(min_scale) <= scale:
            raise ValueError(f"min_scale must be in [0, scale={scale}]; got {min_scale!r}")
        return super().__new__(
            cls,
            scale,
            growth_interval,
            float(growth_factor),
            float(backoff_factor),
            int(growth_tracker),
            bool(finite),
            int(skipped),
            hysteresis,
            float(min_scale),
            hysteresis if hysteresis_left is None else int(hysteresis_left),
        )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (differentiable; keep the loss in fp32).

        >>> from shardax import optim
        >>> import torch
        >>> optim.DynamicLossScale(8.0).scale_loss(torch.tensor(0.5))
        tensor(4.)
        """
        return loss * self.scale

    def unscale(self, grads: Any) -> Any:
        """The gradients divided by the scale, as new tensors in their dtype
        (Sharded leaves keep their layout).

        >>> from shardax import optim
        >>> import torch
        >>> optim.DynamicLossScale(4.0).unscale([torch.tensor([2.0])])
        [tensor([0.5000])]
        """
        inv = float(torch.tensor(1.0 / self.scale, dtype=torch.float32))
        with torch.no_grad():
            flat = Flat(grads, "grads")
            return flat.build([g * inv for g in flat.locals])

    def adjust(self, finite: bool) -> DynamicLossScale:
        """The scale after a step whose gradients were (not) finite.

        >>> from shardax import optim
        >>> optim.DynamicLossScale(4.0, growth_interval=1).adjust(True).scale
        8.0
        >>> ls = optim.DynamicLossScale(4.0, hysteresis=2, min_scale=1.0).adjust(False)
        >>> ls.scale, ls.finite, ls.adjust(False).scale     # backs off at the 2nd overflow
        (4.0, False, 2.0)
        """
        if not finite:
            skipped = self._replace(growth_tracker=0, finite=False, skipped=self.skipped + 1)
            if self.hysteresis_left > 1:  # DeepSpeed's hysteresis: not yet
                return skipped._replace(hysteresis_left=self.hysteresis_left - 1)
            return skipped._replace(scale=max(self.scale * self.backoff_factor, self.min_scale))
        tracker = self.growth_tracker + 1
        if tracker == self.growth_interval:
            return self._replace(
                scale=self.scale * self.growth_factor,
                growth_tracker=0,
                finite=True,
                hysteresis_left=self.hysteresis,
            )
        return self._replace(growth_tracker=tracker, finite=True)

    def unscale_and_adjust(self, grads: Any) -> tuple[Any, DynamicLossScale]:
        """Unscale the gradients, check them (:func:`all_finite`, agreed by
        all ranks) and adjust the scale: ``(grads, new_loss_scale)``; take
        the optimizer step only if ``new_loss_scale.finite``.

        >>> from shardax import optim
        >>> import torch
        >>> optim.DynamicLossScale(2.0).unscale_and_adjust(torch.tensor([4.0]))
        (tensor([2.]), DynamicLossScale(scale=2.0, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5, growth_tracker=1, finite=True, skipped=0, hysteresis=1, min_scale=0.0, hysteresis_left=1))
        """
        unscaled = self.unscale(grads)
        return unscaled, self.adjust(all_finite(unscaled))
