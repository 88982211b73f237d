"""The relayout planner: the collectives that take a tensor from one layout to
another, as data.

The plan is a pure function of the two layouts and the global shape (never of
the values), so every rank computes the same plan and issues the same
collectives in the same order. Greedy, cheapest first:

1. ``slice``        replicated → sharded (local, shrinks the data);
2. ``psum_scatter`` partial → sharded;
3. ``all_to_all``   sharded on one dim → sharded on another, same axes;
4. ``psum``         partial → replicated, where the target is replicated;
5. ``pad`` / ``mask`` sharded or replicated → partial (local);
6. ``all_gather``   sharded → replicated, for axes in the wrong place;
7. ``psum``         any partial axis still left.

A diverged value (each rank its own copy: its whole value their mean) is
first made partial where the target is not diverged: the ``mean`` step, a
local scale by ``1 / size`` (:func:`settle`).

Consecutive axes that take the same step on the same dim go in one
collective. Between different meshes the tensor is reduced, sent piece by
piece with one all-to-all by box intersection (``redistribute``), then made
partial where asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import ShardingError
from ._layout import Layout
from ._spec import Blocks, P

__all__ = ["Plan", "Step", "legs", "plan_transfer", "settle"]

KINDS = ("slice", "psum_scatter", "all_to_all", "psum", "pad", "mask", "all_gather", "redistribute",
         "mean")  # fmt: skip


@attrs.frozen
class Step:
    """One collective of a plan.

    ``dim`` is the dim it splits, gathers, pads or scatters; for
    ``all_to_all`` it is the dim whose axes move away (concatenated) and
    ``to_dim`` the dim they move to (split).
    """

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    axes: tuple[str, ...] = ()
    dim: int | None = None
    to_dim: int | None = None

    def __str__(self) -> str:
        axes = ", ".join(repr(a) for a in self.axes)
        if self.kind == "all_to_all":
            return f"all_to_all over ({axes}): dim {self.dim} -> dim {self.to_dim}"
        if self.kind in ("psum", "mask"):
            return f"{self.kind} over ({axes})"
        if self.kind == "mean":
            return f"mean over ({axes}): each copy scaled by 1/size, then summed as partial"
        if self.kind == "redistribute":
            return "redistribute (all-to-all by box intersection)"
        return f"{self.kind} over ({axes}) on dim {self.dim}"


@attrs.frozen
class Plan:
    """The steps from ``src`` to ``dst`` for ``shape``: ``layouts[i]`` is the
    layout before ``steps[i]``, ``layouts[-1]`` is ``dst`` (a plan through
    blocked dims, moved in expanded ``views``, keeps only the two ends).

    >>> from shardax import AbstractMesh, P
    >>> mesh = AbstractMesh({"x": 2, "y": 2})
    >>> print(plan_transfer(Layout(mesh, P("x", "y")), Layout(mesh, P("y", "x")), (4, 4)))
    P('x', 'y') -> P('y', 'x') for shape (4, 4):
      all_gather over ('x') on dim 0
      all_to_all over ('y'): dim 1 -> dim 0
      slice over ('x') on dim 1
    """

    shape: tuple[int, ...]
    steps: tuple[Step, ...]
    layouts: tuple[Layout, ...]
    views: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """Where blocked dims are moved in an expanded view: ``(first step,
    view shape)`` per leg (:func:`legs`); a step's dims are the view's."""

    @property
    def src(self) -> Layout:
        return self.layouts[0]

    @property
    def dst(self) -> Layout:
        return self.layouts[-1]

    def __str__(self) -> str:
        def name(layout: Layout) -> str:
            tail = f" partial={layout.partial!r}" if layout.partial else ""
            tail += f" diverged={layout.diverged!r}" if layout.diverged else ""
            return f"{layout.spec!r}{tail}"

        head = f"{name(self.src)} -> {name(self.dst)} for shape {self.shape}:"
        starts = dict(self.views)
        body = []
        for i, step in enumerate(self.steps):
            if i in starts:
                view = starts[i]
                body.append(
                    f"  in the view {view} (each block its own dim):"
                    if view != self.shape
                    else "  then in the shape itself:"
                )
            body.append(f"  {'  ' if self.views else ''}{step}")
        return "\n".join([head, *(body or ["  (nothing to do)"])])


class _State:
    """Dims' axes and partial axes while planning."""

    def __init__(self, src: Layout, dst: Layout, ndim: int) -> None:
        self.mesh = src.mesh
        self.cur = [list(t) for t in src.dim_axes(ndim)]
        self.part = set(src.partial)
        self.goal = [list(t) for t in dst.dim_axes(ndim)]
        self.gpart = set(dst.partial)

    def layout(self) -> Layout:
        return Layout(self.mesh, P.from_dim_axes(self.cur), partial=self.part)

    def done(self) -> bool:
        return self.cur == self.goal and self.part == self.gpart

    def ready(self, d: int) -> bool:
        return self.cur[d] == self.goal[d][: len(self.cur[d])]

    def placed(self, a: str) -> bool:
        return any(a in axes for axes in self.cur)

    def free(self, a: str) -> bool:
        return not self.placed(a) and a not in self.part

    def goal_dim(self, a: str) -> int | None:
        return next((d for d, axes in enumerate(self.goal) if a in axes), None)

    def common(self, d: int) -> int:
        """Length of the common prefix of dim ``d``'s axes and its target's."""
        k = 0
        while k < min(len(self.cur[d]), len(self.goal[d])) and self.cur[d][k] == self.goal[d][k]:
            k += 1
        return k

    def wanted(self, d: int) -> list[str]:
        return self.goal[d][len(self.cur[d]) :]


