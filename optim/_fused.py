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

from ..kernels import OPTIM
from ..shard._sharded import Sharded
from ._base import Flat, GradientTransformation, local, transformation
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


def _is_leaf(x: Any) -> bool:
    return isinstance(x, Sharded)


def _covered(leaves: Sequence[Any], dtypes: Any) -> bool:
    """Every tensor leaf (Sharded or not) is on the CPU with a dtype in
    ``dtypes`` — the same answer on every rank (no data is looked at)."""
    tensors = [x for x in leaves if isinstance(x, (torch.Tensor, Sharded))]
    return bool(tensors) and all(x.dtype in dtypes and x.device.type == "cpu" for x in tensors)


def laid_out_like(leaves: Sequence[Any], ref: Flat) -> bool:
    """``leaves`` are laid out as ``ref``'s (equal layouts, or plain tensors
    of equal shape): a step can write them in the same pass as the state
    (ZeRO-3, no ZeRO; not ZeRO-1/2's replicated params)."""
    for x, r in zip(leaves, ref.leaves, strict=True):
        if isinstance(r, Sharded):
            if not (isinstance(x, Sharded) and x.layout == r.layout and x.shape == r.shape):
                return False
        elif isinstance(x, Sharded) or x.shape != r.shape:
            return False
    return True


