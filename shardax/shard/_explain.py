"""``explain``: the sharding plan of a pytree as a table — every leaf, its
spec, its local shape and its bytes on each rank. Works on ``AbstractMesh``
and meta tensors: plan a 405B model on 16,384 ranks on a laptop.

Its cost grows with the leaves and the mesh's axes, not with its ranks: a
leaf's per-rank element counts are kept factored (:class:`_Counts`: a
constant times, per unevenly split dim, the piece lengths over that dim's
axes), sums of them per set of axes they vary over, and each total is laid
out over the rank grid once, with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from ..mesh._mesh import AbstractMesh
from ._api import layouts_for, rules_for_tree
from ._layout import Layout
from ._matching import Rules
from ._placement import Placement
from ._sharded import Sharded
from ._spec import piece_array

__all__ = ["Explanation", "Row", "explain", "format_bytes"]


def format_bytes(n: float) -> str:
    """Bytes for people.

    >>> format_bytes(512), format_bytes(3 * 2**20), format_bytes(1.5 * 2**40)
    ('512 B', '3.0 MiB', '1.5 TiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


_Table = dict[tuple[int, ...], Any]
"""Per-rank values as a sum of arrays, each over a few mesh axes (their
positions, ascending) and constant along the others; ``()`` holds a scalar."""


@attrs.frozen(eq=False)
class _Counts:
    """The local element count of every rank, for one global shape under one
    layout, factored: ``const`` times the product of ``factors``, each the
    piece lengths of one unevenly split dim over its mesh axes (positions in
    the mesh, ascending, and an array with one dimension per axis). A mesh
    axis splits one dim at most, so the factors vary over disjoint axes."""

    const: int
    factors: tuple[tuple[tuple[int, ...], np.ndarray], ...]

    @property
    def uneven(self) -> bool:
        # Non-constant factors over disjoint axes: their product varies unless it is zero.
        return self.const != 0 and bool(self.factors)

    def min(self) -> int:
        return self.const * math.prod(int(values.min()) for _, values in self.factors)

    def max(self) -> int:
        return self.const * math.prod(int(values.max()) for _, values in self.factors)

    def table(self, scale: int) -> tuple[tuple[int, ...], np.ndarray]:
        """``scale`` times the counts over the axes they vary over: the
        factors' outer product."""
        axes = tuple(sorted(i for at, _ in self.factors for i in at))
        out = np.array(self.const * scale, dtype=np.int64)
        for at, values in self.factors:
            view = [1] * len(axes)
            for i, n in zip(at, values.shape, strict=True):
                view[axes.index(i)] = n
            out = out * values.reshape(view)
        return axes, out


def _counts(layout: Layout, shape: tuple[int, ...]) -> _Counts:
    """Every rank's element count of a tensor of ``shape`` under ``layout``,
    factored; O(pieces of the uneven dims), not O(ranks)."""
    shape, layout = layout.expand(shape)  # a blocked dim: k blocks, each split
    mesh = layout.mesh
    const, factors = 1, []
    for length, axes in zip(shape, layout.dim_axes(len(shape)), strict=True):
        if not axes:
            const *= length
            continue
        pieces = piece_array(length, [mesh.size(a) for a in axes])
        if pieces.min() == pieces.max():  # split evenly
            const *= int(pieces.flat[0])
            continue
        at = [mesh.axis_names.index(a) for a in axes]
        factors.append((tuple(sorted(at)), pieces.transpose(np.argsort(at))))
    return _Counts(const, tuple(factors))


def _add(table: _Table, counts: _Counts, scale: int) -> None:
    axes, values = counts.table(scale)
    table[axes] = table[axes] + values if axes in table else values


def _over_ranks(table: _Table, mesh: AbstractMesh) -> np.ndarray:
    """The table's values for every rank (flat, rank order)."""
    grid = np.zeros(mesh.axis_sizes, dtype=np.int64)
    for axes, values in table.items():
        view = [1] * len(mesh.axis_sizes)
        for i, n in zip(axes, np.shape(values), strict=True):
            view[i] = n
        grid += np.reshape(values, view)
    return grid.reshape(-1)


_ARRAYS = attrs.cmp_using(eq=np.array_equal)


@attrs.frozen
class Row:
    """One leaf of the plan. Its bytes on each rank (:attr:`rank_bytes`)
    are built when asked for, from the factored counts it keeps."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    local_shape: tuple[int, ...]
    _counts: _Counts = attrs.field(eq=False, repr=False)  # a function of the fields above

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        """The bytes of this leaf on each rank, in rank order."""
        table: _Table = {}
        _add(table, self._counts, self.dtype.itemsize)
        return tuple(_over_ranks(table, self.layout.mesh).tolist())

    @property
    def uneven(self) -> bool:
        """Whether some ranks hold more of it than others."""
        return self._counts.uneven

    def _bytes_range(self) -> tuple[int, int]:
        size = self.dtype.itemsize
        return self._counts.min() * size, self._counts.max() * size


@attrs.frozen
class Explanation:
    """The table ``explain`` returns; ``str()`` renders it. :attr:`rank_bytes`
    and :attr:`roles` hold one number per rank, built when asked for."""

    mesh: AbstractMesh
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = ()  # what module rules say of themselves (experts per rank, …)
    _totals: np.ndarray = attrs.field(kw_only=True, eq=_ARRAYS, hash=False, repr=False)
    _role_names: tuple[str, ...] = attrs.field(kw_only=True)
    _role_totals: np.ndarray = attrs.field(kw_only=True, eq=_ARRAYS, hash=False, repr=False)

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        """Total bytes held by each rank."""
        return tuple(self._totals.tolist())

    @property
    def roles(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(role, bytes on each rank)`` of the training state, with rules:
        ``params``, ``grads``, ``opt_state``; a role offloaded elsewhere
        than the device is named with its memory kind (``opt_state (host)``)."""
        per_role = self._role_totals.tolist()
        return tuple((role, tuple(b)) for role, b in zip(self._role_names, per_role, strict=True))

    @property
    def global_bytes(self) -> int:
        return sum(int(np.prod(r.shape, dtype=np.int64)) * r.dtype.itemsize for r in self.rows)

    def __str__(self) -> str:
        head = ("path", "shape", "dtype", "spec", "local shape", "bytes/rank")
        body = []
        for r in self.rows:
            spec = repr(r.layout.spec) + (
                f" partial={r.layout.partial!r}" if r.layout.partial else ""
            )
            lo, hi = r._bytes_range()
            size = format_bytes(hi) if lo == hi else f"{format_bytes(lo)}..{format_bytes(hi)}"
            local = str(r.local_shape) + (" (uneven)" if r.uneven else "")
            body.append(
                (
                    r.path or "<root>",
                    str(r.shape),
                    str(r.dtype).removeprefix("torch."),
                    spec,
                    local,
                    size,
                )
            )
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [
            f"{self.mesh!r}: {len(self.rows)} tensors, {format_bytes(self.global_bytes)} in all"
        ]
        lines += [fmt.format(*head).rstrip(), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*b).rstrip() for b in body]
        per = self._totals
        if per.min() == per.max():
            lines.append(f"per rank: {format_bytes(int(per[0]))} on each of {len(per)} ranks")
        elif len(per) <= 8:
            lines.append(
                "per rank: "
                + ", ".join(f"{i}: {format_bytes(b)}" for i, b in enumerate(per.tolist()))
            )
        else:
            lines.append(
                f"per rank: max {format_bytes(int(per.max()))} (rank {int(np.argmax(per))}), "
                f"min {format_bytes(int(per.min()))} (rank {int(np.argmin(per))}), "
                f"mean {format_bytes(int(per.sum()) / len(per))}"
            )
        if self._role_names:
            parts = [
                f"{role} {format_bytes(int(b.max()))}"
                for role, b in zip(self._role_names, self._role_totals, strict=True)
            ]
            total = int(self._role_totals.sum(axis=0).max())
            lines.append(
                "training state per rank (max): "
                + ", ".join(parts)
                + f"; {format_bytes(total)} in all"
            )
            kinds: dict[str, Any] = {}
            for role, b in zip(self._role_names, self._role_totals, strict=True):
                kind = role.partition(" (")[2].rstrip(")") or "device"
                kinds[kind] = kinds.get(kind, 0) + b
            if len(kinds) > 1:
                lines.append(
                    "by memory kind per rank (max): "
                    + ", ".join(f"{k} {format_bytes(int(np.max(b)))}" for k, b in kinds.items())
                )
        lines += self.notes
        return "\n".join(lines)


