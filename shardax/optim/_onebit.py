"""1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed"), as DeepSpeed's
``OnebitAdam``: Adam with full-precision gradient averaging for a warm-up,
then a frozen variance and momenta averaged in 1 bit per element with error
feedback (:func:`~shardax.collectives._onebit.onebit_pmean`).

The optimizer does its own data-parallel averaging, so it takes each rank's
*contribution* to the gradient, un-summed: Sharded gradients partial over
the data-parallel axis (``Layout(mesh, P(), partial=("dp",))``), which sum
over the ranks to the gradient of the global batch — what
:func:`shardax.value_and_grad` computes before it reduces (it seeds the
backward with ``1 / world``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from .._tree import flatten_with_paths
from ..collectives._api import psum
from ..collectives._onebit import onebit_errors, onebit_pmean_many
from ..errors import ShardingError
from ..mesh._mesh import Mesh, normalize_axes
from ..shard._placement import role_layout
from ..shard._sharded import Sharded, local_piece
from ._base import (
    GradientTransformation,
    Schedule,
    chain,
    expect_state,
    flatten,
    is_sharded,
    local,
    new_count,
    structure_error,
    transformation,
    validate,
    zeros_like_state,
)
from ._norms import global_norm
from ._transforms import add_decayed_weights, scale_by_learning_rate

__all__ = [
    "OnebitAdamState",
    "mine",
    "onebit_adam",
    "own_gradients",
    "owner_stamp",
    "scale_by_onebit_adam",
]

Axis = str | tuple[str, ...]


class OnebitAdamState(NamedTuple):
    """State of :func:`scale_by_onebit_adam`: the step count (one 0-d int64
    for all leaves: the freeze is the same step for every leaf), the
    moments ``mu`` and ``nu`` (fp32, in each param's layout: replicated
    over the axis, the same on every rank of it), and this rank's own
    compression errors for each leaf — the worker error shaped like the
    param's local piece, the server error 1-d, this rank's chunk of it (see
    :func:`~shardax.collectives._onebit.onebit_pmean`). The errors differ
    from rank to rank and stay empty (0 elements) until the freeze, as
    DeepSpeed allocates them there. ``owner`` (int64 ``[rank, world
    size]``) says whose errors they are: a checkpoint keeps rank 0's plain
    tensors, so a rank that finds another's stamp (a restored state, or one
    restored on another world) drops them and starts from zero errors, as
    DeepSpeed resets its errors when it loads a checkpoint."""

    count: torch.Tensor
    mu: Any
    nu: Any
    worker_error: Any
    server_error: Any
    owner: torch.Tensor


def owner_stamp(tree: Any) -> torch.Tensor:
    """``[rank, world size]`` of the mesh ``tree``'s Sharded leaves live on
    (``[0, 1]`` without one): whose compression errors a state holds."""
    leaves, _ = flatten(tree, "params")
    mesh = next((x.mesh for x in leaves if isinstance(x, Sharded)), None)
    if mesh is None or not isinstance(mesh, Mesh):
        return torch.tensor([0, 1])
    return torch.tensor([mesh.rank, mesh.world_size])


def mine(owner: torch.Tensor, stamp: torch.Tensor) -> bool:
    """Whether the errors stamped ``owner`` are this rank's (``stamp``)."""
    return owner.shape == stamp.shape and bool(torch.equal(owner.cpu(), stamp))


def _empty_errors(params: Any) -> Any:
    leaves, spec = flatten(params, "params")
    return optree.tree_unflatten(spec, [torch.zeros(0, device=x.device) for x in leaves])


