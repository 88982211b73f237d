"""The shape of every optimizer — ``GradientTransformation(init, update)``,
``chain``, ``apply_updates`` — and the tree plumbing every transform shares:
flattening, aligning ``Sharded`` leaves to the layout of the state they meet,
and ``_foreach`` math grouped by device and dtype."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from .._tree import flatten_with_paths
from ..errors import ShardingError
from ..shard._placement import role_layout
from ..shard._sharded import Sharded
from ..shard._transfer import transfer

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "apply_updates",
    "chain",
    "step",
]

Leaf = torch.Tensor | Sharded


class GradientTransformation(NamedTuple):
    """An optimizer, or a piece of one: two pure functions.

    ``init(params) -> state`` builds the state (a pytree of NamedTuples);
    ``update(updates, state, params=None) -> (updates, new_state)`` turns
    gradients into updates, which are what you *add* to the params
    (:func:`apply_updates`): optimizers apply the negative learning rate, as
    in optax. Neither function mutates what it is given. Leaves are tensors or
    :class:`~shardax.Sharded` values; a Sharded leaf's state lives in the
    layout of its "opt_state" role (ZeRO shards it further than the params).

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.sgd(0.1)
    >>> params = {"w": torch.ones(2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> optim.apply_updates(params, updates)
    {'w': tensor([0.9000, 0.9000])}
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    step: Callable[..., tuple[Any, Any] | None] | None = None
    """A fused update-and-apply, for optimizers that have one (see :func:`step`):
    ``step(updates, state, params, donate=False, shadows=None) -> (new_params,
    new_state)``, or None where it does not cover the call (the caller then
    runs ``update`` and :func:`apply_updates`). ``shadows``, when given, are
    low-precision buffers (one per param leaf) that also receive the new
    params, rounded. It decides before it writes anything."""


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none.

    >>> from shardax import optim
    >>> optim.scale(2.0).init({})
    EmptyState()
    """


def transformation(
    init: Callable[[Any], Any], update: Callable[..., tuple[Any, Any]]
) -> GradientTransformation:
    """``GradientTransformation(init, update)`` with both under ``no_grad``."""
    return GradientTransformation(torch.no_grad()(init), torch.no_grad()(update))


_FRESH: contextvars.ContextVar[bool] = contextvars.ContextVar("shardax_fresh", default=False)


def updates_are_fresh() -> bool:
    """Whether the updates a transformation gets now are buffers nobody else
    holds (so it may scale them in place instead of allocating new ones)."""
    return _FRESH.get()


def chain(
    *transforms: GradientTransformation, _fresh_after_first: bool = False
) -> GradientTransformation:
    """Apply transformations one after the other; the state is the tuple of
    their states. (Aliases whose first transformation always returns new
    buffers pass ``_fresh_after_first`` so the rest scale them in place.)

    Args:
        *transforms: the transformations, in the order they see the updates.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.5))
    >>> updates, _ = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(None))
    >>> updates["w"]
    tensor([-0.3000, -0.4000])
    """
    for i, t in enumerate(transforms):
        if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
            raise TypeError(
                f"chain takes GradientTransformations (with init and update); argument {i} is "
                f"{type(t).__name__}"
            )

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"this chain of {len(transforms)} transformations needs the tuple of their "
                f"{len(transforms)} states (what its init returned); got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        new_state = []
        for i, (t, s) in enumerate(zip(transforms, state, strict=True)):
            token = _FRESH.set(_fresh_after_first and i > 0)
            try:
                updates, s = t.update(updates, s, params)
            finally:
                _FRESH.reset(token)
            new_state.append(s)
        return updates, tuple(new_state)

    def step(
        updates: Any, state: Any, params: Any, donate: bool = False, shadows: Any = None
    ) -> tuple[Any, Any]:
        # The last transformation's fused step, after the others' updates
        # (clipping, then AdamW in one pass); where that step does not cover
        # the call, its update and apply_updates (and the shadows filled).
        last = transforms[-1]
        if not isinstance(state, tuple) or len(state) != len(transforms):
            update(updates, state, params)  # raises the clear error
        updates, head_state = prefix.update(updates, state[:-1], params)
        with torch.no_grad():
            done = last.step(updates, state[-1], params, donate, shadows)
            if done is None:
                token = _FRESH.set(_fresh_after_first and len(transforms) > 1)
                try:
                    updates, last_state = last.update(updates, state[-1], params)
                finally:
                    _FRESH.reset(token)
                new_params = apply_updates(params, updates, donate=donate)
                if shadows is not None:
                    for shadow, x in zip(shadows, Flat(new_params, "params").locals, strict=True):
                        shadow.copy_(x)
                done = new_params, last_state
        return done[0], (*head_state, done[1])

    fused = transforms and getattr(transforms[-1], "step", None) is not None
    if not fused:
        return GradientTransformation(init, update)
    prefix = chain(*transforms[:-1], _fresh_after_first=_fresh_after_first)
    return GradientTransformation(init, update, step)


# -- leaves -------------------------------------------------------------------


def is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def local(x: Leaf) -> torch.Tensor:
    """The tensor this rank holds for a leaf."""
    return x.local if isinstance(x, Sharded) else x


def global_numel(x: Leaf) -> int:
    if isinstance(x, Sharded):
        n = 1
        for d in x.shape:
            n *= d
        return n
    return x.numel()


def flatten(tree: Any, what: str) -> tuple[list[Leaf], Any]:
    """``(leaves, treespec)`` with Sharded values as leaves; every leaf must be
    a tensor or a Sharded value (None is an empty subtree)."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=is_sharded)
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor | Sharded):
            raise TypeError(
                f"{what} leaf {leaf_path(tree, i)!r} is a {type(x).__name__}; optimizer trees hold tensors or "
                "Sharded values (None for no value)"
            )
    return leaves, spec