def explain(
    tree: Any,
    mesh: AbstractMesh,
    specs: Any = None,
    *,
    opt_state_bytes: int | Callable[[str, tuple[int, ...]], int] = 8,
) -> Explanation:
    """The sharding plan of ``tree`` on ``mesh`` under ``specs`` (as for
    :func:`shardax.shard`; None keeps ``Sharded`` leaves' own layouts and
    replicates tensors). Leaves may be meta tensors; the mesh may be abstract,
    and large: the cost grows with the leaves and the mesh's axes, not its
    ranks (Llama-3-405B's 1139 tensors on 16,384 ranks: a tenth of a second,
    ``benchmarks/explain.py``).

    With rules, it also sums each rank's training state by role: params,
    grads (same dtype as the params) and optimizer state at
    ``opt_state_bytes`` per element (8: Adam's two fp32 moments; or a
    function ``(path, shape) -> bytes``, as :func:`shardax.optim.muon_state_bytes`
    for Muon's 4 on matrices) — the ZeRO arithmetic of each stage:

    >>> import torch, shardax as sx
    >>> w = {"w": torch.empty(1024, 256, device="meta")}
    >>> for stage in range(4):
    ...     print(str(sx.explain(w, sx.AbstractMesh({"dp": 4}), sx.rules.zero(stage))).splitlines()[-1])
    training state per rank (max): params 1.0 MiB, grads 1.0 MiB, opt_state 2.0 MiB; 4.0 MiB in all
    training state per rank (max): params 1.0 MiB, grads 1.0 MiB, opt_state 512.0 KiB; 2.5 MiB in all
    training state per rank (max): params 1.0 MiB, grads 256.0 KiB, opt_state 512.0 KiB; 1.8 MiB in all
    training state per rank (max): params 256.0 KiB, grads 256.0 KiB, opt_state 512.0 KiB; 1.0 MiB in all

    >>> import torch, shardax as sx
    >>> params = {"emb": torch.empty(50, 16, device="meta"), "head": torch.empty(16, device="meta")}
    >>> print(sx.explain(params, sx.AbstractMesh({"dp": 4}), sx.Rule("emb", sx.P("dp"))))
    AbstractMesh({'dp': 4}): 2 tensors, 3.2 KiB in all
    path  shape     dtype    spec     local shape        bytes/rank
    ----  --------  -------  -------  -----------------  ------------
    emb   (50, 16)  float32  P('dp')  (13, 16) (uneven)  704 B..832 B
    head  (16,)     float32  P()      (16,)              64 B
    per rank: 0: 896 B, 1: 896 B, 2: 896 B, 3: 768 B
    training state per rank (max): params 896 B, grads 896 B, opt_state 1.8 KiB; 3.5 KiB in all
    """
    if specs is None:
        leaves = [x for x in _leaves(tree)]
        specs_tree = [x.layout if isinstance(x, Sharded) else None for x in leaves]
        paths, leaves, _, layouts = layouts_for(tree, mesh, _rebuild_like(tree, specs_tree))
    else:
        paths, leaves, _, layouts = layouts_for(tree, mesh, specs)
    rules = rules_for_tree(specs, paths, leaves)
    placement = _placements(rules, mesh) if rules is not None else None
    counts: dict[tuple[Layout, tuple[int, ...]], tuple[tuple[int, ...], _Counts]] = {}

    def counted(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...], _Counts]:
        """Rank 0's local shape and every rank's counts, once per (layout, shape)."""
        key = (layout, shape)
        if key not in counts:
            counts[key] = (layout.local_shape(shape, 0), _counts(layout, shape))
        return counts[key]

    totals: _Table = {}
    roles: dict[str, _Table] = {}
    zeropp: dict[str, list[Any]] = {"int8": [], "secondary": [], "kept": []}
    rows = []
    for path, leaf, layout in zip(paths, leaves, layouts, strict=True):
        if layout is None:
            continue
        shape = tuple(leaf.shape)
        local_shape, numels = counted(layout, shape)
        _add(totals, numels, leaf.dtype.itemsize)
        if placement is not None:
            placed = placement(path, shape)
            for role, lay, size in (
                ("params", layout, leaf.dtype.itemsize),
                ("grads", placed.grads, leaf.dtype.itemsize),
                (
                    "opt_state",
                    placed.opt_state,
                    opt_state_bytes(path, shape) if callable(opt_state_bytes) else opt_state_bytes,
                ),
            ):
                kind = placed.memory_kind(role)  # rules.offload: on disk, in host memory
                key = role if kind == "device" else f"{role} ({kind})"
                _add(roles.setdefault(key, {}), counted(lay, shape)[1], size)
            if placed.secondary is not None:  # hpZ: held from forward to backward
                _add(roles.setdefault("secondary", {}), counted(placed.secondary, shape)[1],
                     leaf.dtype.itemsize)  # fmt: skip
                zeropp["secondary"].append(placed.secondary.spec.axes)
            if placed.keep_gathered:  # gathered once, held from forward to backward
                _add(roles.setdefault(KEPT, {}), counted(placed.compute, shape)[1],
                     leaf.dtype.itemsize)  # fmt: skip
                zeropp["kept"].append(path)
            if placed.weights == "int8":
                zeropp["int8"].append((math.prod(shape), leaf.dtype.itemsize))
        rows.append(Row(path, shape, leaf.dtype, layout, local_shape, numels))
    notes = _zeropp_notes(zeropp)
    if rules is not None:  # a module rule's forward may say what it does on this mesh
        tensors = {r.path: (r.shape, r.dtype.itemsize) for r in rows}
        for module_rule in rules.modules:
            for part in (module_rule.forward, module_rule.within):
                describe = getattr(part, "explain", None)
                if describe is not None:
                    notes += describe(module_rule.pattern, tensors, mesh)
    abstract = mesh.abstract
    return Explanation(
        abstract,
        tuple(rows),
        tuple(notes),
        totals=_over_ranks(totals, abstract),
        role_names=tuple(roles),
        role_totals=np.array(
            [_over_ranks(t, abstract) for t in roles.values()], dtype=np.int64
        ).reshape(len(roles), abstract.world_size),
    )


