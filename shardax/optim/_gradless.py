"""The one rule for leaves without a gradient.

A leaf whose gradient is None — a buffer (``model.rotary_emb.inv_freq``), a
frozen or unused parameter: what :func:`shardax.value_and_grad` gives where
no gradient reached, as PyTorch leaves ``p.grad`` None — keeps its value
and its state, as ``torch.optim`` skips a parameter whose ``grad`` is None:

- its update is None, and :func:`~shardax.optim.apply_updates` leaves the
  param as it is (the same tensor);
- every transformation keeps its own state for that leaf as it was — the
  moments, the leaf's own step count (so Adam's bias correction is the
  leaf's, as in ``torch.optim``), the master copy, the accumulated
  gradients;
- counts that belong to the whole optimizer — a schedule's step,
  ``MultiSteps``' micro-steps — advance on every step, as a ``torch.optim``
  learning-rate scheduler does.

The gradients are a tree like the params with None at such leaves; a leaf
left out of the tree is not "no gradient" but a different tree, and an
error that names it.

Here is the rule once: :func:`gradless` finds the None leaves,
:class:`Gradless` cuts them out of params-shaped trees and puts them back,
and :func:`keep_gradless` wraps a transformation's ``update`` with it (what
``_base.transformation`` does for every transformation). The wrappers that
pass the whole params on (master weights, ``MultiSteps``,
``apply_if_finite``) and the fused stepper use :class:`Gradless` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import optree

__all__ = ["Gradless", "gradless", "keep_gradless"]

Update = Callable[..., tuple[Any, Any]]


@attrs.frozen
class Gradless:
    """The leaves of an updates tree that are None: ``spec``, the tree's
    structure with None as a leaf, and ``gone``, their positions in it.
    A tree "matches" when its structure, None a leaf, is ``spec``: it is
    laid out like the params (the params, a moment, a step count per
    leaf)."""

    spec: Any
    gone: frozenset[int]

    def matches(self, tree: Any) -> bool:
        return tree is not None and optree.tree_structure(tree, none_is_leaf=True) == self.spec

    def cut(self, tree: Any) -> Any:
        """``tree`` with None at the gradless leaves, where it matches (else
        as it is: the transformation's own structure check names the
        difference)."""
        if not self.matches(tree):
            return tree
        leaves = optree.tree_leaves(tree, none_is_leaf=True)
        return optree.tree_unflatten(
            self.spec, [None if i in self.gone else x for i, x in enumerate(leaves)]
        )

    def keep(self, new: Any, old: Any) -> Any:
        """``new`` with ``old``'s values at the gradless leaves, where both
        match."""
        if not (self.matches(new) and self.matches(old)):
            return new
        new_leaves = optree.tree_leaves(new, none_is_leaf=True)
        old_leaves = optree.tree_leaves(old, none_is_leaf=True)
        return optree.tree_unflatten(
            self.spec,
            [
                o if i in self.gone else n
                for i, (n, o) in enumerate(zip(new_leaves, old_leaves, strict=True))
            ],
        )

    def cut_state(self, state: Any) -> Any:
        """A transformation's own state with its params-shaped parts cut:
        the state itself, or the fields of its NamedTuple (never an inner
        transformation's state: that one applies the rule itself)."""
        if self.matches(state):
            return self.cut(state)
        if isinstance(state, tuple):
            fields = [self.cut(s) for s in state]
            return type(state)(*fields) if optree.is_namedtuple(state) else tuple(fields)
        return state

    def keep_state(self, new: Any, old: Any) -> Any:
        """:meth:`cut_state` undone on the state the update returned: the
        gradless leaves' old values put back."""
        if self.matches(old):
            return self.keep(new, old)
        if isinstance(new, tuple) and isinstance(old, tuple) and len(new) == len(old):
            fields = [self.keep(n, o) for n, o in zip(new, old, strict=True)]
            return type(new)(*fields) if optree.is_namedtuple(new) else tuple(fields)
        return new


def gradless(updates: Any) -> Gradless | None:
    """The None leaves of ``updates`` (a tree; None a leaf), or None where
    there are none — every step of most models, found in one pass with no
    key paths built. A bare leaf (one tensor, or None) has none."""
    leaves, spec = optree.tree_flatten(updates, none_is_leaf=True)
    if spec.is_leaf() or all(x is not None for x in leaves):
        return None
    return Gradless(spec, frozenset(i for i, x in enumerate(leaves) if x is None))


def keep_gradless(update: Update) -> Update:
    """``update`` under the rule: the leaves whose update is None are cut
    out of the transformation's own params-shaped state and of the params
    before it runs, and their state put back after — their updates come out
    None."""

    def ruled(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        found = gradless(updates)
        if found is None:
            return update(updates, state, params)
        new_updates, new_state = update(updates, found.cut_state(state), found.cut(params))
        return new_updates, found.keep_state(new_state, state)

    ruled.__wrapped__ = update  # type: ignore[attr-defined]
    return ruled
