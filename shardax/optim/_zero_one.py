"""0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for
Large-scale Training via 0/1 Adam"), as DeepSpeed's ``ZeroOneAdam``: 1-bit
Adam without its full-precision warm-up. The variance is updated on
exponentially rarer steps (full-precision averages there, 1-bit ones
elsewhere) until ``var_freeze_step``; after it, each rank takes local steps
with its own momentum and the ranks sync their accumulated change in 1 bit
every ``H`` steps, ``H`` doubling up to ``local_step_clipper``.

Between syncs each rank's params and momentum are its own: they are laid
out *diverged* over the data-parallel axis (:class:`~shardax.Layout`'s
``diverged``), so nothing reads them as replicas — a checkpoint or a
:func:`shardax.gather` takes their mean, an explicit psum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..shard._layout import Layout
from ..shard._sharded import Sharded
from ._base import (
    GradientTransformation,
    Schedule,
    expect_state,
    flatten,
    local,
    needs_params,
    new_count,
    transformation,
    validate,
    zeros_like_state,
)
from ._onebit import (
    Axis,
    _check_state_layout,
    _checked,
    _clipped,
    _empty_errors,
    _masks,
    _psum_flat,
    _settings,
    compressed_mean,
    mine,
    own_gradients,
    owner_stamp,
)

__all__ = ["ZeroOneAdamState", "zero_one_adam"]


class ZeroOneAdamState(NamedTuple):
    """State of :func:`zero_one_adam`.

    - ``count``: the steps taken (0-d int64).
    - ``mu``, ``nu``: the moments (fp32, in the params' layouts). ``mu`` is
      each rank's own between the syncs of the local steps (laid out
      diverged over the axis), ``nu`` the same everywhere.
    - ``accumulated``: each rank's change to its params since the last sync
      (fp32; DeepSpeed's ``momentum_accumulator``, the paper's ``u``),
      diverged while it is not zero.
    - ``lrs``: the learning rates summed since the last sync (0-d fp64).
    - ``policy``: int64 ``[var_interval, var_counter, local_interval,
      local_counter]``, DeepSpeed's four counters: the variance is updated
      every ``var_interval`` steps, which doubles after
      ``var_update_scaler`` updates; local steps sync every
      ``local_interval`` steps, which doubles (up to the clipper) every
      ``local_step_scaler`` steps.
    - ``worker_error``, ``server_error``, ``owner``: this rank's compression
      errors and whose they are, as in :class:`OnebitAdamState`.
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    accumulated: Any
    lrs: torch.Tensor
    policy: torch.Tensor
    worker_error: Any
    server_error: Any
    owner: torch.Tensor


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return value


def _laid(ref: Any, t: torch.Tensor, diverged: tuple[str, ...]) -> Any:
    """``t`` as ``ref``'s partner: Sharded in ``ref``'s sharding, diverged
    over ``diverged`` (replicated there when empty); plain where ``ref`` is."""
    if not isinstance(ref, Sharded):
        return t
    layout = Layout(ref.layout.sharding, partial=ref.layout.partial, diverged=diverged)
    return Sharded(t, layout, ref.shape)


def _param_locals(params: Any, mus: list, what: str) -> list[torch.Tensor]:
    """Each param's local tensor (fp32), read as it is: a diverged param's
    own copy, never relaid (that would average the copies)."""
    leaves, _ = flatten(params, "params")
    if len(leaves) != len(mus):
        raise ValueError(
            f"{what}: params has {len(leaves)} leaves with a gradient, the state {len(mus)}; "
            "pass the params the optimizer was initialized on"
        )
    out = []
    for p, m in zip(leaves, mus, strict=True):
        if isinstance(m, Sharded) and (
            not isinstance(p, Sharded) or p.layout.sharding != m.layout.sharding
        ):
            got = p.layout if isinstance(p, Sharded) else type(p).__name__
            raise ValueError(
                f"{what}: a param is laid out {got!r}, its state {m.layout!r}; pass the params "
                "the optimizer was initialized on"
            )
        out.append(local(p).to(torch.float32))
    return out


