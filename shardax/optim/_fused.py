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

import array
import ctypes
import os
import weakref
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
_SCALARS = {"sx_adamw": 8, "sx_adam_l2": 8, "sx_lion": 4, "sx_adagrad": 3, "sx_rmsprop": 5}


def _lib() -> Any:
    if os.environ.get("SHARDAX_NO_NATIVE"):
        return None
    lib = OPTIM.load()
    if lib is not None and not getattr(lib, "_shardax_typed", False):
        for name, scalars in _SCALARS.items():
            fn = getattr(lib, name)
            # the leaves' table, their count, apply; the scalars
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            fn.argtypes += [ctypes.c_double] * scalars
            fn.restype = ctypes.c_int
        lib.sx_threads.argtypes = [ctypes.c_int]
        lib.sx_threads.restype = None
        lib._shardax_typed = True
    return lib


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


class _Bound:
    """What one call steps, checked: the core transform's state and the
    schedule's, the main buffer field's leaves (what gradients align to), the
    local tensors of each buffer field, the step counts the kernels advance
    in place (the core's, the schedule's; None where absent) and, once
    :meth:`read`, the params' leaves and local tensors aligned to the state
    (None where the call reads no params)."""

    __slots__ = ("buffers", "core", "count", "flat", "p", "p_leaves", "p_spec", "sched",
                 "sched_count")  # fmt: skip

    def __init__(self, core: Any, sched: Any, flat: Flat, buffers: list, count: Any,
                 sched_count: Any) -> None:  # fmt: skip
        self.core, self.sched, self.flat, self.buffers = core, sched, flat, buffers
        self.count, self.sched_count = count, sched_count
        self.p_leaves: list = []
        self.p_spec: Any = None
        self.p: list = [None] * len(flat)

    def read(self, params: Any, step: bool) -> bool:
        """Take ``params`` (for a step, or a decay): False where the kernels
        do not cover them — other dtypes or devices, or (for a step) laid out
        unlike the state (ZeRO-1/2's replicated params)."""
        flat = self.flat
        leaves, spec = optree.tree_flatten(params)
        if spec != flat.spec:
            return False
        p = _plain(leaves, flat, (torch.float32,))
        if p is None:  # the general path: relaid (a decay), or strided
            if step and not laid_out_like(leaves, flat):
                return False
            p = _locals(leaves, params, flat, (torch.float32,), "params")
            if p is None:
                return False
        self.p_leaves, self.p_spec, self.p = leaves, spec, p
        return True

    def tensors(self) -> list[torch.Tensor]:
        """The state's buffers the kernels address (their pointers are kept)."""
        counts = [c for c in (self.count, self.sched_count) if c is not None]
        return [t for b in self.buffers for t in b] + counts

    def rate(self, lr: Any) -> float | None:
        """This step's learning rate, or None when the reference must run (a
        negative rate: it raises the clear error)."""
        rate = float(lr(int(_Count(self.sched_count).value))) if callable(lr) else float(lr)
        return None if rate < 0 else rate

    def advance(self, core: bool = True) -> None:
        """Advance the step counts in place (the state is donated) — not the
        core's unless ``core``."""
        for count in (self.count if core else None, self.sched_count):
            if count is not None:
                _Count(count).advance()


