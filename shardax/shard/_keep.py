"""What a selective remat policy keeps, and how the recomputation gets it
back: the forward's dispatch mode keeps the outputs a policy picks, in
order, in a memory kind (the device, pinned host memory, files), with each
call's op and argument shapes; the recomputation's mode hands them back in
the same order instead of running those ops, and refuses a call that is
not the forward's. One mechanism for ``save_matmuls``, ``save_names`` and
``offload_names`` (torch's selective checkpoint keeps only on the device,
and hands back by per-op counts: code that ran differently in backward
would get another call's values silently).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import optree
import torch
import torch.utils.checkpoint as _checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ShardingError
from ._memory import offloaded, restored

__all__ = ["keeping_contexts", "save_matmuls", "takes_part", "uncounted"]

_MATMULS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)  # fmt: skip

_UNCOUNTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardax_uncounted", default=False
)


@contextmanager
def uncounted() -> Iterator[None]:
    """Ops run inside it are not recorded for backward (``no_grad``), nor
    kept by a remat policy or counted in its order — for code that runs in
    the forward only (see :func:`recomputing`): the recomputation must save
    and keep what the forward did.

    >>> import torch
    >>> with uncounted():
    ...     torch.ones(2, requires_grad=True).sum().requires_grad
    False
    """
    token = _UNCOUNTED.set(True)
    try:
        with torch.no_grad():
            yield
    finally:
        _UNCOUNTED.reset(token)


def keeping_contexts(
    policy: Callable[[Any, Any, Any], bool], kind: str
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """A selective checkpoint (torch's, with what it keeps in memory
    ``kind``): the forward's mode keeps each output ``policy`` picks, in
    order, with its op and argument shapes; the recomputation's hands them
    back, in the same order, instead of running those ops — and refuses a
    call that is not the forward's (code that ran differently in backward
    would otherwise get another call's values)."""
    kept: list[Any] = []
    return _Keeping(policy, kept, kind), _Replaying(policy, kept)


class _Kept:
    """One kept output: where it is kept, and the version it had (a kept
    tensor that the forward then changed in place is refused)."""

    __slots__ = ("func", "signature", "value", "versions")

    def __init__(self, func: Any, signature: tuple[Any, ...], out: Any, kind: str) -> None:
        self.func, self.signature = func, signature
        self.value = optree.tree_map(
            lambda t: (_detached(t) if kind == "device" else offloaded(_detached(t), kind))
            if isinstance(t, torch.Tensor) else t,
            out,
        )  # fmt: skip
        self.versions = [t._version for t in optree.tree_leaves(self.value)
                         if isinstance(t, torch.Tensor)]  # fmt: skip

    def get(self) -> Any:
        now = [t._version for t in optree.tree_leaves(self.value) if isinstance(t, torch.Tensor)]
        if now != self.versions:
            raise ShardingError(
                f"remat: the output of {self.func} that the policy keeps was changed in place "
                "after the forward kept it; the recomputation would change it again. Keep "
                "fewer ops (another policy or names=), or make that update out of place"
            )
        return optree.tree_map(
            lambda t: restored(t) if isinstance(t, torch.Tensor) else t, self.value
        )


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that shares ``t``'s version counter — inside a
    dispatch mode a plain detach gets its own, and an in-place change of
    the kept output in the forward would go unseen (as torch's selective
    checkpoint does it)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


_CONSUMED = object()


class _Keeping(TorchDispatchMode):
    def __init__(self, policy: Callable[..., bool], kept: list[Any], kind: str) -> None:
        super().__init__()
        self.policy, self.kept, self.kind = policy, kept, kind

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code inside a region stays compiled (as under torch's own)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _IGNORED and not _UNCOUNTED.get() and self.policy(func, args, kwargs):
            self.kept.append(_Kept(func, _signature(args, kwargs), out, self.kind))
        return out


class _Replaying(TorchDispatchMode):
    def __init__(self, policy: Callable[..., bool], kept: list[Any]) -> None:
        super().__init__()
        self.policy, self.kept = policy, kept
        self.position = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __enter__(self) -> Any:
        self.position = 0  # each recomputation (a second backward: another) from the start
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _IGNORED or _UNCOUNTED.get() or not self.policy(func, args, kwargs):
            return func(*args, **kwargs)
        i, self.position = self.position, self.position + 1
        entry = self.kept[i] if i < len(self.kept) else None
        if entry is _CONSUMED:  # handed back already: a second backward computes it again
            return func(*args, **kwargs)
        signature = _signature(args, kwargs)
        if entry is None or entry.func != func or entry.signature != signature:
            forward = "nothing more" if entry is None else f"{entry.func} of {entry.signature}"
            raise ShardingError(
                f"remat: the recomputation's kept op {i} is {func} of {signature}; the forward's "
                f"was {forward}. The region ran differently in backward (state changed between "
                "forward and backward, or code that runs only in the forward — guarded by "
                "recomputing() — runs ops the policy keeps: run those under "
                "shardax.uncounted())"
            )
        self.kept[i] = _CONSUMED
        return entry.get()


def _signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of a call's tensor arguments: the forward's and
    the recomputation's call of a kept op must agree."""
    leaves = optree.tree_leaves((args, kwargs))
    return tuple(
        (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
        for t in leaves
        if isinstance(t, (torch.Tensor, bool, int, float, str, torch.dtype))
    )


def takes_part(op: Any, args: Any = (), kwargs: Any = None) -> bool:
    """Whether ``op``'s output is worth keeping and safe to: an ATen op (a
    collective — ``c10d``'s, which its schema calls pure — runs again on
    every rank alike, and its output is final only once waited on), not a
    view, not an in-place op, not a random draw (attention without dropout
    is kept) or a fresh buffer (the one filled in place next: a kept tensor
    must not change)."""
    schema = op._schema
    return not (
        not schema.name.startswith("aten::")
        or op.is_view
        or schema.is_mutable
        or _draws(op, args, kwargs or {})
        or schema.name.rpartition("::")[2] in _FRESH
    )


_IGNORED = frozenset(getattr(_checkpoint, "SAC_IGNORED_OPS", ()))
"""Ops a selective checkpoint neither keeps nor counts (torch's list:
profiler records, symbolic sizes)."""

_FRESH = frozenset(
    f"{name}{tail}"
    for name in ("empty", "zeros", "ones", "full", "new_empty", "new_zeros", "new_ones", "new_full")
    for tail in ("", "_like", "_strided")
)


def save_matmuls(op: Any, args: Any, kwargs: Any) -> bool:
    return (
        op.overloadpacket in _MATMULS
        and not op._schema.is_mutable  # mm.out: the caller's buffer
        and not _draws(op, args, kwargs)
    )


def _draws(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of a seeded op (attention with dropout) takes
    random numbers: kept, it would not run again in the recomputation, and
    every draw after it there would differ from the forward's."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            value = args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
            return bool(value)
    return True
