"""The collective conformance suite: every collective, on every axis set of
the mesh, for every dtype we support, with uneven and empty pieces — values
checked against numpy, gradients against the analytic transposes.

Each rank builds every rank's inputs from a seed, so each checks its own
results without trusting the backend. Run it on any backend and world size::

    shardax launch --nproc-per-node 4 -m shardax.collectives.conformance
    SHARDAX_BACKEND=torch shardax launch --nproc-per-node 2 -m shardax.collectives.conformance

At world size 1 (no launcher) every collective is local:

>>> import shardax as sx
>>> len(run_all(sx.Mesh({"x": 1}))) == len(CHECKS)
True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import _api as C

__all__ = ["ALL_DTYPES", "CHECKS", "DTYPES", "axis_sets", "main", "run_all", "run_check"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
"""The dtypes every backend must support; inputs are small integers, so
sums are exact in every one of them."""

ALL_DTYPES = (*DTYPES, torch.float64, torch.int32)
"""Every dtype the shared-memory backend reduces natively."""


def _value(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_007 * salt + 101 * rank + 7)
    return torch.randint(-3, 4, tuple(shape), generator=g).to(dtype)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


def _check(name: str, actual: torch.Tensor, expected: np.ndarray, dtype: torch.dtype) -> None:
    if actual.dtype != dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {dtype}")
    if tuple(actual.shape) != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {expected.shape}")
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3}.get(dtype, 1e-6)
    got = _np(actual)
    if not np.allclose(got, expected, rtol=tol, atol=tol):
        raise AssertionError(f"{name}: got\n{got}\nexpected\n{expected}")


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def axis_sets(mesh: object) -> list[tuple[str, ...]]:
    """Each single axis, all axes in mesh order, and all axes reversed."""
    names = mesh.axis_names  # type: ignore[attr-defined]
    sets = [(a,) for a in names]
    if len(names) > 1:
        sets += [tuple(names), tuple(reversed(names))]
    return sets


class _Ctx:
    """One check's view of the group: members, this rank's index, inputs."""

    def __init__(self, mesh: object, axes: tuple[str, ...], dtype: torch.dtype, salt: int,
                 device: torch.device | None = None) -> None:  # fmt: skip
        self.mesh, self.axes, self.dtype, self.salt = mesh, axes, dtype, salt
        self.device = device or torch.device("cpu")
        self.members = mesh.ranks_along(axes)  # type: ignore[attr-defined]
        self.n = len(self.members)
        self.me = mesh.axis_index(axes)  # type: ignore[attr-defined]
        self.tag = f"{axes} {dtype} on {mesh!r} rank {mesh.rank}"  # type: ignore[attr-defined]

    def value(self, member: int, shape: Sequence[int], salt: int = 0) -> torch.Tensor:
        return _value(self.members[member], shape, self.dtype, self.salt + salt).to(self.device)

    def mine(self, shape: Sequence[int]) -> torch.Tensor:
        x = self.value(self.me, shape)
        return x.requires_grad_() if _floating(self.dtype) else x

    def backward(
        self, y: torch.Tensor, x: torch.Tensor, out_shape_of: Callable[[int], Sequence[int]]
    ) -> tuple[torch.Tensor, list[np.ndarray]]:
        """Backprop member-specific cotangents through ``y``; return ``x.grad``
        and every member's cotangent (numpy)."""
        cots = [_np(self.value(m, out_shape_of(m), salt=1)) for m in range(self.n)]
        y.backward(torch.from_numpy(cots[self.me]).to(self.device, self.dtype))
        assert x.grad is not None
        return x.grad, cots


def _chunks(length: int, n: int) -> list[tuple[int, int]]:
    sizes = C.chunk_sizes(length, n)
    offs = np.cumsum((0, *sizes))
    return [(int(offs[i]), int(offs[i + 1])) for i in range(n)]


# -- checks --------------------------------------------------------------------


