"""Optimizers: each a ``chain`` of the transformations in this package.

Updates are what you add to the params: every optimizer ends with
``scale_by_learning_rate(lr)``, which applies ``-lr``. ``lr`` is a number or a
schedule (step -> value). Where an optimizer has a ``torch.optim``
counterpart its arithmetic and defaults follow it, so the two agree step for
step.

``adam``, ``adamw``, ``lion``, ``adagrad`` and ``rmsprop`` (in their common
forms) also name the native kernel that computes them in one pass (a
``Kernel``, their ``fusion``, which :func:`~shardax.optim.fused_step` reads);
their ``update`` is the chain all the same.
"""

from __future__ import annotations

from typing import Any

import torch

from ._base import Fusible, GradientTransformation, Kernel, chain
from ._factored import scale_by_factored_rms
from ._global import clip_by_block_rms, scale_by_param_block_rms, scale_by_trust_ratio
from ._transforms import (
    Schedule,
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_rss,
    trace,
)

__all__ = ["adafactor", "adagrad", "adam", "adamw", "lamb", "lion", "rmsprop", "sgd"]

LR = float | Schedule


def _chain(*maybe: GradientTransformation | None) -> GradientTransformation:
    return chain(*[t for t in maybe if t is not None])


def _fusible(reference: GradientTransformation, kernel: Kernel) -> GradientTransformation:
    """``reference``, saying which native kernel computes it (see :func:`fused_step`)."""
    return Fusible(reference.init, reference.update, kernel)


