"""``shard``, ``gather``, ``reshard``: pytrees of dense tensors ↔ pytrees of
``Sharded`` leaves."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import optree
import torch

from .._tree import flatten_with_paths
from ..errors import ShardingError, UnmatchedRulesWarning, UnshardedWeightWarning
from ..mesh._mesh import AbstractMesh, Mesh
from ._layout import Layout
from ._matching import Rules, as_rules, fit_spec
from ._memory import placed
from ._sharded import Sharded
from ._spec import NamedSharding, P, PartitionSpec
from ._transfer import transfer

__all__ = ["as_rules", "gather", "layouts_for", "reshard", "shard"]

_TARGETS = (PartitionSpec, Layout, NamedSharding)


def _is_target(x: Any) -> bool:
    return x is None or isinstance(x, _TARGETS)


def _leaf_layout(
    target: Any,
    path: str,
    shape: tuple[int, ...],
    mesh: AbstractMesh,
    rules: Rules | None,
    role: str = "params",
) -> Layout:
    if rules is not None:
        return Layout(mesh, rules.spec_for(path, shape, mesh, role))
    if target is None:
        return Layout(mesh, P())
    if isinstance(target, PartitionSpec):
        spec = P() if len(shape) == 0 else fit_spec(target, shape, mesh, path=path)
        return Layout(mesh, spec)
    layout = target if isinstance(target, Layout) else Layout(target)
    fit_spec(layout.spec, shape, layout.mesh, path=path)
    return layout


def layouts_for(
    tree: Any, mesh: AbstractMesh, specs: Any, role: str = "params"
) -> tuple[list[str], list[Any], Any, list[Layout | None]]:
    """``(paths, leaves, treespec, layouts)``: the layout each tensor leaf of
    ``tree`` gets (None for leaves that are not tensors).

    ``specs`` is a :class:`Rule`/:class:`Rules`, one spec/layout for every
    leaf, or a pytree of specs shaped like ``tree`` (or a prefix of it; None
    means replicated). Leaves may be tensors (meta ones too) or ``Sharded``.
    With rules, ``role`` picks which role's layout (see ``rules.zero``), and
    the rules' deferred entries (``rules.megatron(names="auto")``) are
    decided by the paths of the tree's tensors.

    >>> import torch, shardax as sx
    >>> tree = {"w": torch.empty(4, 2, device="meta"), "n": 3}
    >>> paths, _, _, layouts = layouts_for(tree, sx.AbstractMesh({"dp": 2}), sx.Rule("w", sx.P("dp")))
    >>> paths, layouts
    (['n', 'w'], [None, Layout(AbstractMesh({'dp': 2}), P('dp'))])
    """
    is_leaf = lambda x: isinstance(x, Sharded)  # noqa: E731
    paths, leaves, treespec = flatten_with_paths(tree, is_leaf=is_leaf, none_is_leaf=True)
    shapes = {p: s for p, x in zip(paths, leaves, strict=True) if (s := _shape(x)) is not None}
    rules = rules_for_tree(specs, paths, leaves)
    if rules is not None:
        if _check_some_rule_matches(rules, [p for p, s in shapes.items() if s]):
            _check_weights_split(rules, shapes)
        if rules.strict:
            tensor_paths = [
                p for p, x in zip(paths, leaves, strict=True) if _shape(x) not in (None, ())
            ]
            missing = rules.unmatched(tensor_paths)
            if missing:
                raise ShardingError(
                    f"no rule matches {len(missing)} leaves and the rules are strict: "
                    + ", ".join(repr(p) for p in missing)
                    + "; add rules for them (or Rule('.*', P()) last to replicate the rest)"
                )
        targets: list[Any] = [None] * len(leaves)
    elif _is_target(specs):
        targets = [specs] * len(leaves)
    else:
        try:
            full = optree.tree_broadcast_prefix(specs, tree, is_leaf=_is_target, none_is_leaf=True)
        except ValueError as err:
            raise ShardingError(
                f"the specs tree does not match the tree's structure ({err}); give one spec, rules, "
                "or a tree of specs shaped like the values"
            ) from None
        targets = optree.tree_leaves(full, is_leaf=_is_target, none_is_leaf=True)
    layouts: list[Layout | None] = []
    for path, leaf, target in zip(paths, leaves, targets, strict=True):
        shape = _shape(leaf)
        layouts.append(
            None if shape is None else _leaf_layout(target, path, shape, mesh, rules, role)
        )
    return paths, leaves, treespec, layouts


def rules_for_tree(specs: Any, paths: Sequence[str], leaves: Sequence[Any]) -> Rules | None:
    """``specs`` as :class:`Rules` (None when they are specs) decided by
    the paths of the tree's tensors (``rules.megatron(names="auto")``): the
    same object for the same tree, so every leaf gets the same rules."""
    return as_rules(
        specs, paths=[p for p, x in zip(paths, leaves, strict=True) if _shape(x) is not None]
    )


def _check_some_rule_matches(rules: Rules, paths: list[str]) -> bool:
    """Rules of which none matches any tensor — the names of another model
    (``rules.megatron`` with the example GPT's names on a Hugging Face
    model) — would leave everything replicated: a warning naming them and a
    few of the paths, an error when the rules are strict. False when so."""
    if not rules.rules or not paths or any(r.matches(p) for r in rules.rules for p in paths):
        return True
    shown = ", ".join(repr(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    message = (
        f"none of the {len(rules.rules)} rules matches any of the {len(paths)} tensors (paths "
        f"such as {shown}; patterns such as {rules.rules[0].pattern!r}), so every tensor is "
        "laid out as if there were no rules: are they written for another model? (for "
        "Hugging Face models pass names='auto', or names=sx.rules.GPT2_NAMES or LLAMA_NAMES)"
    )
    if rules.strict:
        raise ShardingError(message)
    warnings.warn(message, UnmatchedRulesWarning, stacklevel=4)
    return False


def _check_weights_split(rules: Rules, shapes: dict[str, tuple[int, ...]]) -> None:
    """Tensor-parallel rules (``rules.tensor_parallel``) that leave weight
    matrices whole over their axes — names that missed a module: a warning
    naming them, an error when the rules are strict."""
    whole = rules.unsplit_weights(shapes)
    if not whole:
        return
    shown = ", ".join(f"{p!r} {tuple(shapes[p])}" for p in whole[:8])
    shown += f", ... ({len(whole)} in all)" if len(whole) > 8 else ""
    axes = " × ".join(repr(a) for a in rules.tensor_parallel)
    message = (
        f"the rules split weight matrices over {axes} but leave {len(whole)} whole there, on "
        f"every rank: {shown}; add them to the names' roles (names=sx.rules.TransformerNames("
        "column=..., row=..., vocab=..., head=...)), or, if they are meant to be whole, say so "
        "with a rule placed first: Rule(" + repr(re.escape(whole[0])) + ", P()) + rules"
    )
    if rules.strict:
        raise ShardingError(message)
    warnings.warn(message, UnshardedWeightWarning, stacklevel=4)


def _shape(x: Any) -> tuple[int, ...] | None:
    if isinstance(x, Sharded):
        return x.shape
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    return None


def shard(tree: Any, mesh: Mesh, specs: Any, *, src: int | None = None) -> Any:
    """Turn a pytree of dense tensors into a pytree of :class:`Sharded` leaves.

    Every rank passes the full tensors and keeps its own piece (no
    communication); or, with ``src=r``, only rank ``r``'s values count and are
    broadcast (the others pass tensors of the same shapes and dtypes, e.g.
    ``torch.empty``). Leaves that are not tensors are left as they are.
    Sharded by rules, each leaf also gets its placement (compute, grads and
    opt_state layouts: see ``rules.zero``).

    Args:
        tree: a pytree of tensors (or a single tensor).
        mesh: the live mesh.
        specs: rules (:class:`Rule`/:class:`Rules`), one spec for every leaf,
            or a pytree of specs shaped like ``tree``.
        src: the rank whose values count, or None when all ranks hold them.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> params = {"w": torch.ones(4, 2), "b": torch.zeros(2)}
    >>> sx.shard(params, mesh, sx.Rule(r"w", sx.P("dp")))["w"].spec
    P('dp')
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(
            f"shard needs a live Mesh; got {mesh!r} (explain() plans on AbstractMesh)"
        )
    paths, leaves, treespec, layouts = layouts_for(tree, mesh, specs)
    rules = rules_for_tree(specs, paths, leaves)
    out = []
    for path, leaf, layout in zip(paths, leaves, layouts, strict=True):
        if layout is None:
            out.append(leaf)
            continue
        x = (
            transfer(leaf, layout)
            if isinstance(leaf, Sharded)
            else _shard_one(leaf, mesh, layout, src)
        )
        if rules is not None:
            placement = rules.placement(path, x.shape, mesh)
            local = placed(x.local, placement.memory_kind("params"))  # rules.offload
            x = Sharded(local, x.layout, x.shape, placement=placement)
        out.append(x)
    return optree.tree_unflatten(treespec, out)