def check_psum(c: _Ctx) -> None:
    shape = (3, 2)
    x = c.mine(shape)
    y = C.psum(x, c.axes, mesh=c.mesh)
    inputs = [_np(c.value(m, shape)) for m in range(c.n)]
    _check(f"psum {c.tag}", y, sum(inputs), c.dtype)
    if _floating(c.dtype):
        grad, cots = c.backward(y, x, lambda m: shape)
        _check(f"psum grad {c.tag}", grad, sum(cots), c.dtype)


def check_pmean(c: _Ctx) -> None:
    if not _floating(c.dtype):
        try:
            C.pmean(c.mine((2,)), c.axes, mesh=c.mesh)
        except Exception as err:
            if "floating" not in str(err):
                raise
            return
        raise AssertionError(f"pmean of {c.dtype} should raise")
    shape = (2, 3)
    x = c.mine(shape)
    y = C.pmean(x, c.axes, mesh=c.mesh)
    _check(f"pmean {c.tag}", y, sum(_np(c.value(m, shape)) for m in range(c.n)) / c.n, c.dtype)
    grad, cots = c.backward(y, x, lambda m: shape)
    _check(f"pmean grad {c.tag}", grad, sum(cots) / c.n, c.dtype)


def check_pmax_pmin(c: _Ctx) -> None:
    shape = (4,)
    for fn, red in ((C.pmax, np.max), (C.pmin, np.min)):
        x = c.mine(shape)
        y = fn(x, c.axes, mesh=c.mesh)
        inputs = np.stack([_np(c.value(m, shape)) for m in range(c.n)])
        best = red(inputs, axis=0)
        _check(f"{fn.__name__} {c.tag}", y, best, c.dtype)
        if _floating(c.dtype):
            grad, cots = c.backward(y, x, lambda m: shape)
            hits = (inputs == best).astype(np.float64)
            expected = sum(cots) * hits[c.me] / hits.sum(axis=0)
            _check(f"{fn.__name__} grad {c.tag}", grad, expected, c.dtype)


def check_all_gather(c: _Ctx) -> None:
    for dim in (0, 1):
        for lengths in ([2] * c.n, [m % 3 for m in range(c.n)]):  # even; uneven with empties

            def shape(m: int, dim: int = dim, lengths: list[int] = lengths) -> tuple[int, ...]:
                return (lengths[m], 3) if dim == 0 else (2, lengths[m])

            for given in (None, tuple(lengths)):
                x = c.mine(shape(c.me))
                y = C.all_gather(x, c.axes, dim, sizes=given, mesh=c.mesh)
                full = np.concatenate([_np(c.value(m, shape(m))) for m in range(c.n)], axis=dim)
                _check(f"all_gather dim={dim} lengths={lengths} {c.tag}", y, full, c.dtype)
                if _floating(c.dtype):
                    grad, cots = c.backward(y, x, lambda m, s=full.shape: s)
                    lo = sum(lengths[: c.me])
                    total = sum(cots)
                    piece = (
                        total[lo : lo + lengths[c.me]]
                        if dim == 0
                        else total[:, lo : lo + lengths[c.me]]
                    )
                    _check(f"all_gather grad dim={dim} {c.tag}", grad, piece, c.dtype)
    # tiled=False stacks on a new dim
    x = c.mine((2,))
    y = C.all_gather(x, c.axes, 0, tiled=False, mesh=c.mesh)
    _check(
        f"all_gather tiled=False {c.tag}",
        y,
        np.stack([_np(c.value(m, (2,))) for m in range(c.n)]),
        c.dtype,
    )