def sgd(
    lr: LR, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (no dampening):
    L2 ``weight_decay`` added to the gradient, then heavy-ball or Nesterov
    momentum (Sutskever et al. 2013).

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.sgd(0.1, momentum=0.9)
    >>> params = {"w": torch.ones(2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> optim.apply_updates(params, updates)
    {'w': tensor([0.9000, 0.9000])}
    """
    if nesterov and not momentum:
        raise ValueError("Nesterov momentum needs momentum > 0")
    return _chain(
        add_decayed_weights(weight_decay) if weight_decay else None,
        trace(momentum, nesterov) if momentum else None,
        scale_by_learning_rate(lr),
    )


def adam(
    lr: LR,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Adam (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization"),
    as ``torch.optim.Adam``: ``weight_decay`` is L2 regularization added to
    the gradient (for decoupled decay use :func:`adamw`). Each leaf keeps
    its own step count, advanced when it gets a gradient (see
    :func:`scale_by_adam`; ``bias_correction=False`` is DeepSpeed's
    ``FusedAdam`` option of that name).

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.adam(0.1)
    >>> params = torch.zeros(2)
    >>> updates, _ = opt.update(torch.tensor([1.0, -1.0]), opt.init(params), params)
    >>> updates
    tensor([-0.1000,  0.1000])

    Without ``amsgrad``, ``nesterov`` or ``mu_dtype``, :func:`fused_step`
    steps fp32 CPU tensors in one native pass, as for :func:`adamw`.
    """
    reference = _chain(
        add_decayed_weights(weight_decay) if weight_decay else None,
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nesterov=nesterov, amsgrad=amsgrad,
                      bias_correction=bias_correction),
        scale_by_learning_rate(lr, _owned=True),  # scale_by_adam's new buffers
    )  # fmt: skip
    if amsgrad or nesterov or mu_dtype is not None:
        return reference
    at = 1 if weight_decay else 0
    return _fusible(
        reference,
        Kernel(name="adam_l2", lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay,
               core=at, length=at + 2, bias_correction=bias_correction),
    )  # fmt: skip


def adamw(
    lr: LR,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: Any = None,
    *,
    amsgrad: bool = False,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019,
    "Decoupled Weight Decay Regularization"), as ``torch.optim.AdamW``:
    ``p -= lr * (adam_direction + weight_decay * p)``.

    Args:
        lr: learning rate or schedule.
        b1, b2, eps: Adam's (see :func:`scale_by_adam`).
        weight_decay: the decoupled decay coefficient.
        mask: where to decay (see :func:`add_decayed_weights`), e.g.
            ``lambda p: optree.tree_map(lambda x: x.ndim > 1, p, is_leaf=...)``
            to spare biases and norms.
        amsgrad, nesterov, mu_dtype: see :func:`scale_by_adam`.
        bias_correction: divide the moments by ``1 - b**t`` (``t``: the
            leaf's own step count, as ``torch.optim``); False is DeepSpeed's
            and apex's ``FusedAdam(bias_correction=False)``: ``m / (sqrt(v)
            + eps)``, in the fused kernel too.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.adamw(0.1, weight_decay=0.5)
    >>> params = torch.ones(2)
    >>> updates, _ = opt.update(torch.tensor([1.0, -3.0]), opt.init(params), params)
    >>> updates.round(decimals=4)               # -0.1 * (sign(g) + 0.5 * 1)
    tensor([-0.1500,  0.0500])

    ``update`` is the chain of transforms above. Without ``mask``,
    ``amsgrad``, ``nesterov`` or ``mu_dtype``, :func:`fused_step` steps fp32
    CPU params and state (gradients fp32, bf16 or fp16) in one native pass
    over gradient, moments and parameter, writing them in place
    (``kernels/csrc/optim.cpp``, as ``torch.optim.AdamW(fused=True)``),
    agreeing with the chain to about an ulp; elsewhere — or without a
    compiler, or with ``SHARDAX_NO_NATIVE=1`` — the chain runs. The state is
    the chain's either way.
    """
    reference = chain(  # scale_by_adam makes new buffers: decayed and scaled in place
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nesterov=nesterov, amsgrad=amsgrad,
                      bias_correction=bias_correction),
        add_decayed_weights(weight_decay, mask, _owned=True),
        scale_by_learning_rate(lr, _owned=True),
    )  # fmt: skip
    if mask is not None or amsgrad or nesterov or mu_dtype is not None:
        return reference
    return _fusible(
        reference,
        Kernel(name="adamw", lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay,
               core=0, length=3, bias_correction=bias_correction),
    )  # fmt: skip


def adagrad(
    lr: LR,
    *,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adagrad (Duchi et al. 2011), as ``torch.optim.Adagrad`` (use a
    schedule for its ``lr_decay``).

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.adagrad(1.0)
    >>> params = torch.zeros(1)
    >>> opt.update(torch.tensor([-4.0]), opt.init(params), params)[0]
    tensor([1.])

    :func:`fused_step` steps fp32 CPU tensors in one native pass, as for
    :func:`adamw`.
    """
    reference = _chain(
        add_decayed_weights(weight_decay) if weight_decay else None,
        scale_by_rss(initial_accumulator_value, eps),
        scale_by_learning_rate(lr, _owned=True),  # scale_by_rss's new buffers
    )
    at = 1 if weight_decay else 0
    return _fusible(
        reference,
        Kernel(name="adagrad", lr=lr, eps=eps, weight_decay=weight_decay, core=at, length=at + 2),
    )


def rmsprop(
    lr: LR,
    decay: float = 0.99,
    eps: float = 1e-8,
    *,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    nesterov: bool = False,
) -> GradientTransformation:
    """RMSProp (Hinton 2012), as ``torch.optim.RMSprop`` (``decay`` is its
    ``alpha``): L2 ``weight_decay``, optional centering (Graves 2013) and
    momentum on the scaled gradient.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.rmsprop(0.01, decay=0.75, eps=0.0)
    >>> params = torch.zeros(1)
    >>> opt.update(torch.tensor([3.0]), opt.init(params), params)[0]
    tensor([-0.0200])

    Uncentered and without momentum, :func:`fused_step` steps fp32 CPU
    tensors in one native pass, as for :func:`adamw`.
    """
    if nesterov and not momentum:
        raise ValueError("Nesterov momentum needs momentum > 0")
    reference = _chain(
        add_decayed_weights(weight_decay) if weight_decay else None,
        scale_by_rms(decay, eps, centered=centered),
        trace(momentum, nesterov) if momentum else None,
        scale_by_learning_rate(lr),
    )
    if centered or momentum:
        return reference
    at = 1 if weight_decay else 0
    return _fusible(
        reference,
        Kernel(name="rmsprop", lr=lr, betas=(decay,), eps=eps, weight_decay=weight_decay,
               core=at, length=at + 2),
    )  # fmt: skip


def lion(
    lr: LR,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    mask: Any = None,
    *,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms"): the sign of an interpolated momentum, with decoupled
    weight decay. Use a learning rate 3-10x smaller than AdamW's.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.lion(0.1, weight_decay=0.0)
    >>> params = torch.zeros(2)
    >>> opt.update(torch.tensor([0.3, -5.0]), opt.init(params), params)[0]
    tensor([-0.1000,  0.1000])

    Without ``mask`` or ``mu_dtype``, :func:`fused_step` steps fp32 CPU
    tensors in one native pass (``kernels/csrc/optim.cpp``), as for
    :func:`adamw`.
    """
    reference = chain(  # scale_by_lion makes new buffers: decayed and scaled in place
        scale_by_lion(b1, b2, mu_dtype),
        add_decayed_weights(weight_decay, mask, _owned=True),
        scale_by_learning_rate(lr, _owned=True),
    )
    if mask is not None or mu_dtype is not None:
        return reference
    return _fusible(
        reference,
        Kernel(name="lion", lr=lr, betas=(b1, b2), weight_decay=weight_decay, core=0, length=3),
    )


def lamb(
    lr: LR,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning:
    Training BERT in 76 minutes"): Adam's direction plus decoupled weight
    decay, scaled per leaf by the trust ratio ``||p|| / ||update||`` (norms of
    the global tensors, also when sharded).

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.lamb(0.1)
    >>> params = torch.tensor([3.0, 4.0])
    >>> opt.update(torch.tensor([1.0, -1.0]), opt.init(params), params)[0]
    tensor([-0.3536,  0.3536])
    """
    return chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(lr),
    )


def adafactor(
    lr: LR,
    *,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    weight_decay: float = 0.0,
    mask: Any = None,
    eps: float = 1e-30,
    factored: bool = True,
) -> GradientTransformation:
    """Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates
    with Sublinear Memory Cost"), as optax composes it: factored second
    moments, update clipping at ``clipping_threshold`` (RMS), the step scaled
    by ``max(rms(p), 1e-3)`` (``multiply_by_parameter_scale``), optional
    momentum, and weight decay added after the learning rate (so not
    scaled by it, as in optax).

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.adafactor(0.1, min_dim_size_to_factor=2)
    >>> params = torch.full((2, 2), 2.0)
    >>> opt.update(torch.ones(2, 2), opt.init(params), params)[0]
    tensor([[-0.2000, -0.2000],
            [-0.2000, -0.2000]])
    """
    return _chain(
        scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps),
        clip_by_block_rms(clipping_threshold) if clipping_threshold is not None else None,
        scale_by_learning_rate(lr, flip_sign=False),
        scale_by_param_block_rms() if multiply_by_parameter_scale else None,
        trace(momentum) if momentum else None,
        add_decayed_weights(weight_decay, mask) if weight_decay else None,
        scale(-1.0),
    )
