"""The native optimizer kernels (``kernels/csrc/optim.cpp``) as the fused
stepper calls them: what each kernel reads and writes (:data:`ALGORITHMS`),
the library with its functions typed (:func:`native`), and one call over
every leaf of a step (:meth:`Native.launch`).

The C side takes a table of 9 int64 per leaf — the two state buffers, the
gradient and its dtype code, the param (0: none), where the result goes,
the low-precision shadow (0: none) and its dtype code, the element count —
the leaf count, the apply flag (1: the result is the new param; 0: the
update) and the kernel's scalars.
"""

from __future__ import annotations

import array
import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import torch

from ..kernels import OPTIM
from ..shard._memory import is_disk, prefetch, release
from ._base import Kernel
from ._transforms import ScaleByAdamState, ScaleByLionState, ScaleByRmsState, ScaleByRssState

__all__ = ["ALGORITHMS", "GRADS", "SHADOWS", "Algorithm", "Native", "native", "on_disk", "stream"]

GRADS = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}
"""The gradient dtypes the kernels read (widened exactly, as torch's cast), by code."""
SHADOWS = {torch.float16: 2, torch.bfloat16: 3}
"""The dtypes of the low-precision params a step can write beside the fp32 ones, by code."""


def _adam(k: Kernel, t: int, rate: float) -> tuple[float, ...]:
    b1, b2 = k.betas
    bc1, bc2 = (1.0 - b1**t, 1.0 - b2**t) if k.bias_correction else (1.0, 1.0)
    return 1.0 - b1, b2, 1.0 - b2, bc2**0.5, k.eps, 1.0 / bc1, k.weight_decay, -rate


def _lion(k: Kernel, t: int, rate: float) -> tuple[float, ...]:
    b1, b2 = k.betas
    return 1.0 - b1, 1.0 - b2, k.weight_decay, -rate


def _adagrad(k: Kernel, t: int, rate: float) -> tuple[float, ...]:
    return k.weight_decay, k.eps, -rate


def _rmsprop(k: Kernel, t: int, rate: float) -> tuple[float, ...]:
    (decay,) = k.betas
    return decay, 1.0 - decay, k.weight_decay, k.eps, -rate


@attrs.frozen(kw_only=True)
class Algorithm:
    """What one kernel reads and writes: its C ``function``; the type of
    the core transform's ``state`` and its ``buffers`` (trees, in the
    kernel's order; one: read and written in place); the state's step
    ``counts`` — none, one ``"shared"`` by every leaf (advanced every step,
    read by no arithmetic), or one ``"per leaf"`` (Adam's bias correction:
    advanced where a gradient came, each leaf stepped with its own);
    whether the weight decay goes into the
    gradient (``l2``: the reference decays a low-precision gradient in its
    own dtype, a rounding the kernel does not make, so with decay it reads
    fp32 gradients only); and its ``arity`` ``scalars`` at step ``t`` (from
    1) and learning rate ``rate``."""

    function: str
    state: type
    buffers: Callable[[Any], tuple[Any, ...]]
    counts: Literal["none", "shared", "per leaf"]
    l2: bool
    scalars: Callable[[Kernel, int, float], tuple[float, ...]]
    arity: int


def _adam_buffers(s: ScaleByAdamState) -> tuple[Any, ...]:
    return s.mu, s.nu


ALGORITHMS = {
    "adamw": Algorithm(
        function="sx_adamw", state=ScaleByAdamState, buffers=_adam_buffers,
        counts="per leaf", l2=False, scalars=_adam, arity=8,
    ),
    "adam_l2": Algorithm(
        function="sx_adam_l2", state=ScaleByAdamState, buffers=_adam_buffers,
        counts="per leaf", l2=True, scalars=_adam, arity=8,
    ),
    "lion": Algorithm(
        function="sx_lion", state=ScaleByLionState, buffers=lambda s: (s.mu,),
        counts="shared", l2=False, scalars=_lion, arity=4,
    ),
    "adagrad": Algorithm(
        function="sx_adagrad", state=ScaleByRssState, buffers=lambda s: (s.sum_of_squares,),
        counts="none", l2=True, scalars=_adagrad, arity=3,
    ),
    "rmsprop": Algorithm(
        function="sx_rmsprop", state=ScaleByRmsState, buffers=lambda s: (s.nu,),
        counts="none", l2=True, scalars=_rmsprop, arity=5,
    ),
}  # fmt: skip
"""Each :class:`Kernel` name's algorithm."""