class _Binder:
    """Binds a call's state and params (:class:`_Bound`) for one fused
    optimizer: a chain state of ``length`` holding one ``core`` transform
    state whose buffer ``fields`` (the last the main one) the kernels update,
    then the learning rate's state. The checks of the last call's state are
    kept for the next one, while the same leaves at the same addresses come
    back (a step is handed the buffers it stepped): a step's Python is paid
    with the caches cold from the pass before. Only weak references are
    kept, so a state its user drops is freed."""

    def __init__(self, core: type, fields: tuple[str, ...], length: int, lr: Any,
                 counted: bool) -> None:  # fmt: skip
        self.core, self.fields, self.length, self.lr = core, fields, length, lr
        self.counted = counted
        # the last state's (weak references to its leaves, treespec, the
        # indices of each buffer field and of the counts among the leaves,
        # the main field's treespec, the buffers' pointers): one tuple, so a
        # binder shared between threads reads one call's all together
        self.kept: tuple | None = None

    def bind(self, state: Any, params: Any, *, step: bool, decay: bool) -> _Bound | None:
        if decay and params is None:
            return None
        # (Sharded is no pytree node: optree takes it as a leaf without an
        # is_leaf callback, which would cost a Python call per node)
        leaves, spec = optree.tree_flatten(state)
        kept = self.kept
        bound = None
        if kept is not None and spec == kept[1] and _same(kept[0], leaves):
            bound = self._rebind(state, leaves, kept)
        if bound is None:
            bound = self._check(state)
            if bound is None:
                return None
            self._keep(leaves, spec, bound)
        return bound if not (step or decay) or bound.read(params, step) else None

    def _rebind(self, state: Any, leaves: list, kept: tuple) -> _Bound | None:
        _, _, buffers_at, count_at, sched_at, main_spec, ptrs = kept
        core, sched = _parts(state, self.core, self.length)  # type: ignore[misc]
        main = [leaves[i] for i in buffers_at[-1]]
        flat = Flat.of(getattr(core, self.fields[-1]), main, main_spec, f"state.{self.fields[-1]}")
        bound = _Bound(
            core, sched, flat, [[local(leaves[i]) for i in at] for at in buffers_at],
            None if count_at is None else leaves[count_at],
            None if sched_at is None else leaves[sched_at],
        )  # fmt: skip
        return bound if [t.data_ptr() for t in bound.tensors()] == ptrs else None

    def _keep(self, leaves: list, spec: Any, bound: _Bound) -> None:
        """Remember ``bound`` by the positions of its tensors among ``leaves``
        (each a distinct leaf)."""
        self.kept = None
        at = {id(x): i for i, x in enumerate(leaves)}
        if len(at) != len(leaves):
            return  # a tensor twice: checked afresh each call
        try:
            refs = [weakref.ref(x) for x in leaves]
            buffers_at = [[at[id(x)] for x in optree.tree_leaves(getattr(bound.core, f))]
                          for f in self.fields]  # fmt: skip
            count_at = None if bound.count is None else at[id(bound.count)]
            sched_at = None if bound.sched_count is None else at[id(bound.sched_count)]
        except (KeyError, TypeError):
            return
        ptrs = [t.data_ptr() for t in bound.tensors()]
        self.kept = (refs, spec, buffers_at, count_at, sched_at, bound.flat.spec, ptrs)

    def _check(self, state: Any) -> _Bound | None:
        """The state's full checks: None where the kernels do not cover it —
        decided alike on every rank, before any collective or write (the
        reference then runs, and raises the clear errors)."""
        parts = _parts(state, self.core, self.length)
        if parts is None:
            return None
        core, sched = parts
        sched_count = None
        if callable(self.lr):
            if not (isinstance(sched, ScaleByScheduleState) and _Count.usable(sched.count)):
                return None
            sched_count = sched.count
        count = None
        if self.counted:
            if not _Count.usable(core.count):
                return None
            count = core.count
        main = self.fields[-1]
        flat = Flat(getattr(core, main), f"state.{main}")
        buffers = [flat.same(getattr(core, f), f"state.{f}") for f in self.fields[:-1]]
        buffers.append(flat.locals)
        if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                   for b in buffers for t in b):  # fmt: skip
            return None
        return _Bound(core, sched, flat, buffers, count, sched_count)


def _same(refs: list, leaves: list) -> bool:
    """``leaves`` are the very objects ``refs`` refer to."""
    if len(leaves) != len(refs):
        return False
    return all(ref() is x for ref, x in zip(refs, leaves, strict=True))