def _shard_one(x: torch.Tensor, mesh: Mesh, layout: Layout, src: int | None) -> Sharded:
    from ..collectives._api import broadcast

    if src is not None:
        if not 0 <= src < mesh.world_size:
            raise ShardingError(f"src rank {src} is not in {mesh!r}")
        x = broadcast(x, mesh.axis_names, src=src, mesh=mesh)
    full = Sharded(x, Layout(mesh), tuple(x.shape))
    local = transfer(full, layout).local
    if (
        local.numel()
        and x.numel()
        and local.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    ):
        local = local.clone()  # do not keep the whole tensor alive through a view
    return Sharded(local, layout, tuple(x.shape))


def gather(tree: Any) -> Any:
    """Turn every :class:`Sharded` leaf back into the dense tensor, on every
    rank (exact, uneven dims included; partial values summed). Other leaves
    are left as they are. Differentiable: the gradient of the dense result is
    summed over ranks, so a loss every rank computes from it identically goes
    through :func:`shardax.collectives.count_once` before ``backward()``.

    >>> import torch, shardax as sx
    >>> x = sx.shard(torch.arange(5.0), sx.Mesh({"dp": 1}), sx.P("dp"))
    >>> sx.gather({"x": x})
    {'x': tensor([0., 1., 2., 3., 4.])}
    """
    return optree.tree_map(
        lambda x: transfer(x, Layout(x.mesh)).local if isinstance(x, Sharded) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Sharded),
    )