def leaf_path(tree: Any, i: int) -> str:
    """The key path of leaf ``i`` of ``tree`` (for messages)."""
    return flatten_with_paths(tree, is_leaf=is_sharded)[0][i]


def structure_error(tree: Any, ref: Any, what: str, ref_what: str) -> ValueError:
    """A message naming the key paths where two trees differ."""
    a = flatten_with_paths(tree, is_leaf=is_sharded)[0]
    b = flatten_with_paths(ref, is_leaf=is_sharded)[0]
    missing = [p for p in b if p not in set(a)]
    extra = [p for p in a if p not in set(b)]
    parts = []
    if missing:
        parts.append(f"missing from {what}: {', '.join(map(repr, missing[:8]))}")
    if extra:
        parts.append(f"not in {ref_what}: {', '.join(map(repr, extra[:8]))}")
    if not parts:
        parts.append(
            f"same key paths, different containers: {optree.tree_structure(tree, is_leaf=is_sharded)}"
            f" vs {optree.tree_structure(ref, is_leaf=is_sharded)}"
        )
    return ValueError(
        f"{what} does not have the structure of {ref_what} ({'; '.join(parts)}); pass the tree "
        "the optimizer was initialized for"
    )


def align_leaf(x: Leaf, ref: Leaf, path: Callable[[], str], what: str) -> Leaf:
    """``x`` in ``ref``'s layout (a transfer for Sharded leaves: a free local
    slice from replicated to sharded, a no-op when equal)."""
    if isinstance(ref, Sharded):
        if not isinstance(x, Sharded):
            raise ShardingError(
                f"{what} leaf {path()!r} is a plain tensor but the value it meets is Sharded "
                f"{ref!r}; shard it (shardax.shard) the way the params are sharded"
            )
        if x.shape != ref.shape:
            raise ValueError(
                f"{what} leaf {path()!r} has global shape {x.shape}; expected {ref.shape}"
            )
        return x if x.layout == ref.layout else transfer(x, ref.layout)
    if isinstance(x, Sharded):
        raise ShardingError(
            f"{what} leaf {path()!r} is Sharded {x!r} but the value it meets is a plain tensor "
            "(the optimizer was initialized on dense params); init on the sharded params"
        )
    if x.shape != ref.shape:
        raise ValueError(
            f"{what} leaf {path()!r} has shape {tuple(x.shape)}; expected {tuple(ref.shape)}"
        )
    return x


