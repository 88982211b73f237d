"""Adafactor's factored second moments (Shazeer & Stern 2018), on shards.

For a leaf with two large dims, the second moment is kept as a row vector
and a column vector (means of ``g²`` over one dim each) instead of a full
matrix. On a Sharded leaf those means run over global dims: a local sum, a
psum over the axes that split the reduced dim, a division by its global
length. The row/column statistics live in the leaf's "opt_state" layout with
the reduced dim dropped, so they broadcast against the local shard.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..collectives._api import psum
from ..errors import ShardingError
from ..shard._layout import Layout
from ..shard._sharded import Sharded
from ..shard._spec import P
from ._base import (
    GradientTransformation,
    Leaf,
    expect_state,
    flatten,
    is_sharded,
    leaf_path,
    new_count,
    read_steps,
    role_layout,
    structure_error,
    transformation,
    validate,
)
from ._gradless import keep_gradless

__all__ = ["FactoredRmsState", "scale_by_factored_rms"]


class FactoredRmsState(NamedTuple):
    """State of :func:`scale_by_factored_rms`: the step counts (one 0-d
    int64 per leaf, advanced only where a gradient came, as
    ``torch.optim.Adafactor``'s per-parameter step); for factored leaves
    the row and column statistics (None in ``v``); for the others the full
    second moment (None in ``v_row``/``v_col``)."""

    count: Any
    v_row: Any
    v_col: Any
    v: Any


def factored_dims(
    shape: tuple[int, ...], factored: bool, min_dim_size_to_factor: int
) -> tuple[int, int] | None:
    """``(d1, d0)``: the second-largest and largest dims, or None when the
    leaf is not factored (fewer than 2 dims, or the second-largest too
    small)."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda d: shape[d])
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


def _stat_dtype(x: Leaf) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _dropped(x: Leaf, layout: Layout | None, dim: int) -> Leaf:
    """Zeros shaped like ``x`` without ``dim`` (in ``layout`` minus that dim)."""
    shape = tuple(s for d, s in enumerate(x.shape) if d != dim)
    if layout is None:
        return torch.zeros(shape, dtype=_stat_dtype(x), device=x.device)
    dim_axes = [a for d, a in enumerate(layout.dim_axes(len(x.shape))) if d != dim]
    small = Layout(layout.mesh, P.from_dim_axes(dim_axes))
    local = torch.zeros(
        small.local_shape(shape, layout.mesh.rank),  # type: ignore[attr-defined]
        dtype=_stat_dtype(x),
        device=x.device,
    )
    return Sharded(local, small, shape)


def _full_layout(v_row: Sharded, v_col: Sharded, d1: int, d0: int, ndim: int) -> Layout:
    """The leaf's layout, rebuilt from its row (no d0) and column (no d1)
    statistics."""
    row = list(v_row.layout.dim_axes(ndim - 1))
    full = [*row[:d0], v_col.layout.dim_axes(ndim - 1)[d0 if d0 < d1 else d0 - 1], *row[d0:]]
    return Layout(v_row.mesh, P.from_dim_axes(full))


def _mean(x: torch.Tensor, dim: int, axes: tuple[str, ...], mesh: Any, n: int) -> torch.Tensor:
    total = x.sum(dim, keepdim=True)
    if axes:
        total = psum(total, axes, mesh=mesh)
    return total / n


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
) -> GradientTransformation:
    """Scale by a factored estimate of the gradient's RMS, as in Adafactor
    (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear
    Memory Cost"): ``g / sqrt(v̂)`` with ``β̂₂ = 1 - t^(-decay_rate)``; a leaf
    whose two largest dims both reach ``min_dim_size_to_factor`` keeps only
    row and column means of ``g² + epsilon``. Statistics are kept in at
    least fp32.

    Args:
        factored: factor the second moment where the shape allows.
        decay_rate: the exponent of the ``β̂₂`` schedule.
        step_offset: subtracted from the step (for fine-tuning).
        min_dim_size_to_factor: factor only when the second-largest dim is
            at least this long.
        epsilon: added to ``g²``.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.scale_by_factored_rms(min_dim_size_to_factor=2)
    >>> state = opt.init(torch.zeros(2, 3))
    >>> state.v_row.shape, state.v_col.shape, state.v
    (torch.Size([2]), torch.Size([3]), None)
    >>> opt.update(torch.ones(2, 3), state)[0]
    tensor([[1., 1., 1.],
            [1., 1., 1.]])
    """
    decay_rate = validate("decay_rate", decay_rate)
    epsilon = validate("epsilon", epsilon)

    def dims(x: Leaf) -> tuple[int, int] | None:
        return factored_dims(tuple(x.shape), factored, min_dim_size_to_factor)

    def init(params: Any) -> FactoredRmsState:
        leaves, spec = flatten(params, "params")
        rows, cols, vs = [], [], []
        for x in leaves:
            layout = role_layout(x, "opt_state") if isinstance(x, Sharded) else None
            fd = dims(x)
            if fd is None:
                rows.append(None)
                cols.append(None)
                if layout is None:
                    vs.append(torch.zeros_like(x, dtype=_stat_dtype(x)))
                else:
                    zeros = torch.zeros(
                        layout.local_shape(x.shape, layout.mesh.rank),  # type: ignore[attr-defined]
                        dtype=_stat_dtype(x),
                        device=x.device,
                    )
                    vs.append(Sharded(zeros, layout, x.shape))
            else:
                d1, d0 = fd
                rows.append(_dropped(x, layout, d0))
                cols.append(_dropped(x, layout, d1))
                vs.append(None)

        def build(leaves: list[Any]) -> Any:
            return optree.tree_unflatten(spec, leaves)

        return FactoredRmsState(build([new_count() for _ in leaves]), build(rows), build(cols),
                                build(vs))  # fmt: skip

    def update(updates: Any, state: FactoredRmsState, params: Any = None) -> tuple[Any, Any]:
        expect_state(state, FactoredRmsState, what="scale_by_factored_rms")
        if isinstance(state.count, torch.Tensor):  # one count for every leaf (an older state)
            per_leaf = [
                None if r is None and v is None else state.count.clone()
                for r, v in zip(
                    optree.tree_leaves(state.v_row, none_is_leaf=True, is_leaf=is_sharded),
                    optree.tree_leaves(state.v, none_is_leaf=True, is_leaf=is_sharded),
                    strict=True,
                )
            ]
            spec = optree.tree_structure(state.v_row, none_is_leaf=True, is_leaf=is_sharded)
            if not spec.is_leaf():
                state = state._replace(count=optree.tree_unflatten(spec, per_leaf))
        return step(updates, state, params)

    @keep_gradless
    def step(updates: Any, state: FactoredRmsState, params: Any = None) -> tuple[Any, Any]:
        leaves, spec = flatten(updates, "updates")

        def up_to(tree: Any, what: str) -> list[Any]:
            try:
                return spec.flatten_up_to(tree)
            except ValueError:
                raise structure_error(tree, updates, what, "updates") from None

        rows, cols, vs, counts = (
            up_to(state.v_row, "state.v_row"),
            up_to(state.v_col, "state.v_col"),
            up_to(state.v, "state.v"),
            up_to(state.count, "state.count"),
        )
        out_u, out_r, out_c, out_v = [], [], [], []
        for i, (g, s) in enumerate(zip(leaves, read_steps(counts), strict=True)):
            t = s - step_offset + 1  # this leaf's step
            decay = 1.0 - float(t) ** (-decay_rate) if t > 0 else 0.0
            path = lambda i=i: leaf_path(updates, i)  # noqa: E731
            u, r, c, v = _update_leaf(g, rows[i], cols[i], vs[i], dims(g), decay, epsilon, path)
            out_u.append(u)
            out_r.append(r)
            out_c.append(c)
            out_v.append(v)
        new = FactoredRmsState(
            optree.tree_unflatten(spec, torch._foreach_add(counts, 1) if counts else []),
            optree.tree_unflatten(spec, out_r),
            optree.tree_unflatten(spec, out_c),
            optree.tree_unflatten(spec, out_v),
        )
        return optree.tree_unflatten(spec, out_u), new

    return transformation(init, update, own_none=True)


