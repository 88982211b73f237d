"""Taking a step, the two ways: :func:`step` (``update`` then
``apply_updates``: pure, new trees) and :func:`fused_step` (the one
stepper that writes the params and the state in place: in one native pass
where the transformation names its kernel, a ``Fusible``, and the kernels
cover the call; else ``update`` and ``apply_updates(donate=True)``). Both
leave a leaf whose gradient is None as it is, with its state (the rule of
``_gradless``, which the fused path follows too).

The fused path is chosen from what every rank sees alike — dtypes, devices,
layouts, the structure of the state, the step's learning rate — never from
values, and before anything is written, so ranks never take different paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import optree
import torch

from ..shard._memory import allocate, is_disk, kind_of, release
from ..shard._sharded import Sharded
from ..shard._transfer import transfer
from ._base import (
    ChainFusion,
    Flat,
    Fusible,
    GradientTransformation,
    Kernel,
    MasterFusion,
    apply_updates,
    is_sharded,
    local,
    read_steps,
)
from ._gradless import gradless
from ._native import ALGORITHMS, GRADS, SHADOWS, Native, native, on_disk, stream
from ._precision import MasterWeightsState
from ._transforms import ScaleByScheduleState

__all__ = ["FusedStep", "fused_step", "step"]

_F32 = (torch.float32,)
_LOW = tuple(SHADOWS)

Tree = Any
Stepped = tuple[Any, Any]  # (params, state)


def step(
    optimizer: GradientTransformation,
    grads: Tree,
    state: Tree,
    params: Tree,
    *,
    donate: bool = False,
) -> Stepped:
    """One optimizer step: ``update`` then :func:`apply_updates`, returning
    ``(new_params, new_state)``. Pure: the params, gradients and state
    passed in keep their values — unless ``donate``, which is
    :func:`apply_updates`' (the new params written into the params'
    buffers). To write the params *and* the state in place, in one native
    pass where the kernels cover the optimizer, use :func:`fused_step`.

    A leaf whose gradient is None — a buffer, a parameter no gradient
    reached (:func:`shardax.value_and_grad` gives None there, as PyTorch
    leaves ``p.grad`` None) — is left as it is, with its optimizer state:
    no weight decay, no momentum, its own step count unchanged, as
    ``torch.optim`` skips it (``update`` and :func:`apply_updates` follow
    the same rule; a schedule's step still advances).

    Args:
        optimizer: a :class:`GradientTransformation`.
        grads: the gradients (a tree like ``params``, None where there is none).
        state: the optimizer state (what ``init`` or the last step returned).
        params: the params, a pytree of tensors or Sharded values.
        donate: write the new params into the params' buffers.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.adamw(0.1, weight_decay=0.0)
    >>> params = {"w": torch.zeros(3), "frozen": torch.ones(1)}
    >>> state = opt.init(params)
    >>> grads = {"w": torch.tensor([1.0, -2.0, 0.0]), "frozen": None}
    >>> new, state = optim.step(opt, grads, state, params)
    >>> new["w"], new["frozen"], params["w"]
    (tensor([-0.1000,  0.1000,  0.0000]), tensor([1.]), tensor([0., 0., 0.]))
    """
    updates, new_state = optimizer.update(grads, state, params)
    new_params = apply_updates(params, updates, donate=donate)
    return keep_memory(params, new_params, donate), keep_memory(state, new_state, donate)


def keep_memory(old: Tree, new: Tree, donate: bool) -> Tree:
    """``new`` (params or a state, stepped) with each leaf whose old value
    lived on disk (``rules.offload``) on disk again: written into the old
    file (``donate``) or a new one — and handed back to its file (also
    where the step wrote the old one in place)."""
    old_leaves, spec = optree.tree_flatten(old, is_leaf=is_sharded, none_is_leaf=True)
    if not any(
        is_disk(local(x)) for x in old_leaves if is_sharded(x) or isinstance(x, torch.Tensor)
    ):
        return new
    new_leaves, new_spec = optree.tree_flatten(new, is_leaf=is_sharded, none_is_leaf=True)
    if new_spec != spec:
        return new
    out = []
    for o, n in zip(old_leaves, new_leaves, strict=True):
        was = local(o) if is_sharded(o) or isinstance(o, torch.Tensor) else None
        now = local(n) if is_sharded(n) or isinstance(n, torch.Tensor) else None
        if was is not None and now is was and is_disk(was):
            release(was)  # written in place: out of the process
        if was is None or now is None or now is was or not is_disk(was) or is_disk(now):
            out.append(n)
            continue
        home = was if donate else allocate(now.shape, now.dtype, kind_of(was))
        home.copy_(now)
        release(home)
        out.append(n.with_local(home) if is_sharded(n) else home)
    return optree.tree_unflatten(spec, out)


def _a_transformation(_: Any, __: Any, value: Any) -> None:
    if not isinstance(value, GradientTransformation):
        raise TypeError(
            "fused_step takes a GradientTransformation (optim.adamw(...), optim.chain(...), "
            f"optim.with_master_weights(...)); got a {type(value).__name__}"
        )


@attrs.frozen
class FusedStep:
    """An optimizer's step that **donates**: :meth:`step` writes the new
    params into the params' buffers and the new state into the state's,
    and returns them — the trees passed in are consumed (do not keep them
    as the old values). Build it with :func:`fused_step`.

    Where the optimizer describes its kernel (a ``Fusible``: ``adamw``,
    ``adam``, ``lion``, ``adagrad``, ``rmsprop``, a ``chain`` ending in one,
    ``with_master_weights`` around one) and the call is one the native
    kernels cover — CPU params and state in fp32 (or bf16/fp16 params with
    fp32 master weights), gradients fp32, bf16 or fp16 (fp32 where the
    weight decay goes into the gradient: Adam's L2, Adagrad, RMSprop) — one
    native call steps every leaf, reading each element once and writing the
    param where it is, as ``torch.optim``'s ``fused=True`` does: the
    buffers returned are the buffers given. Params laid out unlike the
    state (ZeRO-1/2) are written from the stepped state, gathered. Anything
    else — other optimizers, dtypes or devices, no compiler,
    ``SHARDAX_NO_NATIVE=1`` — runs ``update`` and ``apply_updates(...,
    donate=True)``, with the same results (to about an ulp: the kernels
    round as the reference does, but for torch's vectorised ``sqrt``).

    Leaves whose gradient is None are left as they are, with their state,
    as by :func:`step`.

    Attributes:
        transformation: the optimizer.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.with_master_weights(optim.adamw(1e-2))
    >>> params = {"w": torch.ones(4, dtype=torch.bfloat16)}
    >>> state = opt.init(params)
    >>> stepper = optim.FusedStep(opt)
    >>> for _ in range(3):   # bf16 params written from the fp32 master copy
    ...     params, state = stepper.step(params, {"w": torch.ones(4, dtype=torch.bfloat16)}, state)
    >>> params["w"], state.master["w"]
    (tensor([0.9688, 0.9688, 0.9688, 0.9688], dtype=torch.bfloat16), tensor([0.9697, 0.9697, 0.9697, 0.9697]))
    """

    transformation: GradientTransformation = attrs.field(validator=_a_transformation)

    def step(self, params: Tree, grads: Tree, state: Tree) -> Stepped:
        """Step ``params`` and ``state`` by ``grads``, in place: returns
        ``(params, state)``, to use instead of the trees passed in.

        Args:
            params: the params, a pytree of tensors or Sharded values (donated).
            grads: the gradients, a tree like ``params`` (None where there is none).
            state: the optimizer state (donated).
        """
        tx = self.transformation
        with torch.no_grad():
            done = None
            if isinstance(tx, Fusible) and (lib := native()) is not None:
                done = _fused(lib, tx, grads, state, params)
            if done is None:
                updates, new_state = tx.update(grads, state, params)
                done = apply_updates(params, updates, donate=True), new_state
            return keep_memory(params, done[0], True), keep_memory(state, done[1], True)


def fused_step(transformation: GradientTransformation) -> FusedStep:
    """The donating step of ``transformation``: a :class:`FusedStep`, whose
    ``step(params, grads, state) -> (params, state)`` writes the params and
    the state in place — in one native pass where the kernels cover the
    optimizer.

    Args:
        transformation: the optimizer (any :class:`GradientTransformation`).

    Raises:
        TypeError: ``transformation`` is not a GradientTransformation.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1, weight_decay=0.0))
    >>> stepper = optim.fused_step(opt)
    >>> params = {"w": torch.zeros(3)}
    >>> state = opt.init(params)
    >>> w = params["w"]
    >>> params, state = stepper.step(params, {"w": torch.tensor([1.0, -2.0, 0.0])}, state)
    >>> params["w"], params["w"] is w      # written in place
    (tensor([-0.1000,  0.1000,  0.0000]), True)
    """
    return FusedStep(transformation)


# -- the fused path: one function per kind of Fusion ------------------------------------


def _fused(
    lib: Native,
    tx: Fusible,
    grads: Tree,
    state: Tree,
    params: Tree,
    shadows: list[torch.Tensor] | None = None,
    widened: bool = False,
) -> Stepped | None:
    """``tx``'s step in place, ``shadows`` (low-precision copies of the
    params' locals, when given) written too; None where the kernels do not
    cover the call — and then nothing has been written. ``widened``: the
    reference widens the gradients to fp32 first (master weights), so any
    dtype the kernels read gives its results."""
    fusion = tx.fusion
    if isinstance(fusion, Kernel):
        return _kernel_step(lib, fusion, grads, state, params, shadows, widened)
    if isinstance(fusion, ChainFusion):
        return _chain_step(lib, fusion, grads, state, params, shadows)
    return _master_step(lib, fusion, grads, state, params, shadows)


def _chain_step(
    lib: Native, fusion: ChainFusion, grads: Tree, state: Tree, params: Tree,
    shadows: list[torch.Tensor] | None,
) -> Stepped | None:  # fmt: skip
    """The head's updates, then the last transformation's fused step — or,
    where the kernels do not cover it, its update and ``apply_updates``."""
    if not (isinstance(state, tuple) and len(state) == fusion.length):
        return None  # the chain's update names what it expects
    grads, head_state = fusion.head.update(grads, state[:-1], params)
    done = _fused(lib, fusion.last, grads, state[-1], params, shadows)
    if done is None:
        updates, last_state = fusion.last.update(grads, state[-1], params)
        new_params = apply_updates(params, updates, donate=True)
        if shadows is not None:
            for shadow, x in zip(shadows, Flat(new_params, "params").locals, strict=True):
                shadow.copy_(x)
        done = new_params, last_state
    return done[0], (*head_state, done[1])


def _master_step(
    lib: Native, fusion: MasterFusion, grads: Tree, state: Tree, params: Tree,
    shadows: list[torch.Tensor] | None,
) -> Stepped | None:  # fmt: skip
    """The inner fused step on the fp32 master copy, the bf16/fp16 params
    written from it, rounded: in the same pass where they are laid out like
    the copy, else (ZeRO-1/2) after it, gathered."""
    if shadows is not None or fusion.dtype != torch.float32:
        return None
    if not isinstance(state, MasterWeightsState):
        return None
    found = gradless(grads)  # leaves without a gradient: out of the master copy and the params
    copy = state.master if found is None else found.cut(state.master)
    leaves, spec = optree.tree_flatten(params if found is None else found.cut(params))
    master = Flat(copy, "state.master")
    if spec != master.spec or not _covered(leaves, _LOW):
        return None
    direct = isinstance(fusion.inner.fusion, Kernel)
    if not direct:  # the inner transformations see fp32 gradients, as update gives them
        grads = master.build([g.to(torch.float32) for g in master.align(grads, "updates")])
    if _laid_out_like(leaves, master.leaves):
        given = [local(x) for x in leaves]
        targets = [x if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype) for x in given]
        done = _fused(lib, fusion.inner, grads, state.inner_state, copy, targets, direct)
        if done is None:
            return None
        for x, t in zip(given, targets, strict=True):
            if t is not x:
                x.copy_(t)
        return params, MasterWeightsState(state.master, done[1])  # written in place
    if not all(isinstance(x, Sharded) for x in (*leaves, *master.leaves)):
        return None  # plain tensors of other shapes, or Sharded meeting dense: update names them
    done = _fused(lib, fusion.inner, grads, state.inner_state, copy, None, direct)
    if done is None:
        return None
    for p, m in zip(leaves, Flat(done[0], "master").leaves, strict=True):
        rounded = m.with_local(m.local.to(p.dtype))
        p.local.copy_(transfer(rounded, p.layout).local)
    return params, MasterWeightsState(state.master, done[1])


def _kernel_step(
    lib: Native, kernel: Kernel, grads: Tree, state: Tree, params: Tree,
    shadows: list[torch.Tensor] | None, widened: bool,
) -> Stepped | None:  # fmt: skip
    """One native call over every leaf with a gradient (one per distinct
    step count: one, but where some leaf missed steps): the core state's
    buffers and step counts advanced in place, and the params written where
    they are — or, laid out unlike the state (ZeRO-1/2), the updates
    written and applied. Leaves whose gradient is None are not read."""
    algorithm = ALGORITHMS[kernel.name]
    if not (isinstance(state, tuple) and len(state) == kernel.length):
        return None
    core, last = state[kernel.core], state[-1]
    if type(core) is not algorithm.state:
        return None
    found = gradless(grads)
    view = core if found is None else found.cut_state(core)  # the leaves with a gradient
    shared = [core.count] if algorithm.counts == "shared" else []
    if callable(kernel.lr):
        if type(last) is not ScaleByScheduleState:
            return None
        shared.append(last.count)
    if not all(isinstance(c, torch.Tensor) and c.numel() == 1 for c in shared):
        return None
    trees = algorithm.buffers(view)
    buffers = _buffers(trees)
    if buffers is None:
        return None
    ref, spec, locals_ = buffers
    counts: list[torch.Tensor] = []
    if algorithm.counts == "per leaf":
        counts, c_spec = optree.tree_flatten(view.count)
        if c_spec != spec:
            return None  # one count for every leaf (an older state): update makes it per leaf

    p_leaves, p_spec = optree.tree_flatten(params if found is None else found.cut(params))
    if p_spec != spec:
        return None
    given = _plain(p_leaves, ref, _F32)
    if given is None and not _covered(p_leaves, _F32):
        return None
    in_place = given is not None or _laid_out_like(p_leaves, ref)
    if shadows is not None and not (
        in_place and all(s.dtype in SHADOWS and s.is_contiguous() for s in shadows)
    ):
        return None
    g_leaves, g_spec = optree.tree_flatten(grads)
    decays_grads = algorithm.l2 and kernel.weight_decay and not widened
    g_types = _F32 if decays_grads else tuple(GRADS)
    if g_spec != spec:
        return None
    g = _plain(g_leaves, ref, g_types)
    if g is None and not _covered(g_leaves, g_types):
        return None
    rate = float(kernel.lr(int(shared[-1]))) if callable(kernel.lr) else kernel.lr
    if rate < 0:
        return None  # the reference raises the clear error

    # covered: from here on, every rank runs the kernel
    flat = Flat.of(trees[0], ref, spec, "state")
    if g is None:  # relaid (ZeRO-2's pending sums: a reduce-scatter), or strided
        g = [local(x).contiguous() for x in flat.align_flat(g_leaves, grads, "updates")]
    if in_place:
        given = [local(x) for x in p_leaves] if given is None else given
        p: list[torch.Tensor | None] = [x if x.is_contiguous() else x.contiguous() for x in given]
        out = p
    else:  # ZeRO-1/2: the params (for the decay) are a slice of the replicated ones
        aligned = flat.align_flat(p_leaves, params, "params")  # (and checked before any write)
        p = [local(x).contiguous() if kernel.weight_decay else None for x in aligned]
        out = [torch.empty(x.shape, dtype=torch.float32) for x in locals_[0]]
    s0, s1 = locals_[0], locals_[-1]
    lists = (s0, s1, g, p, out, shadows)
    steps = [t + 1 for t in read_steps(counts)] if kernel.bias_correction else []
    for t, idx in _by_value(steps):
        part = lists if idx is None else [None if x is None else [x[i] for i in idx] for x in lists]
        args = (algorithm.function, *part, in_place, algorithm.scalars(kernel, t, rate))
        if on_disk(*part[:5]):  # rules.offload: streamed in waves, read ahead
            stream(lib, *args)  # type: ignore[arg-type]
        else:
            lib.launch(*args)  # type: ignore[arg-type]
    if counts:
        torch._foreach_add_(counts, 1)
    for count in shared:
        count.add_(1)
    if not in_place:
        return apply_updates(params, flat.build(out), donate=True), state
    for x, y in zip(given, p, strict=True):
        if x is not y:  # a strided param took its result in a copy
            x.copy_(y)  # type: ignore[arg-type]
    return params, state


def _by_value(steps: list[int]) -> list[tuple[int, list[int] | None]]:
    """``(t, positions)`` for each distinct step ``t`` — positions None
    where it is every leaf's, or no step is read (one launch over the whole
    lists)."""
    if not steps or all(t == steps[0] for t in steps):
        return [(steps[0] if steps else 1, None)]
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(steps):
        groups.setdefault(t, []).append(i)
    return list(groups.items())


def _buffers(trees: Sequence[Tree]) -> tuple[list, Any, list[list]] | None:
    """The leaves of the first buffer tree (what params and gradients are
    laid out like), its treespec, and every tree's local tensors — None
    unless each is a contiguous fp32 CPU tensor and the trees share one
    structure."""
    ref, spec = optree.tree_flatten(trees[0])
    out = []
    for tree in trees:
        leaves, s = (ref, spec) if not out else optree.tree_flatten(tree)
        if s != spec:
            return None
        tensors = [x.local if isinstance(x, Sharded) else x for x in leaves]
        for x in tensors:
            if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
                return None
            if not (x.is_cpu and x.is_contiguous()):
                return None
        out.append(tensors)
    return ref, spec, out


def _covered(leaves: Sequence[Any], dtypes: tuple[torch.dtype, ...]) -> bool:
    """Every leaf is a tensor (or Sharded) on the CPU of one of ``dtypes``."""
    for x in leaves:
        t = x.local if isinstance(x, Sharded) else x
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or not t.is_cpu:
            return False
    return True


def _alike(x: Any, ref: Any) -> bool:
    """``x`` is laid out as ``ref``: equal layouts and shapes, or plain
    tensors of equal shapes."""
    if isinstance(ref, Sharded):
        if not isinstance(x, Sharded) or x.shape != ref.shape:
            return False
        return x.layout is ref.layout or x.layout == ref.layout
    return isinstance(x, torch.Tensor) and x.shape == ref.shape


def _laid_out_like(leaves: Sequence[Any], ref: Sequence[Any]) -> bool:
    """``leaves`` are laid out as ``ref``: a step writes them in the same
    pass as the state (no ZeRO, ZeRO-3; not ZeRO-1/2's replicated params)."""
    return all(_alike(x, r) for x, r in zip(leaves, ref, strict=True))


def _plain(
    leaves: Sequence[Any], ref: Sequence[Any], dtypes: tuple[torch.dtype, ...]
) -> list[torch.Tensor] | None:
    """The local tensors of ``leaves`` where each is already what the
    kernels read — a contiguous CPU tensor of one of ``dtypes``, laid out as
    ``ref`` (the common case, checked in one pass) — else None (the general
    checks follow: :func:`_covered`, :func:`_laid_out_like`)."""
    out = []
    for x, r in zip(leaves, ref, strict=True):
        if not _alike(x, r):
            return None
        t = x.local if isinstance(x, Sharded) else x
        if t.dtype not in dtypes or not t.is_cpu or not t.is_contiguous():
            return None
        out.append(t)
    return out