KEPT = "kept gathered"
"""The role ``explain`` counts ``keep_gathered``'s gathers under."""


def _zeropp_notes(zeropp: dict[str, list[Any]]) -> list[str]:
    """What ZeRO++'s options change, in words: the int8 gathers' bytes
    against the exact ones (qwZ), and backward's gathers from the secondary
    copy (hpZ)."""
    notes = []
    if zeropp["int8"]:
        exact = sum(n * size for n, size in zeropp["int8"])
        int8 = sum(n for n, _ in zeropp["int8"]) * (1 + 4 / 256)
        notes.append(
            f"ZeRO++ qwZ: {len(zeropp['int8'])} tensors gathered as int8 blocks (a byte a value, "
            f"4 B of scale per 256): about {format_bytes(int8)} per gather of them all, for "
            f"{format_bytes(exact)} exact"
        )
    if zeropp["kept"]:
        notes.append(
            f"keep_gathered: {len(zeropp['kept'])} tensors gathered once a step and held from "
            f"their forward to their backward ('{KEPT}' above: all of them at the end of the "
            "forward), not gathered again"
        )
    if zeropp["secondary"]:
        axes = sorted({a for axes_ in zeropp["secondary"] for a in axes_})
        notes.append(
            f"ZeRO++ hpZ: backward gathers {len(zeropp['secondary'])} tensors over {axes!r} only, "
            "from a secondary copy held from forward to backward (the 'secondary' above)"
        )
    return notes


def _placements(rules: Rules, mesh: AbstractMesh) -> Callable[[str, tuple[int, ...]], Placement]:
    """``rules.placement`` on ``mesh``, computed once per kind of leaf: a
    placement depends on a leaf's path only through which rule (the first),
    ``ShardOver`` and ``Offload`` entries match it (the path itself only
    names the leaf in errors), so the layers of a model share theirs."""
    cache: dict[Any, Placement] = {}

    def placement(path: str, shape: tuple[int, ...]) -> Placement:
        key = (
            next((i for i, rule in enumerate(rules.rules) if rule.matches(path)), None),
            tuple(over.matches(path) for over in rules.overs),
            tuple(offload.matches(path) for offload in rules.offloads),
            shape,
        )
        if key not in cache:
            cache[key] = rules.placement(path, shape, mesh)
        return cache[key]

    return placement


def _leaves(tree: Any) -> list[Any]:
    import optree

    return optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True)


def _rebuild_like(tree: Any, leaves: list[Any]) -> Any:
    import optree

    spec = optree.tree_structure(tree, is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True)
    return optree.tree_unflatten(spec, leaves)