def _check_state_layout(params: Any, axes: tuple[str, ...], what: str) -> None:
    """The moments must be whole on every rank of ``axes``."""
    paths, leaves, _ = flatten_with_paths(params, is_leaf=is_sharded)
    for path, x in zip(paths, leaves, strict=True):
        if not isinstance(x, Sharded):
            continue
        layout = role_layout(x, "opt_state")
        used = set(layout.spec.axes) | set(layout.partial)
        if used & set(axes):
            raise ShardingError(
                f"{what}: the optimizer state of {path!r} ({x.shape}) would be laid out "
                f"{layout.spec!r}{f' partial over {layout.partial!r}' if layout.partial else ''} "
                f"on {x.mesh!r}, split over {sorted(used & set(axes))!r}; 1-bit Adam keeps the "
                f"whole momentum on every rank of {axes!r} and averages it there. Shard the "
                f"params (and their state) with rules that do not split over {axes!r} (no "
                "rules.zero over the data-parallel axis)"
            )


def _grad_error(path: str, g: Any, ref: Any, axes: tuple[str, ...], what: str) -> str | None:
    """Why gradient ``g`` at ``path`` does not fit (None: it does)."""
    want = f"Layout(mesh, spec, partial={axes!r})"
    fix = (
        f"pass each rank's own contribution, un-summed, as Sharded(local_grad / world, "
        f"{want}, shape) — what value_and_grad computes before it reduces"
    )
    if not isinstance(g, Sharded):
        shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
        return (
            f"{what}: gradient {path!r} is a plain tensor {shape}, which says nothing of "
            f"whether it was averaged over {axes!r}; 1-bit Adam averages itself, so it takes "
            f"gradients partial over {axes!r}: {fix}"
        )
    if set(g.partial) != set(axes):
        if not g.partial:
            why = (
                "already summed over the ranks: 1-bit Adam would average it again (from "
                "freeze_step on, through its compressed momenta)"
            )
        else:
            why = (
                f"partial over {g.partial!r}, but onebit_adam(axis={axes!r}) averages over {axes!r}"
            )
        return (
            f"{what}: gradient {path!r} ({g.shape}, {g.layout!r}) is {why}. Pass gradients "
            f"partial over exactly {axes!r} ({fix}); sum any other partial axes first "
            f"(shardax.transfer(g, {want})), or name them all in axis="
        )
    ref_shape = ref.shape if isinstance(ref, Sharded) else tuple(ref.shape)
    if g.shape != ref_shape:
        return (
            f"{what}: gradient {path!r} has global shape {g.shape}; its param has {ref_shape}. "
            "Pass the gradients of the params the optimizer was initialized on"
        )
    ref_spec = ref.layout.sharding if isinstance(ref, Sharded) else None
    if ref_spec is not None and g.layout.sharding != ref_spec:
        return (
            f"{what}: gradient {path!r} is laid out {g.layout.spec!r}, its param's state "
            f"{ref.layout.spec!r} on {ref.mesh!r}; relay it first (shardax.transfer(g, "
            f"Layout(mesh, {ref.layout.spec!r}, partial={axes!r})))"
        )
    if ref_spec is None and g.layout.spec.axes:
        return (
            f"{what}: gradient {path!r} is split {g.layout.spec!r}, but its param is a whole "
            "tensor; init the optimizer on Sharded params laid out like the gradients"
        )
    return None


def _checked(grads: Any, mu: Any, axes: tuple[str, ...], what: str) -> tuple[list, list, Any]:
    """``(grads, momenta, treespec)`` flat, each gradient checked against its
    momentum (:func:`_grad_error`)."""
    paths, gs, spec = flatten_with_paths(grads, is_leaf=is_sharded)
    mus, mu_spec = flatten(mu, "state.mu")
    if spec != mu_spec:
        raise structure_error(grads, mu, "grads", "the params")
    for path, g, m in zip(paths, gs, mus, strict=True):
        err = _grad_error(path, g, m, axes, what)
        if err is not None:
            raise ShardingError(err)
    return gs, mus, spec