def _take_while(axes: Sequence[str], ok: object) -> tuple[str, ...]:
    out = []
    for a in axes:
        if not ok(a):  # type: ignore[operator]
            break
        out.append(a)
    return tuple(out)


def _next_step(s: _State) -> Step:
    n = len(s.cur)
    ready = [d for d in range(n) if s.ready(d)]
    # 1. slice: replicated axes the target splits next.
    for d in ready:
        axes = _take_while(s.wanted(d), s.free)
        if axes:
            return Step("slice", axes, d)
    # 2. psum_scatter: partial axes the target splits next.
    for d in ready:
        axes = _take_while(s.wanted(d), lambda a: a in s.part and a not in s.gpart)
        if axes:
            return Step("psum_scatter", axes, d)
    # 3. all_to_all: a tail of a dim's axes that another dim wants next.
    for d in range(n):
        if s.ready(d):
            continue
        for j in range(s.common(d), len(s.cur[d])):
            tail = s.cur[d][j:]
            for e in ready:
                if e != d and s.wanted(e)[: len(tail)] == tail:
                    return Step("all_to_all", tuple(tail), d, e)
    # 4. psum: partial axes the target replicates.
    axes = tuple(a for a in s.mesh.axis_names if a in s.part - s.gpart and s.goal_dim(a) is None)
    if axes:
        return Step("psum", axes)
    # 5. mask / pad: axes the target wants partial.
    axes = tuple(a for a in s.mesh.axis_names if a in s.gpart - s.part and s.free(a))
    if axes:
        return Step("mask", axes)
    for d in range(n):
        tail = tuple(reversed(_take_while(reversed(s.cur[d]), lambda a: a in s.gpart)))
        if tail:
            return Step("pad", tail, d)
    # 6. all_gather: axes in the wrong place.
    for d in range(n):
        if not s.ready(d):
            return Step("all_gather", tuple(s.cur[d][s.common(d) :]), d)
    # 7. psum: whatever partial axis is left.
    axes = tuple(a for a in s.mesh.axis_names if a in s.part - s.gpart)
    if axes:
        return Step("psum", axes)
    raise AssertionError("planner made no progress")  # pragma: no cover