class Native:
    """The loaded library: ``functions`` (typed ctypes functions, by name)
    and :meth:`launch`."""

    def __init__(self, lib: Any) -> None:
        self.functions: dict[str, Any] = {}
        for algorithm in ALGORITHMS.values():
            fn = lib[algorithm.function]
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            fn.argtypes += [ctypes.c_double] * algorithm.arity
            fn.restype = ctypes.c_int
            self.functions[algorithm.function] = fn
        self.threads = lib["sx_threads"]
        self.threads.argtypes = [ctypes.c_int]
        self.threads.restype = None

    def launch(
        self,
        function: str,
        s0: Sequence[torch.Tensor],
        s1: Sequence[torch.Tensor],
        g: Sequence[torch.Tensor],
        p: Sequence[torch.Tensor | None],
        out: Sequence[torch.Tensor],
        shadows: Sequence[torch.Tensor] | None,
        apply: bool,
        scalars: tuple[float, ...],
    ) -> None:
        """Run ``function`` over every non-empty leaf in one call, on as many
        threads as torch's ops use. Every tensor is a contiguous CPU tensor
        of a dtype the kernel reads (the caller checked)."""
        self.threads(torch.get_num_threads())
        table: list[int] = []
        for i, o in enumerate(out):
            n = o.numel()
            if n:
                gi, pi = g[i], p[i]
                shadow = None if shadows is None else shadows[i]
                table += (
                    s0[i].data_ptr(), s1[i].data_ptr(), gi.data_ptr(), GRADS[gi.dtype],
                    0 if pi is None else pi.data_ptr(), o.data_ptr(),
                    0 if shadow is None else shadow.data_ptr(),
                    0 if shadow is None else SHADOWS[shadow.dtype], n,
                )  # fmt: skip
        if not table:
            return
        rows = array.array("q", table)
        code = self.functions[function](
            rows.buffer_info()[0], len(table) // 9, int(apply), *scalars
        )
        if code != 0:  # the dtype tables and the kernel disagree: never return garbage
            raise RuntimeError(f"the native {function} kernel refused its arguments ({code})")


WAVE = 1 << 21
"""Elements per wave of a streamed step (8 MiB of each fp32 buffer)."""


def _advise(wave: Sequence[tuple[int, int, int]], buffers: Sequence[Any], advise: Any) -> None:
    for i, start, count in wave:
        for seq in buffers:
            t = seq[i] if seq is not None else None
            if t is not None and is_disk(t):
                advise(t, start, count)


def stream(
    lib: Native,
    function: str,
    s0: Sequence[torch.Tensor],
    s1: Sequence[torch.Tensor],
    g: Sequence[torch.Tensor],
    p: Sequence[torch.Tensor | None],
    out: Sequence[torch.Tensor],
    shadows: Sequence[torch.Tensor] | None,
    apply: bool,
    scalars: tuple[float, ...],
    wave: int | None = None,
) -> None:
    """:meth:`Native.launch` over every leaf in waves of about ``wave``
    elements, for buffers on disk (``rules.offload``): the next wave's disk
    ranges read ahead while the kernel updates this one, each wave's handed
    back to its files once written — the step holds a wave or two of the
    disk-resident state, not all of it. Elementwise, so the results are the
    one launch's, bit for bit. ``wave``: default :data:`WAVE`."""
    wave = WAVE if wave is None else wave
    waves: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for i, o in enumerate(out):
        n = o.numel()
        for start in range(0, n, wave):
            count = min(wave, n - start)
            if waves[-1] and size + count > wave:
                waves.append([])
                size = 0
            waves[-1].append((i, start, count))
            size += count
    disk = (s0, s1, g, p, out, shadows)
    _advise(waves[0], disk, prefetch)
    for k, chunks in enumerate(waves):
        if k + 1 < len(waves):
            _advise(waves[k + 1], disk, prefetch)

        def cut(seq: Sequence[Any] | None, chunks: list = chunks) -> Any:
            if seq is None:
                return None
            return [None if seq[i] is None else seq[i].view(-1)[a : a + n] for i, a, n in chunks]

        lib.launch(
            function, cut(s0), cut(s1), cut(g), cut(p), cut(out), cut(shadows), apply, scalars
        )
        _advise(chunks, disk, release)


def on_disk(*buffers: Sequence[Any] | None) -> bool:
    """Whether any tensor of ``buffers`` lives on disk."""
    return any(t is not None and is_disk(t) for seq in buffers if seq is not None for t in seq)


def native() -> Native | None:
    """The kernels, or None without them (``SHARDAX_NO_NATIVE`` set, no
    compiler): checked on every step, so the setting can change at run time."""
    if os.environ.get("SHARDAX_NO_NATIVE"):
        return None
    lib = OPTIM.load()
    return None if lib is None else _typed(lib)


@functools.cache
def _typed(lib: Any) -> Native:
    return Native(lib)
