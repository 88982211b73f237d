"""Optimizers whose update runs as one native pass when it can: the state
and the results are the reference chain's, and anything the kernel does not
cover (other dtypes or devices, no compiler, ``SHARDAX_NO_NATIVE``) runs the
reference itself."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from ._base import Flat, GradientTransformation, transformation
from ._transforms import ScaleByAdamState, ScaleByLionState, ScaleByScheduleState

__all__ = ["fused_adamw", "fused_lion"]


def _lib() -> Any:
    if os.environ.get("SHARDAX_NO_NATIVE"):
        return None
    from ..kernels import OPTIM

    lib = OPTIM.load()
    if lib is not None and not getattr(lib, "_shardax_typed", False):
        p, d = ctypes.c_void_p, ctypes.c_double
        lib.sx_adamw_f32.argtypes = [p, p, p, p, p, ctypes.c_int64, d, d, d, d, d, d, d, d]
        lib.sx_adamw_f32.restype = None
        lib.sx_lion_f32.argtypes = [p, p, p, p, p, ctypes.c_int64, d, d, d, d]
        lib.sx_lion_f32.restype = None
        lib._shardax_typed = True
    return lib


def _fp32_cpu(tree: Any) -> bool:
    """Every tensor leaf (Sharded or not) of ``tree`` is fp32 on the CPU —
    the same answer on every rank."""
    import optree

    from ..shard._sharded import Sharded

    leaves = optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Sharded))
    tensors = [x for x in leaves if isinstance(x, (torch.Tensor, Sharded))]
    return bool(tensors) and all(
        x.dtype == torch.float32 and x.device.type == "cpu" for x in tensors
    )


def _or_reference(reference: GradientTransformation, native: Any) -> GradientTransformation:
    """``reference``, whose update tries ``native`` first (None: not covered)."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        done = native(updates, state, params)
        return done if done is not None else reference.update(updates, state, params)

    return transformation(reference.init, update)


def _chain_state(state: Any, first: type, wd: float, params: Any) -> bool:
    """Whether ``state`` is the (``first``, decay, learning-rate) chain state
    the kernel knows, with the params weight decay needs."""
    return (
        isinstance(state, tuple)
        and len(state) == 3
        and isinstance(state[0], first)
        and not (wd and params is None)
    )


def fused_adamw(
    reference: GradientTransformation, lr: Any, b1: float, b2: float, eps: float, wd: float
) -> GradientTransformation:
    """``reference`` (adamw's chain: scale_by_adam, add_decayed_weights,
    scale_by_learning_rate), its update done by the native kernel when every
    leaf is a contiguous fp32 CPU tensor."""

    def _native(updates: Any, state: Any, params: Any) -> tuple[Any, Any] | None:
        if not _chain_state(state, ScaleByAdamState, wd, params):
            return None
        adam, decay, sched = state
        # Decide before any collective, from what every rank sees alike
        # (dtypes, devices, the step's rate): the aligns below communicate,
        # and ranks taking different paths would issue different collectives.
        trees = [adam.mu, adam.nu, updates] + ([params] if wd else [])
        if not all(_fp32_cpu(tree) for tree in trees):
            return None
        lib = _lib()
        step_rate = _rate(lr, sched)
        if lib is None or step_rate is None:
            return None
        rate, new_sched = step_rate
        flat = Flat(adam.nu, "state.nu")
        nu = flat.locals
        mu = flat.same(adam.mu, "state.mu")
        g = [x.contiguous() for x in flat.align(updates, "updates")]
        p = [x.contiguous() for x in flat.align(params, "params")] if wd else [None] * len(nu)
        t = int(adam.count) + 1
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        out = []
        for m, v, grad, param in zip(mu, nu, g, p, strict=True):
            u = torch.empty(m.shape, dtype=m.dtype)
            mc, vc = m.contiguous(), v.contiguous()  # the state is contiguous as made
            if m.numel():
                lib.sx_adamw_f32(
                    mc.data_ptr(), vc.data_ptr(), grad.data_ptr(),
                    None if param is None else param.data_ptr(), u.data_ptr(), m.numel(),
                    1.0 - b1, b2, 1.0 - b2, bc2**0.5, eps, 1.0 / bc1, wd, -rate,
                )  # fmt: skip
            if mc.data_ptr() != m.data_ptr():
                m.copy_(mc)
            if vc.data_ptr() != v.data_ptr():
                v.copy_(vc)
            out.append(u)
        new_adam = ScaleByAdamState(adam.count + 1, flat.build(mu), flat.build(nu))
        return flat.build(out), (new_adam, decay, new_sched)

    return _or_reference(reference, _native)


def _rate(lr: Any, sched: Any) -> tuple[float, Any] | None:
    """This step's learning rate and the schedule state after it, or None
    when the reference must run (a negative rate: it raises the clear error)."""
    if callable(lr):
        if not isinstance(sched, ScaleByScheduleState):
            return None
        rate = float(lr(int(sched.count)))
        return None if rate < 0 else (rate, ScaleByScheduleState(sched.count + 1))
    return float(lr), sched


def fused_lion(
    reference: GradientTransformation, lr: Any, b1: float, b2: float, wd: float
) -> GradientTransformation:
    """``reference`` (lion's chain), its update done by the native kernel when
    every leaf is an fp32 CPU tensor; like the reference, the new momentum is
    a new buffer (the state passed in is left alone)."""

    def _native(updates: Any, state: Any, params: Any) -> tuple[Any, Any] | None:
        if not _chain_state(state, ScaleByLionState, wd, params):
            return None
        lion, decay, sched = state
        trees = [lion.mu, updates] + ([params] if wd else [])
        if not all(_fp32_cpu(tree) for tree in trees):
            return None
        lib = _lib()
        rate = _rate(lr, sched)
        if lib is None or rate is None:
            return None
        flat = Flat(lion.mu, "state.mu")
        mu = [m.contiguous() for m in flat.locals]
        g = [x.contiguous() for x in flat.align(updates, "updates")]
        p = [x.contiguous() for x in flat.align(params, "params")] if wd else [None] * len(mu)
        out, new_mu = [], []
        for m, grad, param in zip(mu, g, p, strict=True):
            u, m2 = torch.empty(m.shape, dtype=m.dtype), torch.empty(m.shape, dtype=m.dtype)
            if m.numel():
                lib.sx_lion_f32(
                    m.data_ptr(), grad.data_ptr(), None if param is None else param.data_ptr(),
                    m2.data_ptr(), u.data_ptr(), m.numel(), 1.0 - b1, 1.0 - b2, wd, -rate[0],
                )  # fmt: skip
            out.append(u)
            new_mu.append(m2)
        new_lion = ScaleByLionState(lion.count + 1, flat.build(new_mu))
        return flat.build(out), (new_lion, decay, rate[1])

    return _or_reference(reference, _native)