def check_psum_scatter(c: _Ctx) -> None:
    for dim in (0, 1):
        for length in (2 * c.n, c.n + 1, 1):  # even, uneven, mostly empty
            shape = (length, 2) if dim == 0 else (2, length)
            x = c.mine(shape)
            y = C.psum_scatter(x, c.axes, dim, mesh=c.mesh)
            total = sum(_np(c.value(m, shape)) for m in range(c.n))
            lo, hi = _chunks(length, c.n)[c.me]
            mine = total[lo:hi] if dim == 0 else total[:, lo:hi]
            _check(f"psum_scatter dim={dim} length={length} {c.tag}", y, mine, c.dtype)
            if _floating(c.dtype):

                def out_shape(m: int, dim: int = dim, length: int = length) -> tuple[int, ...]:
                    a, b = _chunks(length, c.n)[m]
                    return (b - a, 2) if dim == 0 else (2, b - a)

                grad, cots = c.backward(y, x, out_shape)
                _check(f"psum_scatter grad {c.tag}", grad, np.concatenate(cots, axis=dim), c.dtype)
    x = c.mine((c.n, 2))
    y = C.psum_scatter(x, c.axes, 0, tiled=False, mesh=c.mesh)
    _check(
        f"psum_scatter tiled=False {c.tag}",
        y,
        sum(_np(c.value(m, (c.n, 2))) for m in range(c.n))[c.me],
        c.dtype,
    )


def check_all_to_all(c: _Ctx) -> None:
    for split, concat in ((0, 1), (1, 0)):
        for split_len in (2 * c.n, c.n + 1):
            concat_lens = [1 + m % 2 for m in range(c.n)]  # members hold different lengths
            bounds = _chunks(split_len, c.n)
            in_shapes, out_shapes = [], []
            for m in range(c.n):
                s_in, s_out = [0, 0], [0, 0]
                s_in[split], s_in[concat] = split_len, concat_lens[m]
                s_out[split], s_out[concat] = bounds[m][1] - bounds[m][0], sum(concat_lens)
                in_shapes.append(s_in)
                out_shapes.append(s_out)
            x = c.mine(in_shapes[c.me])
            y = C.all_to_all(x, c.axes, split, concat, mesh=c.mesh)
            lo, hi = bounds[c.me]
            inputs = [_np(c.value(m, in_shapes[m])) for m in range(c.n)]
            expected = np.concatenate(
                [np.take(v, range(lo, hi), axis=split) for v in inputs], axis=concat
            )
            _check(f"all_to_all split={split} concat={concat} {c.tag}", y, expected, c.dtype)
            if _floating(c.dtype):
                grad, cots = c.backward(y, x, out_shapes.__getitem__)
                off = sum(concat_lens[: c.me])
                mine = range(off, off + concat_lens[c.me])
                back = np.concatenate([np.take(cot, mine, axis=concat) for cot in cots], axis=split)
                _check(f"all_to_all grad {c.tag}", grad, back, c.dtype)


def check_ppermute(c: _Ctx) -> None:
    shift = [(i, (i + 1) % c.n) for i in range(c.n)]
    partial = [(0, c.n - 1)] if c.n > 1 else [(0, 0)]
    for perm in (shift, partial):
        x = c.mine((3,))
        y = C.ppermute(x, c.axes, perm, mesh=c.mesh)
        src = next((s for s, d in perm if d == c.me), None)
        expected = _np(c.value(src, (3,))) if src is not None else np.zeros(3)
        _check(f"ppermute {perm} {c.tag}", y, expected, c.dtype)
        if _floating(c.dtype):
            grad, cots = c.backward(y, x, lambda m: (3,))
            dst = next((d for s, d in perm if s == c.me), None)
            _check(
                f"ppermute grad {perm} {c.tag}",
                grad,
                cots[dst] if dst is not None else np.zeros(3),
                c.dtype,
            )


def check_broadcast(c: _Ctx) -> None:
    root = c.n - 1
    x = c.mine((2, 2))
    y = C.broadcast(x, c.axes, src=root, mesh=c.mesh)
    _check(f"broadcast {c.tag}", y, _np(c.value(root, (2, 2))), c.dtype)
    if _floating(c.dtype):
        grad, cots = c.backward(y, x, lambda m: (2, 2))
        _check(
            f"broadcast grad {c.tag}",
            grad,
            sum(cots) if c.me == root else np.zeros((2, 2)),
            c.dtype,
        )


