"""What an optimizer is — ``GradientTransformation(init, update)``, ``chain``,
``apply_updates`` — the typed description a transformation may add for the
fused stepper (:class:`Fusible`), and the tree plumbing every transform
shares: flattening, aligning ``Sharded`` leaves to the layout of the state
they meet, and ``_foreach`` math grouped by device and dtype."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import attrs
import optree
import torch

from .._tree import flatten_with_paths
from ..errors import ShardingError
from ..shard._memory import allocate
from ..shard._placement import memory_kind, role_layout
from ..shard._sharded import Sharded
from ..shard._transfer import transfer, transfer_many
from ._diverged import diverging
from ._gradless import gradless, keep_gradless

__all__ = [
    "ChainFusion",
    "EmptyState",
    "Fusible",
    "GradientTransformation",
    "Kernel",
    "MasterFusion",
    "apply_updates",
    "chain",
]

Leaf = torch.Tensor | Sharded
Schedule = Callable[[int], float]


class GradientTransformation(NamedTuple):
    """An optimizer, or a piece of one: two pure functions (optax's contract).

    ``init(params) -> state`` builds the state (a pytree of NamedTuples);
    ``update(updates, state, params=None) -> (updates, new_state)`` turns
    gradients into updates, which are what you *add* to the params
    (:func:`apply_updates`): optimizers apply the negative learning rate, as
    in optax. Neither function mutates what it is given: the gradients, the
    state and the params passed in keep their values (the new state is new
    tensors). Leaves are tensors or :class:`~shardax.Sharded` values; a
    Sharded leaf's state lives in the layout of its "opt_state" role (ZeRO
    shards it further than the params). For a step that writes the params
    and the state in place, see :func:`fused_step`.

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


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none.

    >>> from shardax import optim
    >>> optim.scale(2.0).init({})
    EmptyState()
    """


def transformation(
    init: Callable[[Any], Any], update: Callable[..., tuple[Any, Any]], *, own_none: bool = False
) -> GradientTransformation:
    """``GradientTransformation(init, update)`` with both under ``no_grad``,
    and ``update`` under the rule for leaves without a gradient
    (:func:`~shardax.optim._gradless.keep_gradless`) — unless ``own_none``:
    ``update`` takes None updates itself (a wrapper that hands the whole
    params on)."""
    if not own_none:
        update = keep_gradless(update)
    return GradientTransformation(torch.no_grad()(init), torch.no_grad()(update))


# -- what the fused stepper reads ---------------------------------------------------

KERNELS = ("adamw", "adam_l2", "lion", "adagrad", "rmsprop")


@attrs.frozen(kw_only=True)
class Kernel:
    """The native kernel that computes an optimizer alias in one pass
    (``kernels/csrc/optim.cpp``): which one, its hyperparameters, its
    learning rate (a number or a schedule of the step), and where the core
    transform's state sits in the alias's chain state — ``core`` among
    ``length`` entries, the learning rate's state last. The fused stepper
    reads all of it here, never by searching the state.

    >>> from shardax import optim
    >>> optim.adamw(1e-3).fusion
    Kernel(name='adamw', lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, core=0, length=3, bias_correction=True)
    """

    name: Literal["adamw", "adam_l2", "lion", "adagrad", "rmsprop"] = attrs.field(
        validator=attrs.validators.in_(KERNELS)
    )
    lr: float | Schedule = attrs.field(converter=lambda v: v if callable(v) else float(v))
    betas: tuple[float, ...] = attrs.field(default=(), converter=lambda v: tuple(map(float, v)))
    """Adam's and Lion's ``(b1, b2)``, RMSprop's ``(decay,)``, Adagrad's ``()``."""
    eps: float = attrs.field(default=0.0, converter=float)
    weight_decay: float = attrs.field(default=0.0, converter=float)
    core: int
    length: int = attrs.field()
    bias_correction: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    """Adam's division of the moments by ``1 - b**t`` (False: DeepSpeed's
    ``bias_correction=False``)."""

    @length.validator
    def _check(self, _: Any, length: int) -> None:
        if not 0 <= self.core < length - 1:
            raise ValueError(
                f"the core state's index {self.core} must come before the learning rate's "
                f"(the last of {length})"
            )


@attrs.frozen
class ChainFusion:
    """``chain(*head, last)`` whose last transformation is :class:`Fusible`:
    the head's updates (pure), then the last's fused step on the last entry
    of the chain's ``length`` states."""

    head: GradientTransformation
    last: Fusible
    length: int