class Flat:
    """A flattened tree of Tensor/Sharded leaves that other trees are aligned
    to, and rebuilt like."""

    __slots__ = ("leaves", "spec", "tree", "what")

    def __init__(self, tree: Any, what: str) -> None:
        self.tree, self.what = tree, what
        self.leaves, self.spec = flatten(tree, what)

    @classmethod
    def of(cls, tree: Any, leaves: list[Leaf], spec: Any, what: str) -> Flat:
        """The Flat of ``tree``, already flattened into ``leaves`` and ``spec``."""
        flat = cls.__new__(cls)
        flat.tree, flat.what, flat.leaves, flat.spec = tree, what, leaves, spec
        return flat

    def __len__(self) -> int:
        return len(self.leaves)

    @property
    def locals(self) -> list[torch.Tensor]:
        return [local(x) for x in self.leaves]

    def align_leaves(self, tree: Any, what: str) -> list[Leaf]:
        """``tree``'s leaves, each in the layout of the matching leaf here."""
        leaves, spec = flatten(tree, what)
        if spec != self.spec:
            raise structure_error(tree, self.tree, what, self.what)
        return self.align_flat(leaves, tree, what)

    def align_flat(self, leaves: Sequence[Leaf], tree: Any, what: str) -> list[Leaf]:
        """:meth:`align_leaves` for ``leaves`` already flattened from ``tree``
        (with this structure)."""
        return [
            align_leaf(x, ref, functools.partial(leaf_path, tree, i), what)
            for i, (x, ref) in enumerate(zip(leaves, self.leaves, strict=True))
        ]

    def align(self, tree: Any, what: str) -> list[torch.Tensor]:
        """The local tensors of ``tree`` aligned to these leaves."""
        return [local(x) for x in self.align_leaves(tree, what)]

    def same(self, tree: Any, what: str) -> list[torch.Tensor]:
        """The locals of a tree built alongside this one (the state's other
        fields): checked for structure, not relaid."""
        leaves, spec = flatten(tree, what)
        if spec != self.spec:
            raise structure_error(tree, self.tree, what, self.what)
        return [local(x) for x in leaves]

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """A tree shaped like this one around new local tensors (Sharded
        leaves keep their layout)."""
        out = [
            ref.with_local(t) if isinstance(ref, Sharded) else t
            for ref, t in zip(self.leaves, tensors, strict=True)
        ]
        return optree.tree_unflatten(self.spec, out)


def zeros_like_state(x: Leaf, dtype: torch.dtype | None = None) -> Leaf:
    """A zero state leaf for param ``x``: for Sharded, in the layout of its
    "opt_state" role; meta params give meta state."""
    if isinstance(x, Sharded):
        layout = role_layout(x, "opt_state")
        shape = layout.local_shape(x.shape, layout.mesh.rank)  # type: ignore[attr-defined]
        zeros = torch.zeros(shape, dtype=dtype or x.dtype, device=x.device)
        return Sharded(zeros, layout, x.shape)
    return torch.zeros_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def tree_zeros_state(params: Any, dtype: torch.dtype | None = None, what: str = "params") -> Any:
    """:func:`zeros_like_state` over a tree."""
    leaves, spec = flatten(params, what)
    return optree.tree_unflatten(spec, [zeros_like_state(x, dtype) for x in leaves])


def new_count() -> torch.Tensor:
    """A step counter: a 0-d int64 CPU tensor (checkpointable, cheap to read)."""
    return torch.zeros((), dtype=torch.int64)


def expect_state(state: Any, *types: type, what: str) -> None:
    """A clear error when a transform gets someone else's state."""
    if not isinstance(state, types):
        names = " or ".join(t.__name__ for t in types)
        raise TypeError(
            f"{what} expects its {names}; got a {type(state).__name__} (pass the state its "
            "own init returned, in the same position of the chain)"
        )


def needs_params(params: Any, what: str) -> None:
    if params is None:
        raise ValueError(f"{what} needs the params: call update(updates, state, params)")


# -- grouped _foreach math ----------------------------------------------------


def foreach(fn: Callable[..., Any], *lists: Sequence[torch.Tensor], nout: int = 1) -> Any:
    """Run ``fn`` (which takes and returns lists of tensors; a tuple of
    ``nout`` lists when ``nout > 1``) once per group of positions whose
    tensors share devices and dtypes — ``torch._foreach_*`` kernels want
    uniform lists — and put the results back in order."""
    n = len(lists[0])
    if n == 0:
        return [] if nout == 1 else tuple([] for _ in range(nout))
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i in range(n):
        key = tuple((lst[i].device, lst[i].dtype) for lst in lists)
        groups.setdefault(key, []).append(i)
    if len(groups) == 1:
        return fn(*[list(lst) for lst in lists])
    results: list[list[Any]] = [[None] * n for _ in range(nout)]
    for idx in groups.values():
        out = fn(*[[lst[i] for i in idx] for lst in lists])
        outs = (out,) if nout == 1 else out
        for res, part in zip(results, outs, strict=True):
            for j, i in enumerate(idx):
                res[i] = part[j]
    return results[0] if nout == 1 else tuple(results)


