"""1-bit LAMB (Li et al. 2022, "1-bit LAMB: Communication Efficient
Large-Scale Large-Batch Training with LAMB's Convergence Speed"), as
DeepSpeed's ``OnebitLamb``: LAMB with full-precision gradient averaging for
a warm-up, then a frozen variance and all the momenta averaged in 1 bit per
element as one buffer (:func:`~shardax.collectives._onebit.onebit_pmean`),
the trust ratio kept up to date from the variance those momenta imply.
Gradients, updates and checks as :func:`~shardax.optim.onebit_adam`'s
(:mod:`shardax.optim._onebit`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from .._tree import flatten_with_paths
from ..collectives._api import pmax
from ..collectives._onebit import onebit_errors, onebit_pmean_many
from ..errors import ShardingError
from ..shard._sharded import Sharded
from ._base import (
    Flat,
    GradientTransformation,
    Schedule,
    chain,
    expect_state,
    flatten,
    global_numel,
    is_sharded,
    local,
    needs_params,
    new_count,
    transformation,
    validate,
    zeros_like_state,
)
from ._norms import shard_axes, sums_of_squares
from ._onebit import (
    Axis,
    _build,
    _check_state_layout,
    _checked,
    _clipped,
    _masks,
    _psum_flat,
    _settings,
    mine,
    own_gradients,
    owner_stamp,
)
from ._transforms import scale_by_learning_rate

__all__ = ["OnebitLambState", "onebit_lamb", "scale_by_onebit_lamb"]


class OnebitLambState(NamedTuple):
    """State of :func:`onebit_lamb`: the step count; per leaf the moments
    ``mu`` and ``nu`` (frozen after the warm-up), ``fresh`` (the variance the
    compressed momenta imply, from the freeze on) and three 0-d fp32 values —
    ``coeff``, the running average of the warm-up's trust ratios, ``factor``,
    the last compressed step's scaling of it, and ``scaling``, what makes the
    momenta's RMS equal before they are compressed as one buffer (set at the
    first compressed step); and this rank's errors of that buffer (1-d,
    empty until the freeze), stamped with their ``owner`` as in
    :class:`~shardax.optim._onebit.OnebitAdamState`."""

    count: torch.Tensor
    mu: Any
    nu: Any
    fresh: Any
    coeff: Any
    factor: Any
    scaling: Any
    worker_error: torch.Tensor
    server_error: torch.Tensor
    owner: torch.Tensor


def _norms(tensors: list[torch.Tensor], like: list) -> list[torch.Tensor]:
    """The global L2 norm of each local tensor laid out as its partner."""
    return [
        x.sqrt() for x in sums_of_squares([_wrap(t, r) for t, r in zip(tensors, like, strict=True)])
    ]


def _wrap(t: torch.Tensor, like: Any) -> Any:
    return like.with_local(t) if isinstance(like, Sharded) else t


def _maxima(tensors: list[torch.Tensor], like: list) -> list[torch.Tensor]:
    """The global maximum of each local tensor laid out as its partner."""
    out = []
    for t, r in zip(tensors, like, strict=True):
        top = t.max() if t.numel() else t.new_full((), -math.inf)
        axes = shard_axes(r, "") if isinstance(r, Sharded) else ()
        out.append(pmax(top, axes, mesh=r.mesh) if axes else top)
    return out


class _Lamb(NamedTuple):
    """1-bit LAMB's settings, checked."""

    b1: float
    b2: float
    eps: float
    wd: float
    freeze_step: int
    axes: tuple[str, ...]
    coeffs: tuple[float, float]  # min, max
    coeff_beta: float
    factors: tuple[float, float]  # min, max
    threshold: float
    max_grad_norm: float | None = None


def _lamb_warmup(s: _Lamb, t: int, gs: list, mus: list, p: list, st: dict) -> list:
    """LAMB on the gradient averaged in full precision; the updates. ``st``:
    the state's local lists, replaced by the new ones."""
    summed = _psum_flat([g.local for g in gs], [g.mesh for g in gs], s.axes)
    summed = _clipped([x.to(torch.float32) for x in summed], mus, s.max_grad_norm)
    mu, nu, update = [], [], []
    for m, v, x, q in zip(st["mu"], st["nu"], summed, p, strict=True):
        mu.append(m.lerp(x, 1.0 - s.b1))
        nu.append(v.mul(s.b2).addcmul_(x, x, value=1.0 - s.b2))
        update.append(mu[-1] / (nu[-1].sqrt() + s.eps) + s.wd * q)
    st.update(mu=mu, nu=nu)
    if t == s.freeze_step:
        st["fresh"] = [v.clone() for v in nu]
    out, coeffs = [], []
    norms = zip(_norms(p, mus), _norms(update, mus), strict=True)
    for u, (w_norm, u_norm), c in zip(update, norms, st["coeff"], strict=True):
        ratio = torch.where((w_norm > 0) & (u_norm > 0), (w_norm / u_norm).clamp(*s.coeffs), 1.0)
        coeffs.append(torch.where(ratio != 1.0, s.coeff_beta * c + (1 - s.coeff_beta) * ratio, c))
        out.append(u * ratio)
    st["coeff"] = coeffs
    return out