def reshard(tree: Any, specs: Any, *, mesh: Mesh | None = None) -> Any:
    """Move every :class:`Sharded` leaf to a new layout: ``specs`` as in
    :func:`shard`, on ``mesh`` (default: each leaf's own mesh). Other leaves
    are left as they are. Rules give new placements; specs keep a leaf's
    placement when its mesh stays the same.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> x = sx.shard(torch.ones(2, 2), mesh, sx.P("dp"))
    >>> sx.reshard(x, sx.P(None, "dp")).spec
    P(None, 'dp')
    """
    leaves = optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Sharded))
    meshes = {x.mesh for x in leaves if isinstance(x, Sharded)}
    target_mesh = mesh if mesh is not None else (meshes.pop() if len(meshes) == 1 else None)
    if target_mesh is None:
        if not meshes:
            return tree
        raise ShardingError(
            f"the tree's Sharded leaves live on several meshes {sorted(map(repr, meshes))}; pass mesh="
        )
    paths, leaves, treespec, layouts = layouts_for(tree, target_mesh, specs)
    rules = rules_for_tree(specs, paths, leaves)
    out = []
    for path, x, layout in zip(paths, leaves, layouts, strict=True):
        if not isinstance(x, Sharded) or layout is None:
            out.append(x)
            continue
        y = transfer(x, layout)
        if rules is not None:
            placement = rules.placement(path, x.shape, target_mesh)
        else:
            placement = x.placement if x.mesh == target_mesh else None
        out.append(Sharded(y.local, y.layout, y.shape, placement=placement))
    return optree.tree_unflatten(treespec, out)
