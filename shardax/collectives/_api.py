"""Differentiable collectives over mesh axes, with JAX's names.

``axis`` is a mesh axis name or a tuple of names (a tuple acts as one axis of
their combined size, first name major). The mesh is ``mesh=`` or the one of
the innermost ``with mesh:`` block. A size-1 axis makes every collective
local.

**One return rule.** Every collective that returns a tensor — ``psum``,
``pmean``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ppermute``, ``broadcast`` — takes the same two keywords,
which mean the same everywhere:

- by default it returns the result, a new tensor, differentiable (backward
  runs the op's transpose: :mod:`._ops`);
- ``out=buf`` writes the result into ``buf`` and returns ``buf`` itself:
  a contiguous tensor of the result's shape with ``x``'s dtype and device,
  sharing no memory with ``x`` — except ``out=x``, in place, for the ops
  whose result is shaped like ``x`` and that read it before writing (the
  reductions and ``broadcast``). Not differentiable, as torch's ``out=``
  is not: it raises where ``x`` requires grad under autograd. A ``buf``
  that does not fit raises :class:`~shardax.errors.CollectiveError` naming
  the op, the axis and the shape, dtype and device the result needs;
- ``async_op=True`` issues the collective and returns a :class:`Handle` at
  once; its ``wait()`` returns what the call would have returned (the
  result, still differentiable, or ``buf``). The two combine.

Other keywords (``tiled``, ``sizes``, ``concat_sizes``, ``src``) only say
what the result is.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import CollectiveError, CollectiveMismatchError
from ..mesh import _context
from ..mesh._groups import Group
from ..mesh._mesh import Mesh
from ._backend import Handle, start
from ._ops import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Mask,
    Op,
    Permute,
    ReduceScatter,
    _check_out,
    chunk_sizes,
    transpose,
)

__all__ = [
    "all_gather",
    "all_to_all",
    "apply_op",
    "axis_index",
    "axis_size",
    "barrier",
    "broadcast",
    "count_once",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
]

Axis = str | tuple[str, ...]


def _resolve_mesh(mesh: Mesh | None, what: str) -> Mesh:
    mesh = mesh if mesh is not None else _context.current()
    if mesh is None:
        raise CollectiveError(f"{what} needs a mesh: pass mesh=... or call it inside `with mesh:`")
    if not isinstance(mesh, Mesh):
        raise CollectiveError(f"{what} runs on a live Mesh, not {mesh!r}")
    return mesh


def _group(axis: Axis | Iterable[str] | None, mesh: Mesh | None, what: str) -> Group:
    mesh = _resolve_mesh(mesh, what)
    axes = mesh.axis_names if axis is None else axis
    return mesh.group(axes)


def _dim(x: torch.Tensor, dim: int, what: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise CollectiveError(
            f"{what}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


class _Collective(torch.autograd.Function):
    """Runs an op (or finishes it: ``handle``); backward runs its transpose
    (itself differentiable)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Op, handle: Handle | None) -> torch.Tensor:
        out = (handle if handle is not None else op.start(x)).wait()
        ctx.op = op
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _Collective.apply(g, transpose(ctx.op), None), None, None