class _Pass:
    """One fused pass over every leaf, in one native call: where the
    gradients, the params and the results are. ``step``: the result is the
    new param (written into the param's own buffer with ``donate``) and
    ``shadows`` (if given) receive it rounded to their low precision;
    otherwise the result is the update. Made by :meth:`plan`."""

    def __init__(self, lib: Any, bound: _Bound, g: list, step: bool, donate: bool,
                 shadows: Any) -> None:  # fmt: skip
        self.lib, self.bound, self.g, self.step, self.donate = lib, bound, g, step, donate
        self.given = bound.p
        self.p = [x if x is None or x.is_contiguous() else x.contiguous() for x in bound.p]
        if step:
            self.out = [
                x if donate and x is y else torch.empty_like(x)  # type: ignore[arg-type]
                for x, y in zip(self.p, self.given, strict=True)
            ]
        else:
            self.out = [torch.empty(x.shape, dtype=torch.float32) for x in bound.buffers[-1]]
        self.shadows = list(shadows) if shadows is not None else None
        lib.sx_threads(torch.get_num_threads())  # as many threads as torch's ops use

    @classmethod
    def plan(
        cls,
        bound: _Bound,
        updates: Any,
        *,
        step: bool,
        donate: bool,
        shadows: Sequence[torch.Tensor] | None,
        grads: tuple[torch.dtype, ...],
    ) -> _Pass | None:
        """The pass over ``bound`` and the gradients ``updates``, or None where
        the kernels do not cover the gradients or the shadows (decided as
        :meth:`_Binder.bind`)."""
        flat = bound.flat
        g_leaves, g_spec = optree.tree_flatten(updates)
        if g_spec != flat.spec:
            return None
        g = _locals(g_leaves, updates, flat, grads, "updates", contiguous=True)
        if g is None:
            return None
        if shadows is not None and not all(
            t.dtype in _SHADOWS and t.is_contiguous() for t in shadows
        ):
            return None
        lib = _lib()
        if lib is None:
            return None
        return cls(lib, bound, g, step, donate, shadows)

    def call(self, kernel: str, s0: Sequence[torch.Tensor], s1: Sequence[torch.Tensor],
             *scalars: float) -> None:  # fmt: skip
        """Run ``kernel`` over every non-empty leaf, ``s0``/``s1`` its state
        buffers (see kernels/csrc/optim.cpp: 9 int64 per leaf)."""
        table: list[int] = []
        shadows = self.shadows
        for i, (g, p, out) in enumerate(zip(self.g, self.p, self.out, strict=True)):
            n = out.numel()
            if n:
                shadow = None if shadows is None else shadows[i]
                table += (
                    s0[i].data_ptr(), s1[i].data_ptr(), g.data_ptr(), _GRADS[g.dtype],
                    0 if p is None else p.data_ptr(), out.data_ptr(),
                    0 if shadow is None else shadow.data_ptr(),
                    0 if shadow is None else _SHADOWS[shadow.dtype], n,
                )  # fmt: skip
        if not table:
            return
        rows = array.array("q", table)
        count = len(table) // 9
        code = getattr(self.lib, kernel)(rows.buffer_info()[0], count, int(self.step), *scalars)
        if code != 0:  # the dtype tables and the kernel disagree: never return garbage
            raise RuntimeError(f"the native {kernel} kernel refused its arguments ({code})")

    def result(self, params: Any) -> Any:
        """The updates (a tree like the state), or the new params (like ``params``)."""
        if not self.step:
            return self.bound.flat.build(self.out)
        if self.donate:
            written = True
            for given, out in zip(self.given, self.out, strict=True):
                if given is not out:  # a non-contiguous param took its result in a copy
                    with torch.no_grad():
                        given.copy_(out)  # type: ignore[union-attr]
                    written = False
            if written:
                return params  # every buffer holds its new value: the same tree
            self.out = list(self.given)  # type: ignore[arg-type]
        rebuilt = [
            x.with_local(t) if isinstance(x, Sharded) else t
            for x, t in zip(self.bound.p_leaves, self.out, strict=True)
        ]
        return optree.tree_unflatten(self.bound.p_spec, rebuilt)


def _locals(leaves: list, tree: Any, flat: Flat, dtypes: tuple[torch.dtype, ...], what: str,
            contiguous: bool = False) -> list | None:  # fmt: skip
    """The local tensors of ``leaves`` (flattened from ``tree``) aligned to
    ``flat``: cheaply where they already are (:func:`_plain`), else through
    :meth:`Flat.align_flat` (a relayout, the clear errors; ``contiguous``:
    strided ones copied); None where a leaf is not a CPU tensor of one of
    ``dtypes``."""
    out = _plain(leaves, flat, dtypes)
    if out is not None:
        return out
    if not _covered(leaves, dtypes):
        return None
    out = [local(x) for x in flat.align_flat(leaves, tree, what)]
    return [x.contiguous() for x in out] if contiguous else out