def _settings(
    b1: float, b2: float, eps: float, freeze_step: int, axis: Axis
) -> tuple[float, float, float, tuple[str, ...]]:
    """The settings both optimizers share, checked."""
    b1, b2, eps = validate("b1", b1, high=1.0), validate("b2", b2, high=1.0), validate("eps", eps)
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(
            f"freeze_step must be an int >= 1 (the warm-up steps, after which the variance "
            f"freezes and the momenta go 1-bit); got {freeze_step!r}"
        )
    axes = normalize_axes(axis)
    if not axes:
        raise ValueError("axis names the data-parallel mesh axis (or axes) to average over")
    return b1, b2, eps, axes


def _psum_flat(tensors: list[torch.Tensor], meshes: list[Mesh], axes: tuple[str, ...]) -> list:
    """Each tensor summed over ``axes`` in full precision: one all-reduce per
    mesh, dtype and device, of the tensors packed flat (as DDP's buckets)."""
    groups: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    for i, (t, mesh) in enumerate(zip(tensors, meshes, strict=True)):
        groups.setdefault((id(mesh), t.dtype, t.device), []).append(i)
    out: list[Any] = [None] * len(tensors)
    for idx in groups.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        psum(flat, axes, mesh=meshes[idx[0]], out=flat)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = piece.view(tensors[i].shape)
    return out


def scale_by_onebit_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    freeze_step: int,
    axis: Axis = "dp",
    bias_correction: bool = True,
    momentum_mask: Any = None,
    max_grad_norm: float | None = None,
) -> GradientTransformation:
    """1-bit Adam's direction (Tang et al. 2021), before weight decay and the
    learning rate; see :func:`onebit_adam`. Takes gradients partial over
    ``axis``; returns updates in the params' layout (replicated over it).

    >>> import torch, shardax as sx
    >>> from shardax.optim._onebit import scale_by_onebit_adam
    >>> mesh = sx.Mesh({"dp": 1})
    >>> opt = scale_by_onebit_adam(freeze_step=1)
    >>> state = opt.init(sx.shard(torch.zeros(2), mesh, sx.P()))
    >>> g = sx.Sharded(torch.tensor([2.0, -3.0]), sx.Layout(mesh, sx.P(), partial="dp"), (2,))
    >>> u, state = opt.update(g, state)
    >>> u.local.round(decimals=4)          # Adam's first step: sign(g)
    tensor([ 1., -1.])
    """
    b1, b2, eps, axes = _settings(b1, b2, eps, freeze_step, axis)
    if max_grad_norm is not None:
        max_grad_norm = validate("max_grad_norm", max_grad_norm, low_open=True)
    if not isinstance(bias_correction, bool):
        raise TypeError(f"bias_correction must be a bool; got {bias_correction!r}")
    what = "onebit_adam"

    def init(params: Any) -> OnebitAdamState:
        _check_state_layout(params, axes, what)
        leaves, spec = flatten(params, "params")
        mu = optree.tree_unflatten(spec, [zeros_like_state(x, torch.float32) for x in leaves])
        nu = optree.tree_unflatten(spec, [zeros_like_state(x, torch.float32) for x in leaves])
        return OnebitAdamState(new_count(), mu, nu, _empty_errors(params), _empty_errors(params),
                               owner_stamp(params))  # fmt: skip

    def update(grads: Any, state: OnebitAdamState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, OnebitAdamState, what=what)
        gs, mus, spec = _checked(grads, state.mu, axes, what)
        nus = [local(x) for x in flatten(state.nu, "state.nu")[0]]
        workers = flatten(state.worker_error, "state.worker_error")[0]
        servers = flatten(state.server_error, "state.server_error")[0]
        stamp = owner_stamp(grads)
        if not mine(state.owner, stamp):  # another rank's errors (a restored checkpoint)
            workers = servers = [torch.zeros(0, device=w.device) for w in workers]
        meshes = [g.mesh for g in gs]
        t = int(state.count) + 1
        mu_l = [local(m) for m in mus]
        masks = _masks(momentum_mask, grads, mus, what)
        if t <= freeze_step:  # Adam on the gradient averaged in full precision
            g = [x.to(torch.float32) for x in _psum_flat([g.local for g in gs], meshes, axes)]
            g = _clipped(g, mus, max_grad_norm)
            mu_l = [m.lerp(x, 1.0 - b1) for m, x in zip(mu_l, g, strict=True)]
            nus = [v.mul(b2).addcmul_(x, x, value=1.0 - b2) for v, x in zip(nus, g, strict=True)]
        else:  # v frozen; each rank's own momentum, averaged in 1 bit
            own = _clipped(own_gradients(gs, axes), mus, max_grad_norm)
            mu_l, workers, servers = _compressed(mu_l, own, gs, workers, servers, axes, b1)
            for m, keep in zip(mu_l, masks, strict=True):
                if keep is not None:
                    m.mul_(keep)
        bc1 = 1.0 - b1**t if bias_correction else 1.0
        bc2 = 1.0 - b2 ** min(t, freeze_step) if bias_correction else 1.0
        u = [
            m.div(v.sqrt().div_(math.sqrt(bc2)).add_(eps)).div_(bc1)
            for m, v in zip(mu_l, nus, strict=True)
        ]

        new = OnebitAdamState(
            state.count + 1,
            _build(spec, mu_l, mus),
            _build(spec, nus, mus),
            optree.tree_unflatten(spec, workers),
            optree.tree_unflatten(spec, servers),
            stamp,
        )
        return _build(spec, u, mus), new

    return transformation(init, update)