class _Extremum(torch.autograd.Function):
    """pmax / pmin: not linear, so no transpose; the gradient goes to the
    ranks holding the extremum, split evenly between ties."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: AllReduce, handle: Handle | None) -> torch.Tensor:
        y = (handle if handle is not None else op.start(x)).wait()
        ctx.group = op.group
        ctx.save_for_backward(x, y)
        return x.view_as(x) if y is x else y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, y = ctx.saved_tensors
        hit = (x == y).to(g.dtype)
        total = AllReduce(ctx.group, "sum").run(g)
        count = AllReduce(ctx.group, "sum").run(hit)
        return total * hit / count, None, None


def _call(
    x: torch.Tensor,
    op: Op,
    async_op: bool,
    out: torch.Tensor | None = None,
    *,
    grad: type[torch.autograd.Function] = _Collective,
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """``op`` on ``x`` under the return rule (module docstring), the one
    place it is applied: with ``out`` (which ``op`` writes, or a view of
    which it writes), ``out``; else the result through ``grad``'s autograd,
    then ``then`` (a reshaping of it); with ``async_op``, a :class:`Handle`
    of that, the op issued now."""
    if out is not None:
        if not async_op:
            op.run(x)
            return out
        handle = op.start(x)

        def into() -> torch.Tensor:
            handle.wait()
            return out

        return Handle.later(into)
    if not async_op:
        y = grad.apply(x, op, None)
        return y if then is None else then(y)
    issued = op.start(x)

    def result() -> torch.Tensor:
        y = grad.apply(x, op, issued)
        return y if then is None else then(y)

    return Handle.later(result)


def apply_op(x: torch.Tensor, op: Op) -> torch.Tensor:
    """Run ``op`` on ``x``, differentiably (backward runs ``transpose(op)``).

    >>> import torch, shardax as sx
    >>> from shardax.collectives._ops import AllReduce
    >>> group = sx.Mesh({"dp": 1}).group("dp")
    >>> apply_op(torch.ones(2), AllReduce(group, "sum"))
    tensor([1., 1.])
    """
    return _Collective.apply(x, op, None)


_MAX_DIMS = 16


def _exchange(x: torch.Tensor, dim: int, group: Group, what: str) -> tuple[int, ...]:
    """Every member's length along ``dim``, checking on the way that the
    members agree on dtype and on every other dim (a mismatch would make the
    backend return garbage or abort)."""
    if x.dim() > _MAX_DIMS:
        raise CollectiveError(f"{what}: tensors of more than {_MAX_DIMS} dims are not supported")
    meta = [zlib.crc32(str(x.dtype).encode()), x.dim(), *x.shape, *[0] * (_MAX_DIMS - x.dim())]
    meta[2 + dim] = -1  # the dim that may differ
    t = torch.tensor([x.size(dim), *meta], dtype=torch.int64, device=x.device)
    rows = AllGather(group, 0, (1,) * group.size).run(t[None]).tolist()
    if any(r[1:] != rows[0][1:] for r in rows):
        shapes = {group.members[i]: (tuple(r[3 : 3 + r[2]]), r[1]) for i, r in enumerate(rows)}
        raise CollectiveMismatchError(
            f"{what} over {group.label}: the ranks disagree on dtype or on dims other than dim "
            f"{dim} (rank: (shape with -1 at dim {dim}, dtype hash)): {shapes}; rank "
            f"{group.rank} has {x.dtype}"
        )
    return tuple(int(r[0]) for r in rows)


# -- reductions ---------------------------------------------------------------


def psum(
    x: torch.Tensor,
    axis: Axis,
    *,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Sum ``x`` over the ranks along ``axis``; every rank gets the sum.

    Backward: psum of the cotangent (see :mod:`shardax.collectives._ops`) —
    so a loss computed from the sum identically on every rank goes through
    :func:`count_once` before ``backward()``. ``out``/``async_op``: the
    return rule (:mod:`shardax.collectives`); ``out=x`` sums in place —
    reuse gradient buckets so: no fresh allocation, whose first-touch page
    faults cost as much as the copy on CPU.

    >>> import torch, shardax as sx
    >>> with sx.Mesh({"dp": -1}):
    ...     sx.collectives.psum(torch.ones(2), "dp")
    tensor([1., 1.])
    >>> buf = torch.ones(2)
    >>> sx.collectives.psum(buf, "dp", mesh=sx.Mesh({"dp": 1}), out=buf) is buf
    True
    """
    return _call(x, AllReduce(_group(axis, mesh, "psum"), "sum", out=out), async_op, out)