def _lamb_compressed(s: _Lamb, t: int, gs: list, mus: list, p: list, st: dict, masks: list) -> list:
    """Each rank's momenta, scaled to one RMS, averaged in 1 bit as one flat
    buffer; the trust ratio from the frozen one and the fresh variance."""
    mesh = gs[0].mesh
    if t == s.freeze_step + 1:  # every momentum scaled to their mean RMS from now on
        rms = [
            n / math.sqrt(global_numel(r)) for n, r in zip(_norms(st["mu"], mus), mus, strict=True)
        ]
        mean_rms = sum(rms) / len(rms)  # (a zero momentum keeps scale 1: DeepSpeed's is inf)
        st["scaling"] = [torch.where(r > 0, mean_rms / r, 1.0) for r in rms]
    last = st["mu"]
    own = _clipped(own_gradients(gs, s.axes), mus, s.max_grad_norm)
    mine = [m.lerp(x, 1.0 - s.b1).mul_(c) for m, x, c in zip(last, own, st["scaling"], strict=True)]
    buffer = torch.cat([m.reshape(-1) for m in mine])
    if st["worker"].numel() == 0 and buffer.numel() > 0:
        st["worker"], st["server"] = onebit_errors(buffer, s.axes, mesh=mesh)
    mean, (st["worker"],), (st["server"],) = onebit_pmean_many(
        [buffer], [st["worker"]], [st["server"]], s.axes, mesh=mesh
    )
    pieces = mean[0].split([m.numel() for m in mine])
    mu = [x.view(m.shape) / c for x, m, c in zip(pieces, mine, st["scaling"], strict=True)]
    for m, keep in zip(mu, masks, strict=True):
        if keep is not None:
            m.mul_(keep)
    fresh = []
    for f, m, old in zip(st["fresh"], mu, last, strict=True):
        rebuilt = (m - s.b1 * old) / (1.0 - s.b1)  # the gradient these momenta imply
        fresh.append(f.mul(s.b2).addcmul_(rebuilt, rebuilt, value=1.0 - s.b2))
    denom = [v.sqrt() + s.eps for v in st["nu"]]
    prelim = [m / d for m, d in zip(mu, denom, strict=True)]
    update = [u + s.wd * q for u, q in zip(prelim, p, strict=True)] if s.wd else prelim
    factors = _maxima([d / (f.sqrt() + s.eps) for d, f in zip(denom, fresh, strict=True)], mus)
    if s.wd:  # toward 1 by the weight decay's share of the update
        norms = zip(_norms(prelim, mus), _norms(update, mus), strict=True)
        share = [torch.where(u > 0, (n / u).clamp(max=1.0), 1.0) for n, u in norms]
        factors = [f * k + (1.0 - k) for f, k in zip(factors, share, strict=True)]
    clipped = []
    for f, old in zip(factors, st["factor"], strict=True):
        f = f.clamp(*s.factors)  # then within threshold of the last step's
        clipped.append(f.clamp(old * (1 - s.threshold), old * (1 + s.threshold)))
    factors = clipped
    st.update(mu=mu, fresh=fresh, factor=factors)
    return [u * (c * f) for u, c, f in zip(update, st["coeff"], factors, strict=True)]