@attrs.frozen
class MasterFusion:
    """``with_master_weights(inner, dtype)`` of a :class:`Fusible` ``inner``:
    the inner fused step on the master copy, the params written from it,
    rounded, in the same pass."""

    inner: Fusible
    dtype: torch.dtype


Fusion = Kernel | ChainFusion | MasterFusion


class Fusible(GradientTransformation):
    """A :class:`GradientTransformation` that also says how the fused
    stepper (:func:`fused_step`) computes it in one pass: ``fusion``, a
    :class:`Kernel` (the optimizer aliases), a :class:`ChainFusion`
    (``chain`` ending in one) or a :class:`MasterFusion`
    (``with_master_weights`` around one). ``init`` and ``update`` are the
    pure reference, and what every other caller runs. ``_replace`` gives a
    plain GradientTransformation: the fusion describes these two functions.

    >>> from shardax import optim
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.lion(1e-4))
    >>> isinstance(opt, optim.GradientTransformation), type(opt.fusion).__name__
    (True, 'ChainFusion')
    """

    fusion: Fusion

    def __new__(
        cls, init: Callable[[Any], Any], update: Callable[..., tuple[Any, Any]], fusion: Fusion
    ) -> Fusible:
        if not isinstance(fusion, Kernel | ChainFusion | MasterFusion):
            raise TypeError(
                f"a Fusible's fusion is a Kernel, ChainFusion or MasterFusion; got {fusion!r}"
            )
        self = super().__new__(cls, init, update)
        self.fusion = fusion
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle keep the fusion
        return (self.init, self.update, self.fusion)

    @classmethod
    def _make(cls, iterable: Any) -> GradientTransformation:  # what _replace builds
        return GradientTransformation._make(iterable)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations one after the other; the state is the tuple of
    their states. A chain whose last transformation is :class:`Fusible`
    (clipping, then AdamW) is too: the fused stepper runs the others'
    updates, then the last one's fused step.

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
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain takes GradientTransformations (optim.adamw(...), optim.scale(...)); "
                f"argument {i} is a {type(t).__name__}"
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
        for t, s in zip(transforms, state, strict=True):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    if transforms and isinstance(transforms[-1], Fusible):
        head = chain(*transforms[:-1])
        return Fusible(init, update, ChainFusion(head, transforms[-1], len(transforms)))
    return GradientTransformation(init, update)


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
    hint = ""
    if missing and what in ("updates", "grads"):
        hint = (
            " (a leaf without a gradient stays in the tree as None, as value_and_grad gives it; "
            "it is then left as it is)"
        )
    return ValueError(
        f"{what} does not have the structure of {ref_what} ({'; '.join(parts)}); pass the tree "
        f"the optimizer was initialized for{hint}"
    )


def check_leaf(x: Leaf, ref: Leaf, path: Callable[[], str], what: str) -> Leaf:
    """``x``, checked to meet ``ref``: both Sharded or both plain, the same
    global shape."""
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
        return x
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
        (with this structure). The Sharded leaves laid out unlike theirs
        move together (:func:`~shardax.shard._transfer.transfer_many`: ZeRO-1/2's
        updates gathered in one all_gather per group and dtype, not one per
        leaf), or one by one where a local tensor is differentiated through."""
        out = [
            check_leaf(x, ref, functools.partial(leaf_path, tree, i), what)
            for i, (x, ref) in enumerate(zip(leaves, self.leaves, strict=True))
        ]
        moves = [
            (i, x, ref.layout)
            for i, (x, ref) in enumerate(zip(out, self.leaves, strict=True))
            if isinstance(ref, Sharded) and x.layout != ref.layout
        ]
        if len(moves) > 1 and not any(x.local.requires_grad for _, x, _ in moves):
            moved = transfer_many([(x, layout) for _, x, layout in moves]).wait()
            for (i, x, layout), t in zip(moves, moved, strict=True):
                out[i] = Sharded(t, layout, x.shape)
        else:
            for i, x, layout in moves:
                out[i] = transfer(x, layout)
        return out

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
    """A zero state leaf for param ``x``: for Sharded, in the layout and the
    memory kind of its "opt_state" role; meta params give meta state (that
    records the kind, for ``ckpt.load``)."""
    if isinstance(x, Sharded):
        layout = role_layout(x, "opt_state")
        shape = layout.local_shape(x.shape, layout.mesh.rank)  # type: ignore[attr-defined]
        zeros = allocate(shape, dtype or x.dtype, memory_kind(x, "opt_state"), device=x.device)
        return Sharded(zeros, layout, x.shape)
    return torch.zeros_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def tree_zeros_state(params: Any, dtype: torch.dtype | None = None, what: str = "params") -> Any:
    """:func:`zeros_like_state` over a tree."""
    leaves, spec = flatten(params, what)
    return optree.tree_unflatten(spec, [zeros_like_state(x, dtype) for x in leaves])


def new_count() -> torch.Tensor:
    """A step counter: a 0-d int64 CPU tensor (checkpointable, cheap to read)."""
    return torch.zeros((), dtype=torch.int64)


def new_counts(params: Any, what: str = "params") -> Any:
    """One step counter per leaf of ``params`` (:func:`new_count` each),
    for the state of a leaf that advances only when it gets a gradient —
    ``torch.optim``'s per-parameter ``state["step"]``."""
    leaves, spec = flatten(params, what)
    return optree.tree_unflatten(spec, [new_count() for _ in leaves])