def _async_ops(c: _Ctx) -> list[tuple[str, Callable[..., object]]]:
    n, kw = c.n, {"mesh": c.mesh}
    ops: list[tuple[str, Callable[..., object]]] = [
        ("psum", lambda x, a: C.psum(x, c.axes, async_op=a, **kw)),
        ("all_gather", lambda x, a: C.all_gather(x, c.axes, 1, sizes=(3,) * n, async_op=a, **kw)),
        ("psum_scatter", lambda x, a: C.psum_scatter(x, c.axes, 0, async_op=a, **kw)),
        (
            "all_to_all",
            lambda x, a: C.all_to_all(x, c.axes, 0, 1, concat_sizes=(3,) * n, async_op=a, **kw),
        ),
        (
            "ppermute",
            lambda x, a: C.ppermute(
                x, c.axes, [(i, (i + 1) % n) for i in range(n)], async_op=a, **kw
            ),
        ),
        ("broadcast", lambda x, a: C.broadcast(x, c.axes, src=n - 1, async_op=a, **kw)),
    ]
    if _floating(c.dtype):
        ops.append(("pmean", lambda x, a: C.pmean(x, c.axes, async_op=a, **kw)))
    return ops


def check_async(c: _Ctx) -> None:
    """Every async collective, all in flight at once, waited in reverse order,
    gives the values and gradients of its synchronous self."""
    ops = _async_ops(c)
    x_async, x_sync = c.mine((c.n, 3)), c.mine((c.n, 3))
    handles = [fn(x_async, True) for _, fn in ops]
    outs = [h.wait() for h in reversed(handles)][::-1]  # type: ignore[attr-defined]
    refs = [fn(x_sync, False) for _, fn in ops]
    for (name, _), out, ref in zip(ops, outs, refs, strict=True):
        _check(f"{name} async {c.tag}", out, _np(ref), c.dtype)
    if _floating(c.dtype):
        cots = [c.value(c.me, o.shape, salt=10 + k) for k, o in enumerate(outs)]
        torch.autograd.backward(outs, cots)
        torch.autograd.backward(refs, cots)
        _check(f"async grads {c.tag}", x_async.grad, _np(x_sync.grad), c.dtype)


def _every_op(c: _Ctx) -> list[tuple[str, tuple[int, ...], Callable[..., Any]]]:
    """Every collective that returns a tensor, as ``(name, input shape,
    call(x, **return_keywords))``, with uneven pieces where the op has pieces."""
    n, axes, kw = c.n, c.axes, {"mesh": c.mesh}
    ring = [(i, (i + 1) % n) for i in range(n)]
    ops: list[tuple[str, tuple[int, ...], Callable[..., Any]]] = [
        ("psum", (3, 2), lambda x, **k: C.psum(x, axes, **kw, **k)),
        ("pmax", (3, 2), lambda x, **k: C.pmax(x, axes, **kw, **k)),
        ("pmin", (3, 2), lambda x, **k: C.pmin(x, axes, **kw, **k)),
        ("all_gather", (2, 3), lambda x, **k: C.all_gather(x, axes, 1, **kw, **k)),
        ("all_gather untiled", (2, 3),
         lambda x, **k: C.all_gather(x, axes, 1, tiled=False, **kw, **k)),
        ("psum_scatter", (2 * n + 1, 2), lambda x, **k: C.psum_scatter(x, axes, 0, **kw, **k)),
        ("psum_scatter untiled", (3, n),
         lambda x, **k: C.psum_scatter(x, axes, 1, tiled=False, **kw, **k)),
        ("all_to_all", (n + 1, 2, 3), lambda x, **k: C.all_to_all(x, axes, 0, 2, **kw, **k)),
        ("ppermute", (2, 3), lambda x, **k: C.ppermute(x, axes, ring, **kw, **k)),
        ("ppermute to one", (2, 3), lambda x, **k: C.ppermute(x, axes, [(0, n - 1)], **kw, **k)),
        ("broadcast", (2, 3), lambda x, **k: C.broadcast(x, axes, src=n - 1, **kw, **k)),
    ]  # fmt: skip
    if _floating(c.dtype):
        ops.append(("pmean", (2, 3), lambda x, **k: C.pmean(x, axes, **kw, **k)))
    return ops