def scale_by_onebit_lamb(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    freeze_step: int,
    axis: Axis = "dp",
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    momentum_mask: Any = None,
    max_grad_norm: float | None = None,
) -> GradientTransformation:
    """1-bit LAMB's update before the learning rate; see :func:`onebit_lamb`."""
    b1, b2, eps, axes = _settings(b1, b2, eps, freeze_step, axis)
    s = _Lamb(
        b1, b2, eps, validate("weight_decay", weight_decay), freeze_step, axes,
        (validate("min_coeff", min_coeff, low_open=True), validate("max_coeff", max_coeff)),
        validate("coeff_beta", coeff_beta, high=1.0),
        (validate("factor_min", factor_min), validate("factor_max", factor_max)),
        validate("factor_threshold", factor_threshold, high=1.0),
        None if max_grad_norm is None else validate("max_grad_norm", max_grad_norm, low_open=True),
    )  # fmt: skip
    what = "onebit_lamb"

    def init(params: Any) -> OnebitLambState:
        _check_state_layout(params, axes, what)
        leaves, spec = flatten(params, "params")

        def moment() -> Any:
            return optree.tree_unflatten(spec, [zeros_like_state(x, torch.float32) for x in leaves])

        def scalar(value: float) -> Any:
            return optree.tree_unflatten(
                spec, [torch.full((), value, device=local(x).device) for x in leaves]
            )

        empty = torch.zeros(0, device=local(leaves[0]).device if leaves else None)
        return OnebitLambState(new_count(), moment(), moment(), moment(), scalar(0.0),
                               scalar(1.0), scalar(0.0), empty, empty,
                               owner_stamp(params))  # fmt: skip

    def update(grads: Any, state: OnebitLambState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, OnebitLambState, what=what)
        needs_params(params, what)
        paths, leaves, _ = flatten_with_paths(grads, is_leaf=is_sharded, none_is_leaf=True)
        if None in leaves:
            raise ValueError(
                f"{what}: gradient {paths[leaves.index(None)]!r} is None; 1-bit LAMB compresses "
                "every momentum as one buffer, so every param needs a gradient (leave frozen "
                "params out of the tree it optimizes)"
            )
        gs, mus, spec = _checked(grads, state.mu, axes, what)
        if any(g.mesh != gs[0].mesh for g in gs):
            raise ShardingError(
                f"{what}: the gradients live on different meshes; 1-bit LAMB averages all "
                "momenta as one buffer, on one mesh"
            )
        flat = Flat(state.mu, "state.mu")
        p = [x.to(torch.float32) for x in flat.align(params, "params")]
        fields = ("nu", "fresh", "coeff", "factor", "scaling")
        st = {f: flat.same(getattr(state, f), f"state.{f}") for f in fields}
        st.update(mu=flat.locals, worker=state.worker_error, server=state.server_error)
        stamp = owner_stamp(grads)
        if not mine(state.owner, stamp):  # another rank's errors (a restored checkpoint)
            st.update(
                worker=state.worker_error.new_zeros(0), server=state.server_error.new_zeros(0)
            )
        t = int(state.count) + 1
        masks = _masks(momentum_mask, grads, mus, what)
        if t <= freeze_step:
            u = _lamb_warmup(s, t, gs, mus, p, st)
        else:
            u = _lamb_compressed(s, t, gs, mus, p, st, masks)
        plain = [torch.empty(())] * len(mus)  # the 0-d values are plain tensors
        trees = [_build(spec, st[f], mus if f in ("nu", "fresh") else plain) for f in fields]
        mu = _build(spec, st["mu"], mus)
        new = OnebitLambState(state.count + 1, mu, *trees, st["worker"], st["server"], stamp)
        return _build(spec, u, mus), new

    return transformation(init, update, own_none=True)


def onebit_lamb(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    freeze_step: int,
    axis: Axis = "dp",
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    momentum_mask: Any = None,
    max_grad_norm: float | None = None,
) -> GradientTransformation:
    """1-bit LAMB (Li et al. 2022, "1-bit LAMB: Communication Efficient
    Large-Scale Large-Batch Training with LAMB's Convergence Speed"), as
    DeepSpeed's ``OnebitLamb``; gradients, updates and ``momentum_mask`` as
    in :func:`onebit_adam`.

    - Warm-up (steps ``1 .. freeze_step``): LAMB (You et al. 2020) on the
      gradient averaged in full precision, without bias correction (as
      DeepSpeed): ``u = m / (sqrt(v) + eps) + weight_decay * p``, scaled by
      the trust ratio ``||p|| / ||u||`` clipped to ``[min_coeff,
      max_coeff]``, whose running average (``coeff_beta``, from 0: keep
      ``1 / (1 - coeff_beta) <= freeze_step``) is kept.
    - After: ``v`` frozen; each rank's own momentum, every leaf scaled to the
      same RMS (coefficients fixed at the first compressed step), averaged
      by one :func:`~shardax.collectives._onebit.onebit_pmean` of them all
      as one flat buffer (padding at its end). The "fresh" variance of the
      gradients these momenta imply sets the trust ratio: the frozen
      average times ``max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))``, blended
      toward 1 by the weight decay's share of ``u``, clipped to
      ``[factor_min, factor_max]`` and to ``factor_threshold`` of the last
      step's.

    The update is ``-lr * ratio * u``. Every leaf needs a gradient (a None
    one is refused: the buffer holds them all), and all live on one mesh.
    ``max_grad_norm`` clips as in :func:`onebit_adam`: the averaged gradient
    during the warm-up, each rank's own after it.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> opt = sx.optim.onebit_lamb(0.1, freeze_step=2)
    >>> params = {"w": sx.shard(torch.ones(3), mesh, sx.P())}
    >>> state = opt.init(params)
    >>> for g in ([1.0, -1.0, 2.0], [2.0, -1.0, 1.0], [1.0, 1.0, 1.0]):
    ...     grad = sx.Sharded(torch.tensor(g), sx.Layout(mesh, sx.P(), partial="dp"), (3,))
    ...     updates, state = opt.update({"w": grad}, state, params)
    ...     params = sx.optim.apply_updates(params, updates)
    >>> params["w"].local       # one rank: the third step's momentum goes exact
    tensor([0.7787, 1.2081, 0.7826])
    """
    core = scale_by_onebit_lamb(
        b1, b2, eps, weight_decay, freeze_step=freeze_step, axis=axis, max_coeff=max_coeff,
        min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
        factor_threshold=factor_threshold, momentum_mask=momentum_mask, max_grad_norm=max_grad_norm,
    )  # fmt: skip
    return chain(core, scale_by_learning_rate(learning_rate, _owned=True))