def _apply(s: _State, step: Step) -> None:
    if step.kind == "slice":
        s.cur[step.dim].extend(step.axes)  # type: ignore[index]
    elif step.kind == "psum_scatter":
        s.cur[step.dim].extend(step.axes)  # type: ignore[index]
        s.part -= set(step.axes)
    elif step.kind == "all_to_all":
        del s.cur[step.dim][-len(step.axes) :]  # type: ignore[index]
        s.cur[step.to_dim].extend(step.axes)  # type: ignore[index]
    elif step.kind == "psum":
        s.part -= set(step.axes)
    elif step.kind == "mask":
        s.part |= set(step.axes)
    elif step.kind == "pad":
        del s.cur[step.dim][-len(step.axes) :]  # type: ignore[index]
        s.part |= set(step.axes)
    elif step.kind == "all_gather":
        del s.cur[step.dim][-len(step.axes) :]  # type: ignore[index]


def _entries(layout: Layout, ndim: int) -> list[Any]:
    return list(layout.spec) + [None] * (ndim - len(layout.spec))


Leg = tuple[Layout, Layout, Layout, Layout, tuple[int, ...]]


def legs(src: Layout, dst: Layout, shape: tuple[int, ...]) -> list[Leg]:
    """A transfer involving blocked dims (:func:`shardax.blocks`) as
    transfers between plain layouts. Each leg is ``(a, b, a_x, b_x,
    shape_x)``: from ``a`` to ``b``, moved as from ``a_x`` to ``b_x`` in the
    expanded view of both (``shape_x``), where every piece is one box. A dim
    blocked on one end and split otherwise on the other (or blocked
    differently) meets at that dim replicated first: two legs. Without
    blocks: one leg, the transfer itself."""
    if not (src.spec.blocked or dst.spec.blocked):
        return [(src, dst, src, dst, shape)]
    ndim = len(shape)
    a, b = _entries(src, ndim), _entries(dst, ndim)
    ka, kb = src.spec.dim_blocks(ndim), dst.spec.dim_blocks(ndim)
    clash = [
        d for d in range(ndim)
        if ka[d] != kb[d] and not (ka[d] == 1 and a[d] is None) and not (kb[d] == 1 and b[d] is None)
    ]  # fmt: skip
    if clash:  # meet with those dims whole
        mid_entries = [None if d in clash else a[d] for d in range(ndim)]
        mid = Layout(src.mesh, P(*mid_entries), partial=src.partial)
        return legs(src, mid, shape) + legs(mid, dst, shape)
    ks = [max(x, y) for x, y in zip(ka, kb, strict=True)]
    expanded: list[int] = []
    for size, k in zip(shape, ks, strict=True):
        if size % k:
            raise ShardingError(
                f"a dim of {size} cannot be {k} equal blocks (shape {shape}, {src.spec!r} -> "
                f"{dst.spec!r})"
            )
        expanded += [k, size // k] if k > 1 else [size]

    def expand(layout: Layout, entries: list[Any]) -> Layout:
        out: list[Any] = []
        for entry, k in zip(entries, ks, strict=True):
            if k == 1:
                out.append(entry)
            else:
                out += [None, entry.axes if isinstance(entry, Blocks) else entry]
        return Layout(layout.mesh, P(*out), partial=layout.partial)

    return [(src, dst, expand(src, a), expand(dst, b), tuple(expanded))]


def plan_transfer(src: Layout, dst: Layout, shape: Sequence[int]) -> Plan:
    """The collectives that relayout a tensor of global ``shape`` from ``src``
    to ``dst`` (see the module docstring for the order).

    >>> from shardax import AbstractMesh, P
    >>> mesh = AbstractMesh({"dp": 4})
    >>> print(plan_transfer(Layout(mesh, P(), partial="dp"), Layout(mesh, P("dp")), (8,)))
    P() partial=('dp',) -> P('dp') for shape (8,):
      psum_scatter over ('dp') on dim 0
    """
    shape = src.sharding.check_shape(shape)
    dst.sharding.check_shape(shape)
    if src.diverged or dst.diverged:
        return _plan_diverged(src, dst, shape)
    if src.spec.blocked or dst.spec.blocked:  # planned in the expanded view (see legs)
        steps: list[Step] = []
        views: list[tuple[int, tuple[int, ...]]] = []
        for _, _, a, b, view in legs(src, dst, shape):
            views.append((len(steps), view))
            steps += plan_transfer(a, b, view).steps
        return Plan(shape, tuple(steps), (src, dst), tuple(views))
    if src.mesh.abstract != dst.mesh.abstract:
        return _plan_between_meshes(src, dst, shape)
    s = _State(src, dst, len(shape))
    steps, layouts = [], [src]
    for _ in range(4 * len(src.mesh.axis_names) + 4):
        if s.done():
            return Plan(shape, tuple(steps), (*layouts[:-1], dst))
        step = _next_step(s)
        _apply(s, step)
        steps.append(step)
        layouts.append(s.layout())
    raise ShardingError(f"no plan from {src!r} to {dst!r} for shape {shape}")  # pragma: no cover


def settle(src: Layout, dst: Layout) -> tuple[Layout, Layout, tuple[str, ...]]:
    """``(src', dst', mean)``: the layouts a plan moves between once the
    axes over which ``src`` is diverged and ``dst`` is not (``mean``) are
    made partial (after a local scale by ``1 / their size``: the ``mean`` step), and the axes diverged in both are
    left out (nothing moves over them: each rank keeps its own copy)."""
    if not src.diverged and not dst.diverged:
        return src, dst, ()
    wrong = [a for a in dst.diverged if a not in src.diverged and a not in src.replicated]
    if wrong:
        raise ShardingError(
            f"cannot transfer {src!r} to {dst!r}: a value becomes diverged over {wrong!r} only "
            "from a replica there (each rank's copy its own), not from a split or a pending "
            "sum; transfer it to a layout replicated over those axes first"
        )
    mean = tuple(a for a in src.diverged if a not in dst.diverged)
    return (
        Layout(src.sharding, partial=src.partial + mean),
        Layout(dst.sharding, partial=dst.partial),
        mean,
    )


def _plan_diverged(src: Layout, dst: Layout, shape: tuple[int, ...]) -> Plan:
    """A plan from or to a diverged layout: the ``mean`` step where the
    copies are averaged, then the plan between the layouts :func:`settle`
    gives (the axes diverged at both ends kept in the layouts between)."""
    a, b, mean = settle(src, dst)
    sub = plan_transfer(a, b, shape)
    head = (Step("mean", mean),) if mean else ()
    if sub.views:
        views = tuple((i + len(head), view) for i, view in sub.views)
        return Plan(shape, head + sub.steps, (src, dst), views)
    kept = tuple(x for x in src.diverged if x in dst.diverged)
    middle = [Layout(x.sharding, partial=x.partial, diverged=kept) for x in sub.layouts[:-1]]
    return Plan(shape, head + sub.steps, (src, *middle[0 if mean else 1 :], dst))


def _plan_between_meshes(src: Layout, dst: Layout, shape: tuple[int, ...]) -> Plan:
    if src.mesh.world_size != dst.mesh.world_size:
        raise ShardingError(
            f"cannot transfer between {src.mesh!r} and {dst.mesh!r}: they span different numbers "
            "of ranks (a live transfer needs both meshes over the same job; reshard a checkpoint "
            "offline to change the world size)"
        )
    steps: list[Step] = []
    layouts = [src]
    if src.partial:
        steps.append(Step("psum", src.partial))
        layouts.append(Layout(src.sharding))
    plain_dst = Layout(dst.sharding)
    steps.append(Step("redistribute"))
    layouts.append(plain_dst)
    if dst.partial:
        steps.append(Step("mask", dst.partial))
        layouts.append(dst)
    return Plan(shape, tuple(steps), (*layouts[:-1], dst))