def _clipped(tensors: list[torch.Tensor], like: list, max_norm: float | None) -> list:
    """``tensors`` (local pieces laid out as their partners in ``like``)
    scaled by ``min(1, max_norm / (norm + 1e-6))``, their global norm's
    (``torch.nn.utils.clip_grad_norm_``'s factor); as they are without
    ``max_norm``."""
    if max_norm is None or not tensors:
        return tensors
    wrapped = [
        r.with_local(t) if isinstance(r, Sharded) else t for r, t in zip(like, tensors, strict=True)
    ]
    coef = torch.clamp(max_norm / (global_norm(wrapped) + 1e-6), max=1.0)
    return [t * coef.to(t.device) for t in tensors]


def _build(spec: Any, tensors: list[torch.Tensor], like: list) -> Any:
    """A tree of ``spec`` around ``tensors``, each Sharded where its partner
    in ``like`` is (in its layout)."""
    out = [
        r.with_local(x) if isinstance(r, Sharded) else x for r, x in zip(like, tensors, strict=True)
    ]
    return optree.tree_unflatten(spec, out)


def _masks(mask: Any, grads: Any, mus: list, what: str) -> list:
    """The local piece of ``mask``'s leaf for each gradient that is not None
    (None where the mask has none)."""
    if mask is None:
        return [None] * len(mus)
    grad_paths, grad_leaves, grad_spec = flatten_with_paths(
        grads, is_leaf=is_sharded, none_is_leaf=True
    )
    masks, mask_spec = optree.tree_flatten(mask, is_leaf=is_sharded, none_is_leaf=True)
    if mask_spec != grad_spec:
        raise structure_error(mask, grads, "momentum_mask", "the params")
    out = []
    for path, g, keep in zip(grad_paths, grad_leaves, masks, strict=True):
        if g is None:
            continue
        m = mus[len(out)]
        if keep is None:
            out.append(None)
            continue
        shape = m.shape if isinstance(m, Sharded) else tuple(m.shape)
        if not isinstance(keep, torch.Tensor | Sharded) or tuple(keep.shape) != tuple(shape):
            got = tuple(keep.shape) if isinstance(keep, torch.Tensor | Sharded) else keep
            raise ShardingError(
                f"{what}: momentum_mask {path!r} is {got!r}; it must be a tensor of the "
                f"param's shape {shape} (1 where the momentum is kept, 0 where the gradient is "
                "always zero), or None"
            )
        if isinstance(keep, Sharded):
            if not isinstance(m, Sharded) or keep.layout.sharding != m.layout.sharding:
                raise ShardingError(
                    f"{what}: momentum_mask {path!r} is laid out {keep.layout!r}; give it as a "
                    "whole tensor, or laid out like its param"
                )
            keep = keep.local
        elif isinstance(m, Sharded):
            keep = local_piece(keep, m.layout, m.mesh.rank)
        out.append(keep.to(device=local(m).device, dtype=torch.float32))
    return out