def cast(tensors: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor in the dtype of its partner (no copy when equal)."""
    return [t.to(r.dtype) for t, r in zip(tensors, like, strict=True)]


# -- applying updates ---------------------------------------------------------


def apply_updates(params: Any, updates: Any, *, donate: bool = False) -> Any:
    """``params + updates``, leaf by leaf, as new tensors (nothing is mutated)
    — or, with ``donate=True``, written into the params' own buffers, so a
    step never holds two copies of the parameters (the tree passed in then
    holds the new values too: do not use it as the old params).

    The sum is taken in the wider of the two dtypes and cast back to the
    param's (fp32 updates on bf16 params round once, bf16 updates on fp32
    params lose nothing). A Sharded update is first moved
    to its param's layout with :func:`shardax.transfer` — an all_gather when
    the optimizer ran on shards of replicated params (ZeRO-1/2) — and the
    result keeps the param's layout (and placement).

    Args:
        params: a pytree of tensors or Sharded values.
        updates: a pytree of the same structure (what ``update`` returned).
        donate: update the params' buffers in place.

    >>> import torch
    >>> from shardax import optim
    >>> optim.apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), 0.5)})
    {'w': tensor([1.5000, 1.5000], dtype=torch.bfloat16)}
    """
    with torch.no_grad():
        flat = Flat(params, "params")
        out = []
        for p, u in zip(flat.leaves, flat.align_leaves(updates, "updates"), strict=True):
            pl, ul = local(p), local(u)
            wide = torch.promote_types(pl.dtype, ul.dtype)
            if donate and wide == pl.dtype:
                new = pl.add_(ul)
            elif donate:
                new = pl.copy_((pl.to(wide) + ul.to(wide)).to(pl.dtype))
            else:
                new = (pl.to(wide) + ul.to(wide)).to(pl.dtype)
            out.append(p.with_local(new) if isinstance(p, Sharded) else new)
        return optree.tree_unflatten(flat.spec, out)


def step(
    optimizer: GradientTransformation,
    grads: Any,
    state: Any,
    params: Any,
    *,
    donate: bool = False,
) -> tuple[Any, Any]:
    """One optimizer step: ``update`` then :func:`apply_updates`, returning
    ``(new_params, new_state)`` — in one pass over params, gradients and
    state where the optimizer has a fused kernel.

    :func:`adamw`, :func:`lion`, :func:`adagrad` and :func:`rmsprop` (and
    :func:`with_master_weights` around them) on CPU fp32 params and state,
    laid out alike (no ZeRO, or ZeRO-3), read each element once and write the
    new param, as ``torch.optim``'s ``fused=True`` does; with ``donate=True``
    the params' own buffers take the new values (as in :func:`apply_updates`).
    Everything else — other optimizers, dtypes, devices, ZeRO-1/2's
    replicated params — runs ``update`` and :func:`apply_updates`, with the
    same results (to about an ulp). The state passed in is consumed, as by
    ``update``: keep the returned one.

    A leaf whose gradient is None — a buffer, a parameter no gradient
    reached (:func:`shardax.value_and_grad` gives None there, as PyTorch
    leaves ``p.grad`` None) — is left as it is, with its optimizer state:
    no weight decay, no momentum, as ``torch.optim`` skips it. (A shared
    step count still advances.)

    Args:
        optimizer: a :class:`GradientTransformation`.
        grads: the gradients (a tree like ``params``).
        state: the optimizer state (what ``init`` or the last step returned).
        params: the params, a pytree of tensors or Sharded values.
        donate: write the new params into the params' buffers.

    >>> import torch
    >>> from shardax import optim
    >>> opt = optim.adamw(0.1, weight_decay=0.0)
    >>> params = {"w": torch.zeros(3)}
    >>> state = opt.init(params)
    >>> params, state = optim.step(opt, {"w": torch.tensor([1.0, -2.0, 0.0])}, state, params)
    >>> params["w"]
    tensor([-0.1000,  0.1000,  0.0000])
    """
    frozen = _gradless(grads, params)
    if frozen:
        return _step_keeping(optimizer, grads, state, params, donate, frozen)
    fused = getattr(optimizer, "step", None)
    if fused is not None:
        done = fused(grads, state, params, donate)
        if done is not None:
            return done
    updates, state = optimizer.update(grads, state, params)
    return apply_updates(params, updates, donate=donate), state


def _gradless(grads: Any, params: Any) -> list[int]:
    """The indices of params' leaves whose gradient is None (none where the
    trees do not line up: ``update`` names the difference)."""
    if grads is None or params is None:
        return []
    g_leaves = optree.tree_leaves(grads, is_leaf=is_sharded, none_is_leaf=True)
    if all(g is not None for g in g_leaves):  # every step of most models: no paths built
        return []
    g_paths = flatten_with_paths(grads, is_leaf=is_sharded, none_is_leaf=True)[0]
    if g_paths != flatten_with_paths(params, is_leaf=is_sharded)[0]:
        return []
    return [i for i, g in enumerate(g_leaves) if g is None]


def _step_keeping(
    optimizer: GradientTransformation,
    grads: Any,
    state: Any,
    params: Any,
    donate: bool,
    frozen: list[int],
) -> tuple[Any, Any]:
    """:func:`step` where the leaves ``frozen`` have no gradient: the step
    runs on the trees without them (params, grads and every params-shaped
    part of the state), and they are put back as they were."""
    p_paths, p_leaves, p_spec = flatten_with_paths(params, is_leaf=is_sharded)
    gone = set(frozen)

    def cut(leaves: list[Any]) -> list[Any]:
        return [None if i in gone else x for i, x in enumerate(leaves)]

    kept: list[list[Any]] = []

    def cut_state(leaves: list[Any]) -> list[Any]:
        kept.append(leaves)
        return cut(leaves)

    def put_back(leaves: list[Any], old: list[Any]) -> list[Any]:
        return [old[i] if i in gone else x for i, x in enumerate(leaves)]

    g_leaves = flatten_with_paths(grads, is_leaf=is_sharded, none_is_leaf=True)[1]
    new_params, new_state = step(
        optimizer,
        optree.tree_unflatten(p_spec, cut(g_leaves)),
        _map_param_shaped(state, p_paths, cut_state, none_is_leaf=False),
        optree.tree_unflatten(p_spec, cut(p_leaves)),
        donate=donate,
    )
    olds = iter(kept)
    new_leaves = flatten_with_paths(new_params, is_leaf=is_sharded, none_is_leaf=True)[1]
    return (
        optree.tree_unflatten(p_spec, put_back(new_leaves, p_leaves)),
        _map_param_shaped(
            new_state, p_paths, lambda leaves: put_back(leaves, next(olds)), none_is_leaf=True
        ),
    )


def _map_param_shaped(
    state: Any, p_paths: list[str], fn: Callable[[list[Any]], list[Any]], none_is_leaf: bool
) -> Any:
    """``state`` with ``fn`` applied to the leaves of every subtree laid out
    like the params (the moments, master weights), in order; with
    ``none_is_leaf``, a None in such a subtree counts as a leaf."""

    def visit(node: Any) -> Any:
        if is_sharded(node) or isinstance(node, torch.Tensor) or node is None:
            return node
        paths, leaves, spec = flatten_with_paths(
            node, is_leaf=is_sharded, none_is_leaf=none_is_leaf
        )
        if paths == p_paths:
            return optree.tree_unflatten(spec, fn(leaves))
        if isinstance(node, dict):
            return type(node)((k, visit(v)) for k, v in node.items())
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(visit(v) for v in node))
        if isinstance(node, tuple | list):
            return type(node)(visit(v) for v in node)
        return node

    return visit(state)


def validate(
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = True,
) -> float:
    """``value`` as a float, checked to lie in the given range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        else:
            raise TypeError(f"{name} must be a number; got {value!r}")
    v = float(value)
    bad = v != v or (v <= low if low_open else v < low)
    if high is not None:
        bad = bad or (v >= high if high_open else v > high)
    if bad:
        lo = f"{'(' if low_open else '['}{low}"
        hi = f"{high}{')' if high_open else ']'}" if high is not None else "inf)"
        raise ValueError(f"{name} must be in {lo}, {hi}; got {value!r}")
    return v