class _Count:
    """A step count (a 0-d int64 CPU tensor of a donated state) read and
    advanced in place through its buffer: no tensor op per step, whose
    dispatch costs more than the rest of a step's Python with cold caches."""

    __slots__ = ("cell", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.cell = ctypes.c_int64.from_address(tensor.data_ptr())

    @staticmethod
    def usable(x: Any) -> bool:
        return (
            isinstance(x, torch.Tensor)
            and x.dtype == torch.int64
            and x.device.type == "cpu"
            and x.numel() == 1
            and not x.requires_grad
        )

    @property
    def value(self) -> int:
        return int(self.cell.value)

    def advance(self) -> torch.Tensor:
        self.cell.value += 1
        return self.tensor


def _rate(lr: Any, sched: Any) -> tuple[float, Any] | None:
    """This step's learning rate and the schedule state after it, or None
    when the reference must run (a negative rate: it raises the clear error).
    Call it only once the kernels run: a schedule's count advances in place."""
    if callable(lr):
        if not (isinstance(sched, ScaleByScheduleState) and _Count.usable(sched.count)):
            return None
        count = _Count(sched.count)
        rate = float(lr(count.value))
        return None if rate < 0 else (rate, count)
    return float(lr), None


def _advanced(sched: Any, count: _Count | None) -> Any:
    return sched if count is None else ScaleByScheduleState(count.advance())


class _Pass:
    """One fused pass per leaf: where the gradient, the param and the result
    are. ``step``: the result is the new param (written into the param's own
    buffer with ``donate``) and ``shadows`` (if given) receive it rounded to
    their low precision; otherwise the result is the update. Made by
    :meth:`plan`, which flattens each tree once (a step's Python overhead is
    paid with caches cold from the pass before)."""

    def __init__(self, lib: Any, flat: Flat, g: list, p_leaves: list, p_spec: Any, p: list,
                 step: bool, donate: bool, shadows: Any) -> None:  # fmt: skip
        self.lib, self.flat, self.g, self.step, self.donate = lib, flat, g, step, donate
        self.p_leaves, self.p_spec = p_leaves, p_spec
        self.given = p
        self.p = [x if x is None or x.is_contiguous() else x.contiguous() for x in p]
        if step:
            self.out = [
                x if donate and x is y else torch.empty_like(x)  # type: ignore[arg-type]
                for x, y in zip(self.p, self.given, strict=True)
            ]
        else:
            self.out = [torch.empty(x.shape, dtype=torch.float32) for x in flat.locals]
        self.shadows = list(shadows) if shadows is not None else None
        lib.sx_threads(torch.get_num_threads())  # as many threads as torch's ops use

    @classmethod
    def plan(
        cls,
        flat: Flat,
        state: Sequence[torch.Tensor],
        updates: Any,
        params: Any,
        *,
        step: bool,
        donate: bool,
        decay: bool,
        shadows: Sequence[torch.Tensor] | None,
        grads: tuple[torch.dtype, ...],
    ) -> _Pass | None:
        """The pass, or None where the kernels do not cover the call — decided
        alike on every rank, before any collective or write (the reference
        then runs, and raises the clear errors)."""
        if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                   for t in state):  # fmt: skip
            return None
        g_leaves, g_spec = optree.tree_flatten(updates, is_leaf=_is_leaf)
        if g_spec != flat.spec or not _covered(g_leaves, grads):
            return None
        p_leaves: list = []
        p_spec = None
        if step or decay:
            if params is None:
                return None
            p_leaves, p_spec = optree.tree_flatten(params, is_leaf=_is_leaf)
            if p_spec != flat.spec or not _covered(p_leaves, (torch.float32,)):
                return None
            if step and not laid_out_like(p_leaves, flat):
                return None
        if shadows is not None and not all(
            t.dtype in _SHADOWS and t.is_contiguous() for t in shadows
        ):
            return None
        lib = _lib()
        if lib is None:
            return None
        g = [local(x).contiguous() for x in flat.align_flat(g_leaves, updates, "updates")]
        p: list = [None] * len(flat)
        if p_leaves:
            p = [local(x) for x in flat.align_flat(p_leaves, params, "params")]
        return cls(lib, flat, g, p_leaves, p_spec, p, step, donate, shadows)

    def args(self, i: int) -> tuple[Any, ...]:
        g, p, out = self.g[i], self.p[i], self.out[i]
        shadow = self.shadows[i] if self.shadows is not None else None
        return (
            g.data_ptr(), _GRADS[g.dtype], None if p is None else p.data_ptr(), out.data_ptr(),
            int(self.step), None if shadow is None else shadow.data_ptr(),
            0 if shadow is None else _SHADOWS[shadow.dtype], out.numel(),
        )  # fmt: skip

    def call(self, kernel: str, *args: Any) -> None:
        code = getattr(self.lib, kernel)(*args)
        if code != 0:  # the dtype tables and the kernel disagree: never return garbage
            raise RuntimeError(f"the native {kernel} kernel refused its arguments ({code})")

    def result(self, params: Any) -> Any:
        """The updates (a tree like the state), or the new params (like ``params``)."""
        if not self.step:
            return self.flat.build(self.out)
        if self.donate:
            written = True
            for given, out in zip(self.given, self.out, strict=True):
                if given is not out:  # a non-contiguous param took its result in a copy
                    given.copy_(out)  # type: ignore[union-attr]
                    written = False
            if written:
                return params  # every buffer holds its new value: the same tree
            self.out = list(self.given)  # type: ignore[arg-type]
        rebuilt = [
            x.with_local(t) if isinstance(x, Sharded) else t
            for x, t in zip(self.p_leaves, self.out, strict=True)
        ]
        return optree.tree_unflatten(self.p_spec, rebuilt)


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
        step_rate = _rate(lr, sched)
        if step_rate is None or not _Count.usable(adam.count):
            return None
        rate, sched_count = step_rate
        flat = Flat(adam.nu, "state.nu")
        nu = flat.locals
        mu = flat.same(adam.mu, "state.mu")
        run = _Pass.plan(flat, mu + nu, updates, params, step=step, donate=donate,
                         decay=bool(wd), shadows=shadows, grads=grads)  # fmt: skip
        if run is None:
            return None
        count = _Count(adam.count)
        t = count.value + 1
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        for i, (m, v) in enumerate(zip(mu, nu, strict=True)):
            if m.numel():
                run.call(kernel, m.data_ptr(), v.data_ptr(), *run.args(i),
                         1.0 - b1, b2, 1.0 - b2, bc2**0.5, eps, 1.0 / bc1, wd, -rate)  # fmt: skip
        # the moments and the counts are updated in place (the state is donated)
        new_adam = ScaleByAdamState(count.advance(), adam.mu, adam.nu)
        new_state = [new_adam if s is adam else s for s in state[:-1]]
        return run.result(params), (*new_state, _advanced(sched, sched_count))

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
        rate = _rate(lr, sched)
        if rate is None:
            return None
        tree = getattr(old, field)
        flat = Flat(tree, f"state.{field}")
        buf = flat.locals
        run = _Pass.plan(flat, buf, updates, params, step=step, donate=donate, decay=bool(wd),
                         shadows=shadows, grads=grads)  # fmt: skip
        if run is None:
            return None
        new_buf = buf if step else [torch.empty_like(b) for b in buf]
        for i, (b, b2) in enumerate(zip(buf, new_buf, strict=True)):
            if b.numel():
                run.call(kernel, b.data_ptr(), b2.data_ptr(), *run.args(i), *scalars(-rate[0]))
        new_tree = tree if step else flat.build(new_buf)  # a step updates it in place
        new_state = [rebuild(old, new_tree) if s is old else s for s in state[:-1]]
        return run.result(params), (*new_state, _advanced(sched, rate[1]))

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