def counts_per_leaf(count: Any, like: Any) -> Any:
    """``count`` as one counter per leaf of ``like`` (a params-shaped state
    tree): a state from before counts were per leaf holds one 0-d count for
    every leaf, which each leaf takes a copy of."""
    if isinstance(count, torch.Tensor) and not isinstance(like, torch.Tensor | Sharded):
        return optree.tree_map(lambda _: count.clone(), like, is_leaf=is_sharded)
    return count


def read_steps(counts: Sequence[torch.Tensor]) -> list[int]:
    """The values of 0-d integer counters (a TypeError naming the first
    that is not one): on the CPU, where ``init`` puts them, one ``.item()``
    each (the cheapest read); elsewhere (a state loaded onto a GPU) in one
    copy, not one device sync per leaf."""
    if counts and isinstance(counts[0], torch.Tensor) and not counts[0].is_cpu:
        counts = list(torch.stack([c.reshape(()) for c in counts]).cpu())
    out = [c.item() if isinstance(c, torch.Tensor) and c.numel() == 1 else c for c in counts]
    for c in out:
        if not isinstance(c, int):
            raise TypeError(
                f"a step count is a 0-d integer tensor (what init made); got {c!r}: pass the "
                "state the optimizer's init (or the last step) returned"
            )
    return out


def by_step(
    steps: Sequence[int] | None, fn: Callable[..., Any], *lists: Sequence[Any], nout: int = 1
) -> Any:
    """:func:`foreach` of ``fn(step, *lists)`` once per group of positions
    that share a step — one group on almost every call; ``steps`` None: one
    group, ``fn(None, ...)``."""
    first = steps[0] if steps else None
    if steps is None or all(t == first for t in steps):
        return foreach(functools.partial(fn, first), *lists, nout=nout)
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(steps):
        groups.setdefault(t, []).append(i)
    results: list[list[Any]] = [[None] * len(steps) for _ in range(nout)]
    for t, idx in groups.items():
        out = foreach(
            functools.partial(fn, t), *[[lst[i] for i in idx] for lst in lists], nout=nout
        )
        for res, part in zip(results, (out,) if nout == 1 else out, strict=True):
            for j, i in enumerate(idx):
                res[i] = part[j]
    return results[0] if nout == 1 else tuple(results)


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
    result keeps the param's layout (and placement) — diverged over the axes
    where the update is (each rank's own change: 0/1 Adam's local steps).

    A param whose update is None (its gradient was: a buffer, a frozen
    layer) is left as it is — the same tensor, whatever its dtype.

    Args:
        params: a pytree of tensors or Sharded values.
        updates: a pytree of the same structure (what ``update`` returned),
            None where a param stays as it is.
        donate: update the params' buffers in place.

    >>> import torch
    >>> from shardax import optim
    >>> optim.apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), 0.5)})
    {'w': tensor([1.5000, 1.5000], dtype=torch.bfloat16)}
    >>> optim.apply_updates({"w": torch.ones(1), "n": torch.tensor([7])}, {"w": torch.ones(1), "n": None})
    {'w': tensor([2.]), 'n': tensor([7])}
    """
    found = gradless(updates)
    if found is not None and found.matches(params):
        return found.keep(_apply(found.cut(params), updates, donate), params)
    return _apply(params, updates, donate)


def _apply(params: Any, updates: Any, donate: bool) -> Any:
    with torch.no_grad():
        flat = Flat(diverging(params, updates), "params")
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