def pmean(
    x: torch.Tensor,
    axis: Axis,
    *,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Mean of ``x`` over the ranks along ``axis`` (floating dtypes).
    ``out``/``async_op``: the return rule (``out=x`` in place).

    >>> import torch, shardax as sx
    >>> sx.collectives.pmean(torch.tensor([2.0]), "dp", mesh=sx.Mesh({"dp": 1}))
    tensor([2.])
    """
    return _call(x, AllReduce(_group(axis, mesh, "pmean"), "mean", out=out), async_op, out)


def pmax(
    x: torch.Tensor,
    axis: Axis,
    *,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Elementwise maximum over the ranks along ``axis``. Its gradient goes to
    the ranks holding the maximum (split evenly between ties).
    ``out``/``async_op``: the return rule (``out=x`` in place).

    >>> import torch, shardax as sx
    >>> sx.collectives.pmax(torch.tensor([3, 1]), "dp", mesh=sx.Mesh({"dp": 1}))
    tensor([3, 1])
    """
    op = AllReduce(_group(axis, mesh, "pmax"), "max", out=out)
    return _call(x, op, async_op, out, grad=_Extremum)


def pmin(
    x: torch.Tensor,
    axis: Axis,
    *,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Elementwise minimum over the ranks along ``axis`` (gradient as
    :func:`pmax`). ``out``/``async_op``: the return rule (``out=x`` in place).

    >>> import torch, shardax as sx
    >>> sx.collectives.pmin(torch.tensor([3, 1]), "dp", mesh=sx.Mesh({"dp": 1}))
    tensor([3, 1])
    """
    op = AllReduce(_group(axis, mesh, "pmin"), "min", out=out)
    return _call(x, op, async_op, out, grad=_Extremum)


# -- layout-changing collectives ------------------------------------------------


def all_gather(
    x: torch.Tensor,
    axis: Axis,
    dim: int = 0,
    *,
    tiled: bool = True,
    sizes: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Concatenate the pieces of the ranks along ``axis`` on ``dim`` (in
    member order); with ``tiled=False``, stack them on a new dim ``dim``.

    Pieces may have different lengths along ``dim`` (empty ones too). Unless
    ``sizes`` (every member's length) is given, the lengths are exchanged
    first — one tiny extra, blocking collective, which also checks that the
    ranks agree on dtype and the other dims; pass ``sizes`` for a fully
    asynchronous ``async_op=True`` (they are then trusted). Backward:
    psum_scatter (ZeRO-3 gathers parameters so, and scatters their gradients
    back: Rajbhandari et al., 2020).

    ``out``/``async_op``: the return rule (:mod:`shardax.collectives`) —
    ``out`` a reused parameter buffer, say. With even pieces on dim 0 (or
    after dims of size 1) the backend writes straight into it; otherwise
    the pieces go through a buffer first.

    >>> import torch, shardax as sx
    >>> with sx.Mesh({"dp": 1}):
    ...     sx.collectives.all_gather(torch.arange(3), "dp"), sx.collectives.all_gather(torch.arange(3), "dp", tiled=False)
    (tensor([0, 1, 2]), tensor([[0, 1, 2]]))
    >>> full = torch.empty(3, dtype=torch.int64)
    >>> sx.collectives.all_gather(torch.arange(3), "dp", mesh=sx.Mesh({"dp": 1}), out=full) is full
    True
    """
    group = _group(axis, mesh, "all_gather")
    if not tiled:
        if not -x.dim() - 1 <= dim <= x.dim():
            raise CollectiveError(
                f"all_gather(tiled=False): dim {dim} is out of range for a new dim of a tensor "
                f"of shape {tuple(x.shape)}"
            )
        x = x.unsqueeze(dim)
        dim, sizes = _dim(x, dim, "all_gather"), (1,) * group.size
    else:
        dim = _dim(x, dim, "all_gather")
    if sizes is None:
        sizes = _exchange(x, dim, group, "all_gather") if group.size > 1 else (x.size(dim),)
    if len(sizes) != group.size:
        raise CollectiveError(
            f"all_gather over {group.label}: {len(sizes)} sizes for {group.size} members"
        )
    return _call(x, AllGather(group, dim, tuple(sizes), out=out), async_op, out)


def psum_scatter(
    x: torch.Tensor,
    axis: Axis,
    dim: int = 0,
    *,
    tiled: bool = True,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Sum over the ranks along ``axis`` and keep this rank's piece of ``dim``
    (torch.chunk pieces: later ranks may get less, or nothing). With
    ``tiled=False`` ``dim`` must have one entry per rank and is removed.
    Backward: all_gather. ZeRO-2/3 reduce gradients so (Rajbhandari et al., 2020).

    ``out``/``async_op``: the return rule (:mod:`shardax.collectives`) —
    ``out`` of this rank's piece's shape (a reused gradient shard, say).
    When the piece is a longest one on dim 0 (or after dims of size 1) the
    backend writes straight into it; otherwise through a buffer first.

    >>> import torch, shardax as sx
    >>> sx.collectives.psum_scatter(torch.arange(4.0), "dp", mesh=sx.Mesh({"dp": 1}))
    tensor([0., 1., 2., 3.])
    >>> piece = torch.empty(4)
    >>> sx.collectives.psum_scatter(torch.ones(4), "dp", mesh=sx.Mesh({"dp": 1}), out=piece)
    tensor([1., 1., 1., 1.])
    """
    group = _group(axis, mesh, "psum_scatter")
    dim = _dim(x, dim, "psum_scatter")
    if tiled:
        op = ReduceScatter(group, dim, chunk_sizes(x.size(dim), group.size), out=out)
        return _call(x, op, async_op, out)
    if x.size(dim) != group.size:
        raise CollectiveError(
            f"psum_scatter(tiled=False) over {group.label}: dim {dim} of shape {tuple(x.shape)} "
            f"must have one entry per rank ({group.size})"
        )
    piece = None
    if out is not None:  # checked as the result (dim removed), written as the piece (dim kept)
        _check_out("psum_scatter", group, x, out, x.shape[:dim] + x.shape[dim + 1 :])
        piece = out.unsqueeze(dim)
    op = ReduceScatter(group, dim, (1,) * group.size, out=piece)
    return _call(x, op, async_op, out, then=lambda y: y.squeeze(dim))


def all_to_all(
    x: torch.Tensor,
    axis: Axis,
    split_dim: int,
    concat_dim: int,
    *,
    concat_sizes: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Split ``split_dim`` into torch.chunk pieces, one per rank along
    ``axis``, send piece ``j`` to rank ``j`` and concatenate what arrives along
    ``concat_dim``. Ranks may hold different lengths of ``concat_dim``: they
    are exchanged first unless ``concat_sizes`` gives them. Backward: the
    all_to_all back. ``out``/``async_op``: the return rule
    (:mod:`shardax.collectives`); the pieces are concatenated into ``out``.

    >>> import torch, shardax as sx
    >>> sx.collectives.all_to_all(torch.ones(2, 3), "dp", 0, 1, mesh=sx.Mesh({"dp": 1})).shape
    torch.Size([2, 3])
    """
    group = _group(axis, mesh, "all_to_all")
    split_dim, concat_dim = _dim(x, split_dim, "all_to_all"), _dim(x, concat_dim, "all_to_all")
    if concat_sizes is None:
        if group.size > 1:
            concat_sizes = _exchange(x, concat_dim, group, "all_to_all")
        else:
            concat_sizes = (x.size(concat_dim),)
    split_sizes = chunk_sizes(x.size(split_dim), group.size)
    op = AllToAll(group, split_dim, concat_dim, split_sizes, tuple(concat_sizes), out=out)
    return _call(x, op, async_op, out)


def ppermute(
    x: torch.Tensor,
    axis: Axis,
    perm: Sequence[tuple[int, int]],
    *,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Send ``x`` from index ``src`` to index ``dst`` along ``axis`` for each
    ``(src, dst)`` in ``perm``; ranks that receive nothing get zeros.
    Backward: the inverse permutation. ``out``/``async_op``: the return rule
    (:mod:`shardax.collectives`); ``out`` receives (it cannot be ``x``,
    which is sent meanwhile).

    >>> import torch, shardax as sx
    >>> sx.collectives.ppermute(torch.ones(2), "pp", [(0, 0)], mesh=sx.Mesh({"pp": 1}))
    tensor([1., 1.])
    """
    group = _group(axis, mesh, "ppermute")
    pairs = tuple((int(s), int(d)) for s, d in perm)
    return _call(x, Permute(group, pairs, out=out), async_op, out)


def broadcast(
    x: torch.Tensor,
    axis: Axis,
    *,
    src: int = 0,
    mesh: Mesh | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Every rank along ``axis`` gets the tensor of the rank at index ``src``
    (all ranks pass a tensor of the same shape and dtype). Backward: the sum
    of the cotangents, on ``src``. ``out``/``async_op``: the return rule
    (:mod:`shardax.collectives`; ``out=x`` in place).

    >>> import torch, shardax as sx
    >>> sx.collectives.broadcast(torch.ones(2), "dp", mesh=sx.Mesh({"dp": 1}))
    tensor([1., 1.])
    """
    group = _group(axis, mesh, "broadcast")
    if not 0 <= src < group.size:
        raise CollectiveError(
            f"broadcast over {group.label}: src {src} is not in 0..{group.size - 1}"
        )
    return _call(x, Broadcast(group, src, out=out), async_op, out)


class _CountOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Collective.apply(g, Mask(ctx.group), None), None


def count_once(
    x: torch.Tensor, axis: Axis | None = None, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Declare that ``x`` is identical on every rank along ``axis`` (all axes
    when None), so that its gradient is counted once, not once per rank.

    Returns ``x`` unchanged; backward keeps the cotangent on the rank at index
    0 and gives the others zeros. shardax's gradients are contributions that
    sum over ranks (see :mod:`shardax.collectives._ops`), so a loss that every
    rank computes identically — after ``psum``/``pmean``/``all_gather``, or in
    tensor-parallel regions — must pass through ``count_once`` before
    ``.backward()``; otherwise its gradient is multiplied by the number of ranks.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": -1})
    >>> w = torch.ones(3, requires_grad=True)
    >>> total = sx.collectives.psum(w.sum(), "dp", mesh=mesh)   # the same on every rank
    >>> sx.collectives.count_once(total, mesh=mesh).backward()
    >>> w.grad
    tensor([1., 1., 1.])
    """
    return _CountOnce.apply(x, _group(axis, mesh, "count_once"))


# -- indices and synchronization -----------------------------------------------


def axis_index(axis: Axis, *, mesh: Mesh | None = None) -> int:
    """This rank's index along ``axis`` (a tuple: mixed radix, first major).

    >>> import shardax as sx
    >>> sx.collectives.axis_index("dp", mesh=sx.Mesh({"dp": 1}))
    0
    """
    m = _resolve_mesh(mesh, "axis_index")
    return m.axis_index(axis)


def axis_size(axis: Axis, *, mesh: Mesh | None = None) -> int:
    """Number of ranks along ``axis``.

    >>> import shardax as sx
    >>> sx.collectives.axis_size("dp", mesh=sx.Mesh({"dp": 1}))
    1
    """
    return _resolve_mesh(mesh, "axis_size").size(axis)


def barrier(axis: Axis | None = None, *, mesh: Mesh | None = None) -> None:
    """Wait until every rank along ``axis`` (all axes when None) arrives.

    >>> import shardax as sx
    >>> sx.collectives.barrier(mesh=sx.Mesh({"dp": 1}))
    """
    group = _group(axis, mesh, "barrier")
    if group.size > 1:
        start(group, "barrier", lambda b: b.barrier(group), lambda: None).wait()