_IN_PLACE = ("psum", "pmean", "pmax", "pmin", "broadcast")


def check_out_and_async(c: _Ctx) -> None:
    """The one return rule, on every op: ``out=`` (written and returned),
    ``async_op=True`` (a Handle whose ``wait()`` returns the result) and both
    give exactly the plain call's result — the same backend call on the same
    data, only landing elsewhere, so bit for bit; ``out=x`` works in place
    where the rule allows it."""
    for name, shape, fn in _every_op(c):
        x = c.value(c.me, shape)
        plain = fn(x)
        out = torch.full_like(plain, 7, memory_format=torch.contiguous_format)
        pending = fn(x, async_op=True)
        into = torch.full_like(out, 7)
        both = fn(x, out=into, async_op=True)
        results = {"out=": (fn(x, out=out), out)}
        if not isinstance(pending, C.Handle) or not isinstance(both, C.Handle):
            raise AssertionError(f"{name} async_op=True {c.tag}: {pending!r}, {both!r}")
        results["async_op"] = (pending.wait(), None)
        results["out= and async_op"] = (both.wait(), into)
        if name in _IN_PLACE:
            y = x.clone()
            results["out=x"] = (fn(y, out=y), y)
        for how, (got, buf) in results.items():
            if buf is not None and got is not buf:
                raise AssertionError(f"{name} {how} {c.tag}: returned another tensor than out")
            if got.dtype != plain.dtype or not torch.equal(got, plain):
                raise AssertionError(f"{name} {how} {c.tag}: got\n{got}\nexpected\n{plain}")


def check_strided(c: _Ctx) -> None:
    """Non-contiguous 3-D inputs, negative dims, and empty pieces."""
    lengths = [m % 3 for m in range(c.n)]  # some members hold nothing

    def strided(m: int, shape: Sequence[int]) -> torch.Tensor:
        return c.value(m, shape).permute(2, 0, 1)  # a view with permuted strides

    x = strided(c.me, (2, lengths[c.me], 3))
    y = C.all_gather(x, c.axes, -1, mesh=c.mesh)
    full = np.concatenate([_np(strided(m, (2, lengths[m], 3))) for m in range(c.n)], axis=-1)
    _check(f"all_gather strided {c.tag}", y, full, c.dtype)

    x = strided(c.me, (c.n + 1, 2, 3))  # shape (3, n + 1, 2)
    y = C.psum_scatter(x, c.axes, -2, mesh=c.mesh)
    lo, hi = _chunks(c.n + 1, c.n)[c.me]
    total = sum(_np(strided(m, (c.n + 1, 2, 3))) for m in range(c.n))
    _check(f"psum_scatter strided {c.tag}", y, total[:, lo:hi], c.dtype)

    concat = [m % 2 for m in range(c.n)]  # empty concat pieces
    x = strided(c.me, (concat[c.me], 2, 2 * c.n))  # shape (2n, len, 2)
    y = C.all_to_all(x, c.axes, -3, 1, mesh=c.mesh)
    parts = [_np(strided(m, (concat[m], 2, 2 * c.n)))[2 * c.me : 2 * c.me + 2] for m in range(c.n)]
    _check(f"all_to_all strided {c.tag}", y, np.concatenate(parts, axis=1), c.dtype)
    if _floating(c.dtype):  # gradients equal those of the contiguous input
        x = strided(c.me, (concat[c.me], 2, 2 * c.n)).requires_grad_()
        x2 = x.detach().contiguous().requires_grad_()
        cot = c.value(c.me, (2, sum(concat), 2), salt=3)
        C.all_to_all(x, c.axes, -3, 1, mesh=c.mesh).backward(cot)
        C.all_to_all(x2, c.axes, 0, 1, mesh=c.mesh).backward(cot)
        _check(f"all_to_all strided grad {c.tag}", x.grad, _np(x2.grad), c.dtype)