def own_gradients(grads: list[Sharded], axes: tuple[str, ...]) -> list[torch.Tensor]:
    """Each rank's own gradient (fp32): its contribution times the ranks of
    ``axes`` — the gradient of its own micro-batch."""
    return [g.local.to(torch.float32) * g.mesh.group(axes).size for g in grads]


def _compressed(
    mu: list[torch.Tensor],
    own: list[torch.Tensor],
    grads: list[Sharded],
    workers: list[torch.Tensor],
    servers: list[torch.Tensor],
    axes: tuple[str, ...],
    b1: float,
) -> tuple[list, list, list]:
    """The momenta after a compressed step: each rank's ``b1 m + (1 - b1) g_i``
    with its own gradient ``g_i`` (``own``: ``world`` times its contribution),
    averaged by :func:`compressed_mean`, and the new errors."""
    mine = [m.lerp(x, 1.0 - b1) for m, x in zip(mu, own, strict=True)]
    return compressed_mean(mine, [g.mesh for g in grads], workers, servers, axes)


def compressed_mean(
    tensors: list[torch.Tensor],
    meshes: list[Mesh],
    workers: list[torch.Tensor],
    servers: list[torch.Tensor],
    axes: tuple[str, ...],
) -> tuple[list, list, list]:
    """``(means, workers, servers)``: each rank's ``tensors`` averaged over
    ``axes`` by ``onebit_pmean_many`` — all the leaves on one mesh in one
    all-to-all and one all-gather, each with its own scales and errors
    (empty errors start at zero) — and the new errors."""
    workers, servers = list(workers), list(servers)
    groups: dict[int, list[int]] = {}
    for i, (t, mesh) in enumerate(zip(tensors, meshes, strict=True)):
        if workers[i].numel() == 0 and t.numel() > 0:  # the first compressed step
            workers[i], servers[i] = onebit_errors(t, axes, mesh=mesh)
        groups.setdefault(id(mesh), []).append(i)
    means: list[Any] = [None] * len(tensors)
    for idx in groups.values():
        out, ws, ss = onebit_pmean_many(
            [tensors[i] for i in idx],
            [workers[i] for i in idx],
            [servers[i] for i in idx],
            axes,
            mesh=meshes[idx[0]],
        )
        for i, m, w, s in zip(idx, out, ws, ss, strict=True):
            means[i], workers[i], servers[i] = m, w, s
    return means, workers, servers