def zero_one_adam(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    axis: Axis = "dp",
    momentum_mask: Any = None,
    max_grad_norm: float | None = None,
) -> GradientTransformation:
    """0/1 Adam (Lu et al. 2022), as DeepSpeed's ``ZeroOneAdam``: Adam whose
    data-parallel traffic is 1 bit per element on all but a few steps, with
    no full-precision warm-up.

    - **Steps 1 .. var_freeze_step.** On every ``var_interval``-th step the
      gradient is averaged in full precision and both moments are updated;
      on the others it is averaged in 1 bit
      (:func:`~shardax.collectives.onebit_pmean`, with error feedback) and
      only the momentum is. ``var_interval`` starts at 1 and doubles after
      every ``var_update_scaler`` variance updates, so the full-precision
      steps grow exponentially rarer. Every rank takes the same step.
    - **After var_freeze_step** the variance is frozen and each rank steps
      with its own gradient and momentum (local steps); every
      ``local_interval``-th step the ranks average, in 1 bit, the change
      each made since the last sync (scaled by ``sqrt(nu) + eps``), go back
      to the last synced params plus that mean, and set the momentum to it
      over the summed learning rates. ``local_interval`` starts at 1 and
      doubles, up to ``local_step_clipper``, every ``local_step_scaler``
      steps.

    The step is ``-lr * (m / (sqrt(v) + eps) + weight_decay * p)``, with no
    bias correction (DeepSpeed's arithmetic, whatever its
    ``bias_correction`` flag says). Unlike DeepSpeed, the first step updates
    the params (DeepSpeed's first only initializes buffers); the schedules
    are DeepSpeed's, on its count: step ``t`` here is its step ``t + 1``, so
    the same steps go full precision, freeze and sync.

    **Diverged params.** Once the local interval exceeds 1, the ranks hold
    different params between syncs; even after a sync they may differ in
    the last bit (each undoes its own change). The updates, the params
    they give (:func:`~shardax.optim.apply_updates`) and the momentum are
    then laid out *diverged* over ``axis``: each rank computes with its own
    copy, and whatever needs the whole value (:func:`shardax.gather`,
    :func:`shardax.ckpt.save`) takes the ranks' mean — the value the next
    sync would give without compression. A restored run starts every rank
    from those means (DeepSpeed starts them from rank 0's copy).

    **Gradients** are each rank's own contribution, partial over ``axis``,
    as for :func:`~shardax.optim.onebit_adam`
    (``value_and_grad(..., unreduced=axis)``); a gradient already summed is
    refused by name. The state is whole on every rank of ``axis`` (no ZeRO
    over it).

    Args:
        learning_rate: a number or a schedule (step -> value).
        b1, b2, eps: Adam's.
        weight_decay: decoupled weight decay (then ``update`` needs the params).
        var_freeze_step: the last step that may update the variance.
        var_update_scaler: variance updates before their interval doubles
            (the paper's kappa).
        local_step_scaler: steps before the local interval doubles.
        local_step_clipper: the largest local interval (the paper's H).
        axis: the data-parallel mesh axis, or a tuple of axes.
        momentum_mask: as :func:`~shardax.optim.onebit_adam`'s, multiplied
            into every 1-bit average.
        max_grad_norm: clip the gradient as DeepSpeed's
            ``gradient_clipping`` does: the averaged one by its global norm
            on full-precision steps, each rank's own by its own norm on the
            others.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> opt = sx.optim.zero_one_adam(0.1, var_freeze_step=2, local_step_scaler=1)
    >>> params = {"w": sx.shard(torch.ones(3), mesh, sx.P())}
    >>> state = opt.init(params)
    >>> for g in ([1.0, -1.0, 2.0], [2.0, -1.0, 1.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]):
    ...     grad = sx.Sharded(torch.tensor(g), sx.Layout(mesh, sx.P(), partial="dp"), (3,))
    ...     updates, state = opt.update({"w": grad}, state, params)
    ...     params = sx.optim.apply_updates(params, updates)
    >>> state.policy                      # the local interval doubled after steps 3 and 4
    tensor([1, 2, 4, 0])
    >>> params["w"].layout                # step 4 was a local step: each rank's own copy
    Layout(Mesh({'dp': 1}), P(), diverged=('dp',))
    """
    var_freeze_step = _positive_int("var_freeze_step", var_freeze_step)
    b1, b2, eps, axes = _settings(b1, b2, eps, var_freeze_step, axis)
    weight_decay = validate("weight_decay", weight_decay)
    var_scaler = _positive_int("var_update_scaler", var_update_scaler)
    local_scaler = _positive_int("local_step_scaler", local_step_scaler)
    clipper = _positive_int("local_step_clipper", local_step_clipper)
    if max_grad_norm is not None:
        max_grad_norm = validate("max_grad_norm", max_grad_norm, low_open=True)
    lr_at = learning_rate if callable(learning_rate) else None
    lr_value = None if callable(learning_rate) else validate("learning_rate", learning_rate)
    what = "zero_one_adam"

    def init(params: Any) -> ZeroOneAdamState:
        _check_state_layout(params, axes, what)
        leaves, spec = flatten(params, "params")

        def zeros() -> Any:
            return optree.tree_unflatten(
                spec, [_settled(zeros_like_state(x, torch.float32)) for x in leaves]
            )

        return ZeroOneAdamState(
            new_count(), zeros(), zeros(), zeros(),
            torch.zeros((), dtype=torch.float64), torch.tensor([1, 0, 1, 0]),
            _empty_errors(params), _empty_errors(params), owner_stamp(params),
        )  # fmt: skip

    def update(grads: Any, state: ZeroOneAdamState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, ZeroOneAdamState, what=what)
        gs, mus, spec = _checked(grads, state.mu, axes, what)
        if weight_decay:
            needs_params(params, what)
        ps = _param_locals(params, mus, what) if weight_decay else None
        nus = [local(x) for x in flatten(state.nu, "state.nu")[0]]
        accs = flatten(state.accumulated, "state.accumulated")[0]
        workers = flatten(state.worker_error, "state.worker_error")[0]
        servers = flatten(state.server_error, "state.server_error")[0]
        stamp = owner_stamp(grads)
        t = int(state.count) + 1
        if not mine(state.owner, stamp) or t == var_freeze_step + 1:
            # another rank's errors, or the local steps' first: they will
            # measure another quantity (DeepSpeed resets them there too)
            workers = servers = [torch.zeros(0, device=w.device) for w in workers]
        lr = float(lr_at(t - 1)) if lr_at is not None else float(lr_value)  # type: ignore[arg-type]
        if lr < 0:
            raise ValueError(
                f"{what}: the learning-rate schedule gave {lr} at step {t - 1}; lr >= 0"
            )
        var_interval, var_counter, interval, counter = (int(v) for v in state.policy)
        ds = t + 1  # DeepSpeed's count, which includes its initializing step: its schedules
        meshes = [g.mesh for g in gs]
        masks = _masks(momentum_mask, grads, mus, what)
        mu_l = [local(m) for m in mus]
        acc_l = [local(a) for a in accs]
        lrs = float(state.lrs)
        # a rank's own: each param changed alone since the last sync, or diverged before
        apart = [_is_apart(a) for a in accs]
        if ps is not None:
            apart = [
                x or _is_apart(p) for x, p in zip(apart, flatten(params, "params")[0], strict=True)
            ]

        def steps() -> list[torch.Tensor]:
            out = []
            for i, (m, v) in enumerate(zip(mu_l, nus, strict=True)):
                d = m / (v.sqrt() + eps)
                out.append((d + weight_decay * ps[i] if ps is not None else d).mul_(-lr))
            return out

        own_step = False
        if t <= var_freeze_step:  # every rank takes the same step
            if ds % var_interval == 0:  # the variance's step: full precision
                g = [x.to(torch.float32) for x in _psum_flat([g.local for g in gs], meshes, axes)]
                g = _clipped(g, mus, max_grad_norm)
                nus = [
                    v.mul(b2).addcmul_(x, x, value=1.0 - b2) for v, x in zip(nus, g, strict=True)
                ]
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            else:  # the gradients averaged in 1 bit
                own = _clipped(own_gradients(gs, axes), mus, max_grad_norm)
                g, workers, servers = compressed_mean(own, meshes, workers, servers, axes)
                g = [x if k is None else x * k for x, k in zip(g, masks, strict=True)]
            mu_l = [m.lerp(x, 1.0 - b1) for m, x in zip(mu_l, g, strict=True)]
            out = steps()
        else:  # local steps with each rank's own momentum
            own = _clipped(own_gradients(gs, axes), mus, max_grad_norm)
            mu_l = [m.lerp(x, 1.0 - b1) for m, x in zip(mu_l, own, strict=True)]
            lrs += lr
            out = steps()
            if ds % interval == 0:  # sync: the change since the last one, averaged in 1 bit
                scaled = [
                    (a + s) * (v.sqrt() + eps) for a, s, v in zip(acc_l, out, nus, strict=True)
                ]
                mean, workers, servers = compressed_mean(scaled, meshes, workers, servers, axes)
                mean = [x if k is None else x * k for x, k in zip(mean, masks, strict=True)]
                # back to the last synced params, then the mean change
                out = [c / (v.sqrt() + eps) - a for c, v, a in zip(mean, nus, acc_l, strict=True)]
                mu_l = [c / -lrs for c in mean]
                acc_l, lrs = [torch.zeros_like(a) for a in acc_l], 0.0
            else:
                acc_l = [a + s for a, s in zip(acc_l, out, strict=True)]
                own_step = True
            counter += 1
            if counter == local_scaler:
                counter, interval = 0, min(clipper, interval * 2)
        ours = axes if own_step else ()
        new = ZeroOneAdamState(
            state.count + 1,
            optree.tree_unflatten(spec, [_laid(r, x, ours) for r, x in zip(mus, mu_l, strict=True)]),
            optree.tree_unflatten(spec, [_laid(r, x, ()) for r, x in zip(mus, nus, strict=True)]),
            optree.tree_unflatten(spec, [_laid(r, x, ours) for r, x in zip(mus, acc_l, strict=True)]),
            torch.tensor(lrs, dtype=torch.float64),
            torch.tensor([var_interval, var_counter, interval, counter]),
            optree.tree_unflatten(spec, workers),
            optree.tree_unflatten(spec, servers),
            stamp,
        )  # fmt: skip
        updates = [
            _laid(r, x, axes if own_step or a else ())
            for r, x, a in zip(mus, out, apart, strict=True)
        ]
        return optree.tree_unflatten(spec, updates), new

    return transformation(init, update)


def _is_apart(x: Any) -> bool:
    return isinstance(x, Sharded) and bool(x.layout.diverged)


def _settled(x: Any) -> Any:
    return x if not isinstance(x, Sharded) else Sharded(x.local, x.layout.settled(), x.shape)