def check_axis_index_and_barrier(c: _Ctx) -> None:
    coords = c.mesh.coords(c.mesh.rank)  # type: ignore[attr-defined]
    index = 0
    for a in c.axes:
        index = index * c.mesh.size(a) + coords[a]  # type: ignore[attr-defined]
    if C.axis_index(c.axes, mesh=c.mesh) != index or C.axis_size(c.axes, mesh=c.mesh) != c.n:
        raise AssertionError(f"axis_index/axis_size {c.tag}")
    C.barrier(c.axes, mesh=c.mesh)


CHECKS: dict[str, Callable[[_Ctx], None]] = {
    "psum": check_psum,
    "pmean": check_pmean,
    "pmax_pmin": check_pmax_pmin,
    "all_gather": check_all_gather,
    "psum_scatter": check_psum_scatter,
    "all_to_all": check_all_to_all,
    "ppermute": check_ppermute,
    "broadcast": check_broadcast,
    "async": check_async,
    "out_and_async": check_out_and_async,
    "strided": check_strided,
    "axis_index_and_barrier": check_axis_index_and_barrier,
}


def run_check(
    name: str,
    mesh_shape: dict[str, int],
    dtypes: Sequence[torch.dtype] = DTYPES,
    timeout: float | None = None,
    device: torch.device | None = None,
) -> int:
    """Run one check on every axis set of a mesh (with that collective
    timeout) and every dtype (on every rank), on tensors of ``device`` (CPU
    by default; a GPU rank's own for the ``cupy`` and NCCL backends); return
    how many cases ran. Raises AssertionError on a mismatch."""
    from ..mesh._mesh import Mesh

    mesh = Mesh(mesh_shape, timeout=timeout)
    cases = 0
    for i, axes in enumerate(axis_sets(mesh)):
        for j, dtype in enumerate(dtypes):
            CHECKS[name](_Ctx(mesh, axes, dtype, salt=100 * i + j, device=device))
            cases += 1
    return cases


def run_all(
    mesh: object, dtypes: Sequence[torch.dtype] = DTYPES, device: torch.device | None = None
) -> list[str]:
    """Every check on ``mesh``; the names that passed (all, or it raises)."""
    for name in CHECKS:
        run_check(name, mesh.shape, dtypes, device=device)  # type: ignore[attr-defined]
    return list(CHECKS)


def meshes_for(world: int) -> list[dict[str, int]]:
    """The meshes the suite runs on for a world size: one axis of all ranks,
    and 2 × world/2 when that splits.

    >>> meshes_for(4), meshes_for(3)
    ([{'x': 4}, {'x': 2, 'y': 2}], [{'x': 3}])
    """
    out = [{"x": world}]
    if world % 2 == 0 and world > 2:
        out.append({"x": 2, "y": world // 2})
    return out


def main() -> int:
    """Entry point under a launcher: run everything, report on rank 0."""
    from ..mesh._mesh import Mesh
    from ..mesh._runtime import init, shutdown

    info = init()
    cases = 0
    try:
        for shape in meshes_for(info.world_size):
            for name in CHECKS:
                cases += run_check(name, shape, device=info.device)  # a GPU rank's own GPU
        if info.rank == 0:
            names = ", ".join(str(Mesh(s)) for s in meshes_for(info.world_size))
            print(
                f"conformance: {len(CHECKS)} checks, {cases} cases passed on {names} "
                f"({info.world_size} ranks on {info.device.type}, backend {_backend_name()})",
                flush=True,
            )
    finally:
        shutdown()
    return 0


def _backend_name() -> str:
    from ._backend import get_backend

    return get_backend().name


if __name__ == "__main__":
    sys.exit(main())