def onebit_adam(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    freeze_step: int,
    axis: Axis = "dp",
    bias_correction: bool = True,
    momentum_mask: Any = None,
    max_grad_norm: float | None = None,
) -> GradientTransformation:
    """1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient
    Large-Scale Training with Adam's Convergence Speed"), as DeepSpeed's
    ``OnebitAdam``: Adam's convergence with about 1/32 of the data-parallel
    traffic once warmed up.

    - Steps ``1 .. freeze_step`` (the warm-up): the gradient averaged over
      ``axis`` in full precision (one all-reduce of all gradients packed
      flat), then Adam — the same numbers as ``torch.optim.AdamW``.
    - From step ``freeze_step + 1`` on: the variance ``nu`` is frozen; each
      rank updates the momentum with its *own* gradient, and the momenta are
      averaged by :func:`~shardax.collectives._onebit.onebit_pmean` — signs
      and one scale per tensor, with error feedback (the errors live in the
      state, one pair per leaf), all the leaves in one all-to-all and one
      all-gather — so every rank holds the same momentum and applies the
      same update. Nothing else travels.

    The update is ``-lr * (m̂ / (sqrt(v̂) + eps) + weight_decay * p)``:
    decoupled weight decay, as DeepSpeed applies it. With
    ``bias_correction`` (torch's Adam), ``m̂ = m / (1 - b1**t)`` and
    ``v̂ = v / (1 - b2**min(t, freeze_step))`` — the frozen variance keeps the
    correction of its last update. DeepSpeed's ``OnebitAdam`` corrects
    neither (it ignores its ``bias_correction`` flag): ``bias_correction=False``
    is its arithmetic. Unlike DeepSpeed, the first step updates the params
    (DeepSpeed's first ``step()`` only initializes its buffers), and the
    moments are fp32 whatever the params' dtype.

    **Gradients.** 1-bit Adam does the data-parallel averaging itself, so it
    takes each rank's own contribution, un-summed: a Sharded leaf partial
    over exactly ``axis`` (``Layout(mesh, P(), partial=("dp",))`` for a
    replicated param) — the sum over the ranks is the global batch's
    gradient, as :func:`shardax.value_and_grad` seeds backward with
    ``1 / world``. A plain tensor, a gradient already summed, or one partial
    over other axes is refused (:class:`~shardax.errors.ShardingError`
    naming its key path), never averaged twice or not at all. The params may
    be split over other axes (tensor parallelism); not over ``axis`` (ZeRO
    shards the momentum there, which 1-bit Adam averages whole).

    **Updates** are in the params' layouts (replicated over ``axis``); a
    leaf whose gradient is None keeps its value and state. The error buffers
    are this rank's: a checkpoint may drop them (DeepSpeed resets them when
    it loads one).

    Args:
        learning_rate: a number or a schedule (step -> value).
        b1, b2, eps: Adam's.
        weight_decay: decoupled weight decay (AdamW's).
        freeze_step: Adam warm-up steps before the variance freezes and the
            momenta go 1-bit (DeepSpeed suggests 15–25% of training).
        axis: the data-parallel mesh axis, or a tuple of axes, the gradients
            are partial over.
        bias_correction: Adam's bias correction (False: DeepSpeed's numbers).
        momentum_mask: DeepSpeed's ``exp_avg_mask``: a tree like the params
            (None at leaves without one) of tensors of each param's global
            shape, or Sharded laid out like it, multiplied into the averaged
            momentum after every compressed step. One bit cannot say zero: a
            momentum whose gradient is always zero (embedding rows past the
            sequence length trained on) is sent as ``±scale`` and, over a
            variance that froze at zero, moves its param by ``lr * scale /
            eps``; a 0 there keeps it still.
        max_grad_norm: clip the gradient, as DeepSpeed's ``gradient_clipping``
            does with 1-bit Adam: during the warm-up the averaged gradient
            by its global norm; from the freeze on, each rank's own gradient
            by its own norm (DeepSpeed's engine no longer averages them).
            ``optax``-style ``clip_by_global_norm`` cannot take the partial
            gradients (their norm is not defined until they are summed).

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> opt = sx.optim.onebit_adam(0.1, freeze_step=2)
    >>> params = {"w": sx.shard(torch.ones(3), mesh, sx.P())}
    >>> state = opt.init(params)
    >>> for g in ([1.0, -1.0, 2.0], [2.0, -1.0, 1.0], [1.0, 1.0, 1.0]):
    ...     grad = sx.Sharded(torch.tensor(g), sx.Layout(mesh, sx.P(), partial="dp"), (3,))
    ...     updates, state = opt.update({"w": grad}, state, params)
    ...     params = sx.optim.apply_updates(params, updates)
    >>> params["w"].local       # one rank: the third step's momentum goes exact
    tensor([0.7192, 1.2262, 0.7246])
    """
    core = scale_by_onebit_adam(b1, b2, eps, freeze_step=freeze_step, axis=axis,
                                bias_correction=bias_correction, momentum_mask=momentum_mask,
                                max_grad_norm=max_grad_norm)  # fmt: skip
    decay = [add_decayed_weights(weight_decay, _owned=True)] if weight_decay else []
    return chain(core, *decay, scale_by_learning_rate(learning_rate, _owned=True))