def _plain(leaves: list, flat: Flat, dtypes: tuple[torch.dtype, ...]) -> list | None:
    """The local tensors of ``leaves`` (gradients or params) where each is
    already what the kernels read — a contiguous CPU tensor of one of
    ``dtypes``, laid out as its state leaf (the common case, checked cheaply)
    — else None (the general path aligns them, and raises the clear errors)."""
    out = []
    for x, ref in zip(leaves, flat.leaves, strict=True):
        if isinstance(ref, Sharded):
            if not (isinstance(x, Sharded) and x.shape == ref.shape):
                return None
            if x.layout is not ref.layout and x.layout != ref.layout:
                return None
            x = x.local
        elif not isinstance(x, torch.Tensor) or x.shape != ref.shape:
            return None
        if x.dtype not in dtypes or not x.is_cpu or not x.is_contiguous():
            return None
        out.append(x)
    return out


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
        # the kernels write through pointers, outside autograd; the few
        # tensor ops around them are under no_grad where they write
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
    binder = _Binder(ScaleByAdamState, ("mu", "nu"), length, lr, counted=True)

    def native(updates: Any, state: Any, params: Any, *, step: bool, donate: bool,
               shadows: Any) -> tuple[Any, Any] | None:  # fmt: skip
        bound = binder.bind(state, params, step=step, decay=bool(wd))
        if bound is None:
            return None
        rate = bound.rate(lr)
        run = None if rate is None else _Pass.plan(
            bound, updates, step=step, donate=donate, shadows=shadows, grads=grads
        )  # fmt: skip
        if run is None:
            return None
        t = _Count(bound.count).value + 1
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        mu, nu = bound.buffers
        run.call(kernel, mu, nu, 1.0 - b1, b2, 1.0 - b2, bc2**0.5, eps, 1.0 / bc1, wd, -rate)
        # the moments and the counts are updated in place (the state is
        # donated): the state passed in is the new one
        bound.advance()
        return run.result(params), state

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
        lambda old, mu, step: ScaleByLionState(old.count if step else old.count + 1, mu),
        length=3, grads=tuple(_GRADS), counted=True,
    )  # fmt: skip


def _one_buffer(
    reference: GradientTransformation,
    lr: Any,
    wd: float,
    core: type,
    field: str,
    kernel: str,
    scalars: Callable[[float], tuple[float, ...]],
    rebuild: Callable[[Any, Any, bool], Any],
    *,
    length: int,
    grads: tuple[torch.dtype, ...],
    counted: bool = False,
) -> GradientTransformation:
    """Lion, Adagrad and RMSprop: a chain of ``length`` states holding one
    ``core`` transform with one buffer (its field ``field``; ``rebuild(old
    core state, new buffer tree, step)`` makes the new one; ``counted``: the
    core state has a step count too), ending in the learning rate's. As the
    references, an update writes a new buffer (and count), leaving the core
    state passed in alone; a step reuses them, advanced in place."""
    binder = _Binder(core, (field,), length, lr, counted=counted)

    def native(updates: Any, state: Any, params: Any, *, step: bool, donate: bool,
               shadows: Any) -> tuple[Any, Any] | None:  # fmt: skip
        bound = binder.bind(state, params, step=step, decay=bool(wd))
        if bound is None:
            return None
        rate = bound.rate(lr)
        run = None if rate is None else _Pass.plan(
            bound, updates, step=step, donate=donate, shadows=shadows, grads=grads
        )  # fmt: skip
        if run is None:
            return None
        buf = bound.buffers[0]
        new_buf = buf if step else [torch.empty_like(b) for b in buf]
        run.call(kernel, buf, new_buf, *scalars(-rate))  # type: ignore[operator]
        old = bound.core
        new_tree = getattr(old, field) if step else bound.flat.build(new_buf)  # a step: in place
        new_state = [rebuild(old, new_tree, step) if s is old else s for s in state[:-1]]
        bound.advance(core=step)
        return run.result(params), (*new_state, bound.sched)

    return _with_step(reference, native)


def fused_adagrad(
    reference: GradientTransformation, lr: Any, eps: float, wd: float
) -> GradientTransformation:
    """``reference`` (adagrad's chain), run by the native kernel as :func:`fused_adamw`."""
    return _one_buffer(
        reference, lr, wd, ScaleByRssState, "sum_of_squares", "sx_adagrad",
        lambda neg_lr: (wd, eps, neg_lr), lambda _, acc, __: ScaleByRssState(acc),
        length=3 if wd else 2, grads=_decayed_grads(wd),
    )  # fmt: skip


def fused_rmsprop(
    reference: GradientTransformation, lr: Any, decay: float, eps: float, wd: float
) -> GradientTransformation:
    """``reference`` (rmsprop's chain, uncentered, without momentum), run by
    the native kernel as :func:`fused_adamw`."""
    return _one_buffer(
        reference, lr, wd, ScaleByRmsState, "nu", "sx_rmsprop",
        lambda neg_lr: (decay, 1.0 - decay, wd, eps, neg_lr), lambda _, nu, __: ScaleByRmsState(nu),
        length=3 if wd else 2, grads=_decayed_grads(wd),
    )  # fmt: skip


def _decayed_grads(wd: float) -> tuple[torch.dtype, ...]:
    """The gradient dtypes Adagrad and RMSprop's kernels take: the reference
    decays low-precision gradients in their own dtype (a rounding the kernel
    does not repeat), so with decay, fp32 only."""
    return (torch.float32,) if wd else tuple(_GRADS)
