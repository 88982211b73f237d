"""Optimizers whose update runs as one native pass when it can, and whose
step (:func:`shardax.optim.step`: update and apply in one) does too.

The state and the results are the reference chain's; anything the kernels
do not cover (other dtypes or devices, params laid out unlike the state —
ZeRO-1/2 —, no compiler, ``SHARDAX_NO_NATIVE``) runs the reference itself.
Every decision is taken before any collective or any write, from what all
ranks see alike (dtypes, devices, layouts, the step's rate), so ranks never
take different paths.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..shard._sharded import Sharded
from ._base import Flat, GradientTransformation, transformation
from ._transforms import (
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByRmsState,
    ScaleByRssState,
    ScaleByScheduleState,
)

__all__ = ["fused_adagrad", "fused_adamw", "fused_lion", "fused_rmsprop"]

_GRADS = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}  # the kernels' dtype codes
_SHADOWS = {torch.float16: 2, torch.bfloat16: 3}
_IO = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
       ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]  # fmt: skip
_SCALARS = {"sx_adamw": 8, "sx_adam_l2": 8, "sx_lion": 4, "sx_adagrad": 3, "sx_rmsprop": 5}


def _lib() -> Any:
    if os.environ.get("SHARDAX_NO_NATIVE"):
        return None
    from ..kernels import OPTIM

    lib = OPTIM.load()
    if lib is not None and not getattr(lib, "_shardax_typed", False):
        for name, scalars in _SCALARS.items():
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p] * 2 + _IO + [ctypes.c_double] * scalars  # 2 state
            fn.restype = ctypes.c_int
        lib.sx_threads.argtypes = [ctypes.c_int]
        lib.sx_threads.restype = None
        lib._shardax_typed = True
    return lib


def _tensors(tree: Any) -> list[Any]:
    leaves = optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Sharded))
    return [x for x in leaves if isinstance(x, (torch.Tensor, Sharded))]


def _on_cpu(tree: Any, dtypes: Any) -> bool:
    """Every tensor leaf (Sharded or not) of ``tree`` is on the CPU with a
    dtype in ``dtypes`` — the same answer on every rank."""
    tensors = _tensors(tree)
    return bool(tensors) and all(x.dtype in dtypes and x.device.type == "cpu" for x in tensors)


def _laid_out_like(tree: Any, ref: Flat) -> bool:
    """``tree``'s leaves are laid out as ``ref``'s (same structure, equal
    layouts or plain tensors of equal shape): a step can write them in the
    same pass as the state (ZeRO-3, no ZeRO; not ZeRO-1/2's replicated params)."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Sharded))
    if spec != ref.spec:
        return False
    for x, r in zip(leaves, ref.leaves, strict=True):
        if isinstance(r, Sharded):
            if not (isinstance(x, Sharded) and x.layout == r.layout and x.shape == r.shape):
                return False
        elif isinstance(x, Sharded) or x.shape != r.shape:
            return False
    return True


def _rate(lr: Any, sched: Any) -> tuple[float, Any] | None:
    """This step's learning rate and the schedule state after it, or None
    when the reference must run (a negative rate: it raises the clear error)."""
    if callable(lr):
        if not isinstance(sched, ScaleByScheduleState):
            return None
        rate = float(lr(int(sched.count)))
        return None if rate < 0 else (rate, ScaleByScheduleState(sched.count + 1))
    return float(lr), sched


class _Pass:
    """One fused pass per leaf: where the gradient, the param and the result
    are. ``step``: the result is the new param (written into the param's own
    buffer with ``donate``) and ``shadows`` (if given) receive it rounded to
    their low precision; otherwise the result is the update."""

    def __init__(
        self,
        flat: Flat,
        updates: Any,
        params: Any,
        *,
        step: bool,
        donate: bool,
        decay: bool,
        shadows: Sequence[torch.Tensor] | None,
    ) -> None:
        n = len(flat)
        self.flat, self.step = flat, step
        self.g = [x.contiguous() for x in flat.align(updates, "updates")]
        self.given = flat.align(params, "params") if step or decay else []
        self.p: list[torch.Tensor | None] = (
            [x.contiguous() for x in self.given] if step or decay else [None] * n
        )
        if step:
            self.out = [
                p if donate and p.data_ptr() == q.data_ptr() else torch.empty_like(p)
                for p, q in zip(self.p, self.given, strict=True)  # type: ignore[arg-type]
            ]
        else:
            self.out = [torch.empty(x.shape, dtype=torch.float32) for x in flat.locals]
        self.donate = donate
        self.shadows = list(shadows) if shadows is not None else None
        _lib().sx_threads(torch.get_num_threads())  # as many threads as torch's ops use

    def args(self, i: int) -> tuple[Any, ...]:
        g, p, out = self.g[i], self.p[i], self.out[i]
        shadow = self.shadows[i] if self.shadows is not None else None
        return (
            g.data_ptr(), _GRADS[g.dtype], None if p is None else p.data_ptr(), out.data_ptr(),
            int(self.step), None if shadow is None else shadow.data_ptr(),
            0 if shadow is None else _SHADOWS[shadow.dtype], out.numel(),
        )  # fmt: skip

    def result(self, params: Any) -> Any:
        """The updates (a tree like the state), or the new params (like ``params``)."""
        if not self.step:
            return self.flat.build(self.out)
        if self.donate:  # a non-contiguous param took its result in a copy
            for given, out in zip(self.given, self.out, strict=True):
                if given.data_ptr() != out.data_ptr():
                    given.copy_(out)
            self.out = list(self.given)
        return Flat(params, "params").build(self.out)


Native = Callable[..., "tuple[Any, Any] | None"]


def _with_step(reference: GradientTransformation, native: Native) -> GradientTransformation:
    """``reference``, whose update tries ``native`` first (None: not
    covered), with a fused ``step`` of the same kernel."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        done = native(updates, state, params, step=False, donate=False, shadows=None)
        return done if done is not None else reference.update(updates, state, params)

    def step(
        updates: Any,
        state: Any,
        params: Any,
        donate: bool = False,
        shadows: Sequence[torch.Tensor] | None = None,
    ) -> tuple[Any, Any] | None:
        with torch.no_grad():
            return native(updates, state, params, step=True, donate=donate, shadows=shadows)

    step.reads_low_precision_grads = True  # type: ignore[attr-defined]  # see with_master_weights
    return transformation(reference.init, update)._replace(step=step)


def _parts(state: Any, core: type, length: int) -> tuple[Any, Any] | None:
    """The core transform's state and the schedule's, from a chain state
    ``(…, core, …, schedule)`` of ``length`` with ``core`` at index ``length - 2``
    or 0."""
    if not (isinstance(state, tuple) and len(state) == length):
        return None
    cores = [s for s in state[:-1] if isinstance(s, core)]
    return (cores[0], state[-1]) if len(cores) == 1 else None


def _prepare(
    updates: Any,
    params: Any,
    state_trees: Sequence[Any],
    *,
    step: bool,
    decay: bool,
    shadows: Sequence[torch.Tensor] | None,
    flat: Flat,
    grads: tuple[torch.dtype, ...] = tuple(_GRADS),
) -> bool:
    """Whether the kernels cover this call (decided alike on every rank)."""
    if not all(_on_cpu(t, (torch.float32,)) for t in state_trees):
        return False
    if not _on_cpu(updates, grads):
        return False
    if (step or decay) and not (params is not None and _on_cpu(params, (torch.float32,))):
        return False
    if step and not _laid_out_like(params, flat):
        return False
    if shadows is not None and not all(s.dtype in _SHADOWS and s.is_contiguous() for s in shadows):
        return False
    return _lib() is not None


def _state_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.is_contiguous() for t in tensors)


def _call(name: str, *args: Any) -> None:
    code = getattr(_lib(), name)(*args)
    if code != 0:  # the dtype tables and the kernel disagree: never return garbage
        raise RuntimeError(f"the native {name} kernel refused its arguments ({code})")


def fused_adamw(
    reference: GradientTransformation,
    lr: Any,
    b1: float,
    b2: float,
    eps: float,
    wd: float,
    *,
    l2: bool = False,
) -> GradientTransformation:
    """``reference`` (adamw's chain: scale_by_adam, add_decayed_weights,
    scale_by_learning_rate — or with ``l2``, adam's: add_decayed_weights
    when ``wd``, scale_by_adam, scale_by_learning_rate), run by the native
    kernel when every leaf is a CPU tensor: fp32 params and state,
    fp32/bf16/fp16 gradients (fp32 for Adam's L2 decay, as for Adagrad)."""
    length = (3 if wd else 2) if l2 else 3
    grads = _decayed_grads(wd) if l2 else tuple(_GRADS)
    kernel = "sx_adam_l2" if l2 else "sx_adamw"

    def native(updates: Any, state: Any, params: Any, *, step: bool, donate: bool,
               shadows: Any) -> tuple[Any, Any] | None:  # fmt: skip
        parts = _parts(state, ScaleByAdamState, length)
        if parts is None or (wd and params is None):
            return None
        adam, sched = parts
        flat = Flat(adam.nu, "state.nu")
        if not _prepare(updates, params, [adam.mu, adam.nu], step=step, decay=bool(wd),
                        shadows=shadows, flat=flat, grads=grads):  # fmt: skip
            return None
        step_rate = _rate(lr, sched)
        nu = flat.locals
        mu = flat.same(adam.mu, "state.mu")
        if step_rate is None or not _state_contiguous(mu + nu):
            return None
        rate, new_sched = step_rate
        run = _Pass(flat, updates, params, step=step, donate=donate, decay=bool(wd),
                    shadows=shadows)  # fmt: skip
        t = int(adam.count) + 1
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        for i, (m, v) in enumerate(zip(mu, nu, strict=True)):
            if m.numel():
                _call(kernel, m.data_ptr(), v.data_ptr(), *run.args(i),
                      1.0 - b1, b2, 1.0 - b2, bc2**0.5, eps, 1.0 / bc1, wd, -rate)  # fmt: skip
        new_adam = ScaleByAdamState(adam.count + 1, flat.build(mu), flat.build(nu))
        new_state = [new_adam if s is adam else s for s in state[:-1]]
        return run.result(params), (*new_state, new_sched)

    return _with_step(reference, native)


def fused_lion(
    reference: GradientTransformation, lr: Any, b1: float, b2: float, wd: float
) -> GradientTransformation:
    """``reference`` (lion's chain), run by the native kernel as
    :func:`fused_adamw`; like the reference, the update leaves the momentum
    passed in alone (a new buffer), while a step reuses it."""
    return _one_buffer(
        reference, lr, wd, ScaleByLionState, "mu", "sx_lion",
        lambda neg_lr: (1.0 - b1, 1.0 - b2, wd, neg_lr),
        lambda old, mu: ScaleByLionState(old.count + 1, mu),
        length=3, grads=tuple(_GRADS),
    )  # fmt: skip


def _one_buffer(
    reference: GradientTransformation,
    lr: Any,
    wd: float,
    core: type,
    field: str,
    kernel: str,
    scalars: Callable[[float], tuple[float, ...]],
    rebuild: Callable[[Any, Any], Any],
    *,
    length: int,
    grads: tuple[torch.dtype, ...],
) -> GradientTransformation:
    """Lion, Adagrad and RMSprop: a chain of ``length`` states holding one
    ``core`` transform with one buffer (its field ``field``; ``rebuild(old
    core state, new buffer tree)`` makes the new one), ending in the learning
    rate's. As the references, an update writes a new buffer; a step reuses it."""

    def native(updates: Any, state: Any, params: Any, *, step: bool, donate: bool,
               shadows: Any) -> tuple[Any, Any] | None:  # fmt: skip
        parts = _parts(state, core, length)
        if parts is None or (wd and params is None):
            return None
        old, sched = parts
        flat = Flat(getattr(old, field), f"state.{field}")
        if not _prepare(updates, params, [getattr(old, field)], step=step, decay=bool(wd),
                        shadows=shadows, flat=flat, grads=grads):  # fmt: skip
            return None
        rate = _rate(lr, sched)
        buf = flat.locals
        if rate is None or not _state_contiguous(buf):
            return None
        run = _Pass(flat, updates, params, step=step, donate=donate, decay=bool(wd),
                    shadows=shadows)  # fmt: skip
        new_buf = buf if step else [torch.empty_like(b) for b in buf]
        for i, (b, b2) in enumerate(zip(buf, new_buf, strict=True)):
            if b.numel():
                _call(kernel, b.data_ptr(), b2.data_ptr(), *run.args(i), *scalars(-rate[0]))
        new_state = [rebuild(old, flat.build(new_buf)) if s is old else s for s in state[:-1]]
        return run.result(params), (*new_state, rate[1])

    return _with_step(reference, native)


def fused_adagrad(
    reference: GradientTransformation, lr: Any, eps: float, wd: float
) -> GradientTransformation:
    """``reference`` (adagrad's chain), run by the native kernel as :func:`fused_adamw`."""
    return _one_buffer(
        reference, lr, wd, ScaleByRssState, "sum_of_squares", "sx_adagrad",
        lambda neg_lr: (wd, eps, neg_lr), lambda _, acc: ScaleByRssState(acc),
        length=3 if wd else 2, grads=_decayed_grads(wd),
    )  # fmt: skip


def fused_rmsprop(
    reference: GradientTransformation, lr: Any, decay: float, eps: float, wd: float
) -> GradientTransformation:
    """``reference`` (rmsprop's chain, uncentered, without momentum), run by
    the native kernel as :func:`fused_adamw`."""
    return _one_buffer(
        reference, lr, wd, ScaleByRmsState, "nu", "sx_rmsprop",
        lambda neg_lr: (decay, 1.0 - decay, wd, eps, neg_lr), lambda _, nu: ScaleByRmsState(nu),
        length=3 if wd else 2, grads=_decayed_grads(wd),
    )  # fmt: skip


def _decayed_grads(wd: float) -> tuple[torch.dtype, ...]:
    """The gradient dtypes Adagrad and RMSprop's kernels take: the reference
    decays low-precision gradients in their own dtype (a rounding the kernel
    does not repeat), so with decay, fp32 only."""
    return (torch.float32,) if wd else tuple(_GRADS)
