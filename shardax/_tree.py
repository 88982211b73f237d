"""Pytree helpers: leaves with their key paths rendered as ``blocks.3.attn.weight``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

__all__ = ["flatten_with_paths", "render_path"]


def render_path(path: tuple[Any, ...]) -> str:
    """A key path as dotted text.

    >>> render_path(("blocks", 3, "attn", "weight"))
    'blocks.3.attn.weight'
    >>> render_path(())
    ''
    """
    return ".".join(str(k) for k in path)


def flatten_with_paths(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None, *, none_is_leaf: bool = False
) -> tuple[list[str], list[Any], Any]:
    """``(paths, leaves, treespec)`` with paths rendered as text (named-tuple
    and dataclass fields by name).

    >>> paths, leaves, _ = flatten_with_paths({"a": 1, "b": [2, 3]})
    >>> paths, leaves
    (['a', 'b.0', 'b.1'], [1, 2, 3])
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(
        tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf
    )
    paths = [render_path(tuple(getattr(e, "field", None) or e.entry for e in a)) for a in accessors]
    return paths, leaves, spec