def _check_kind(g: Leaf, stat: Any, path: Any, what: str) -> None:
    if stat is None or is_sharded(stat) != is_sharded(g):
        raise ShardingError(
            f"updates leaf {path()!r} does not match its Adafactor {what} statistic "
            f"({type(stat).__name__}); pass the tree the optimizer was initialized for"
        )


def _update_leaf(
    g: Leaf, v_row: Any, v_col: Any, v: Any, fd: Any, decay: float, eps: float, path: Any
) -> tuple[Leaf, Any, Any, Any]:
    if fd is None:
        _check_kind(g, v, path, "second-moment")
        if is_sharded(g) and g.layout != v.layout:
            from ..shard._transfer import transfer

            g = transfer(g, v.layout)
        gl = g.local if is_sharded(g) else g
        vl = v.local if is_sharded(v) else v
        g2 = gl.to(vl.dtype).square().add_(eps)
        new_v = vl.mul(decay).add_(g2, alpha=1.0 - decay)
        u = gl.to(vl.dtype) * new_v.rsqrt()
        if is_sharded(v):
            return v.with_local(u), None, None, v.with_local(new_v)
        return u, None, None, new_v
    d1, d0 = fd
    _check_kind(g, v_row, path, "row")
    _check_kind(g, v_col, path, "column")
    ndim = len(g.shape)
    if is_sharded(g):
        layout = _full_layout(v_row, v_col, d1, d0, ndim)
        if g.layout != layout:
            from ..shard._transfer import transfer

            g = transfer(g, layout)
        mesh, dim_axes = layout.mesh, layout.dim_axes(ndim)
        gl, rl, cl = g.local, v_row.local, v_col.local
    else:
        mesh, dim_axes = None, ((),) * ndim
        gl, rl, cl = g, v_row, v_col
    shape = tuple(g.shape)
    g2 = gl.to(rl.dtype).square().add_(eps)
    row = _mean(g2, d0, dim_axes[d0], mesh, shape[d0]).squeeze(d0)
    col = _mean(g2, d1, dim_axes[d1], mesh, shape[d1]).squeeze(d1)
    new_r = rl.mul(decay).add_(row, alpha=1.0 - decay)
    new_c = cl.mul(decay).add_(col, alpha=1.0 - decay)
    rd1 = d1 - 1 if d1 > d0 else d1
    row_col_mean = _mean(new_r, rd1, dim_axes[d1], mesh, shape[d1])
    row_factor = (new_r / row_col_mean).rsqrt()
    col_factor = new_c.rsqrt()
    u = gl.to(rl.dtype) * row_factor.unsqueeze(d0) * col_factor.unsqueeze(d1)
    if is_sharded(g):
        return g.with_local(u), v_row.with_local(new_r), v_col.with_local(new_c), None
    return u, new_r, new_c, None
