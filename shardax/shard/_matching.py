"""Sharding rules: key-path patterns → specs, first match wins.

Parallelism presets (``rules.zero``, ``rules.megatron``, …) are functions
that return :class:`Rules`; nothing more magical than that.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, normalize_axes
from ._layout import Layout
from ._memory import Offload
from ._modules import ModuleRule
from ._placement import ROLES, Placement, ShardOver
from ._spec import NamedSharding, P, PartitionSpec, as_spec

__all__ = ["Deferred", "Rule", "Rules", "fit_spec"]


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ShardingError(f"rule pattern {pattern!r} is not a valid regex: {err}") from None


@attrs.frozen(repr=False)
class Rule:
    """Leaves whose key path (``"blocks.3.attn.qkv.weight"``) fully matches
    the regex ``pattern`` get ``spec``.

    >>> Rule(r"blocks\\.\\d+\\.attn\\..*\\.weight", P("tp", None))
    Rule('blocks\\\\.\\\\d+\\\\.attn\\\\..*\\\\.weight', P('tp', None))
    >>> Rule.glob("*.weight", P("dp")).matches("blocks.0.mlp.weight")
    True
    >>> Rule("emb", P("dp")) + Rule(".*", P())
    Rules(Rule('emb', P('dp')), Rule('.*', P()))

    ``partial`` makes the *compute* value a pending sum over those axes: the
    stored (replicated) value on index 0 of them, zeros elsewhere. A
    row-parallel linear's bias is one: each rank adds it to its partial
    output, and the sum over ``tp`` counts it once.

    >>> Rule(r".*\\.proj\\.bias", P(), partial="tp")
    Rule('.*\\\\.proj\\\\.bias', P(), partial=('tp',))

    A dim made of equal blocks — GPT-2's fused ``c_attn`` weight ``[d, 3·d]``
    holds q, k and v side by side — is split block by block with
    :func:`shardax.blocks`: each rank keeps its part of every block, and the
    leaf keeps its shape (``[d, 3·d]`` globally, ``[d, 3·d/tp]`` locally).

    >>> from shardax import blocks
    >>> Rule(r".*c_attn\\.weight", P(None, blocks(3, "tp")))
    Rule('.*c_attn\\\\.weight', P(None, blocks(3, 'tp')))
    """

    pattern: str
    spec: PartitionSpec = attrs.field(converter=as_spec)
    partial: tuple[str, ...] = attrs.field(default=(), converter=normalize_axes, kw_only=True)
    _regex: re.Pattern[str] = attrs.field(init=False, eq=False)

    @_regex.default
    def _make_regex(self) -> re.Pattern[str]:
        if not isinstance(self.pattern, str):
            raise ShardingError(f"a rule pattern is a string (a regex); got {self.pattern!r}")
        return _compile(self.pattern)

    @classmethod
    def glob(cls, pattern: str, spec: PartitionSpec | Sequence[Any]) -> Rule:
        """A rule from a shell-style pattern (``*`` also matches dots)."""
        return cls(_glob_regex(pattern), spec)

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None

    def __add__(self, other: Rule | ShardOver | Rules) -> Rules:
        return Rules(self) + other

    def __radd__(self, other: Rule | ShardOver | int) -> Rules:
        return Rules(self) if isinstance(other, int) and other == 0 else Rules(other, self)

    def __repr__(self) -> str:
        tail = f", partial={self.partial!r}" if self.partial else ""
        return f"Rule({self.pattern!r}, {self.spec!r}{tail})"


@attrs.frozen(repr=False)
class Deferred:
    """An entry of :class:`Rules` that the tree it lays out decides:
    ``decide(paths)`` — given the key paths of all the tree's tensors —
    returns the rules it stands for, which take its place (first match
    wins, as if they had been written there). ``rules.megatron(names="auto")``
    is one: rules are written before any model is seen, and which module
    names a model uses shows only in its paths. ``label`` is its ``repr``
    (the call that made it), and what makes two equal.

    :func:`shardax.shard`, :func:`shardax.init_params`,
    :func:`shardax.explain`, :func:`shardax.reshard`, ``apply(rules=...)``
    and the checkpoint loaders decide it with the paths of the tree (model,
    checkpoint) they are given (:meth:`Rules.resolve`). A decision is kept
    per set of paths, so the same tree always gets the very same rules (and
    module rules) however often it is laid out.

    >>> pick = Deferred(lambda paths: Rules(Rule(paths[0], P("dp"))), "first_path('dp')")
    >>> rules = Rule("b", P()) + pick
    >>> rules
    Rules(Rule('b', P()), first_path('dp'))
    >>> rules.resolve(["w", "b"])
    Rules(Rule('b', P()), Rule('w', P('dp')))
    """

    decide: Callable[[tuple[str, ...]], Rules] = attrs.field(eq=False)
    label: str
    _decided: dict[frozenset[str], Rules] = attrs.field(init=False, eq=False, factory=dict)

    def rules_for(self, paths: Iterable[str]) -> Rules:
        """The rules for a tree with these tensor paths (the same object for
        the same paths)."""
        key = frozenset(paths)
        rules = self._decided.pop(key, None)  # re-inserted: the latest is last
        if rules is None:
            rules = self.decide(tuple(paths))
            if not isinstance(rules, Rules):
                raise ShardingError(f"{self.label} decided {rules!r}, not Rules")
        self._decided[key] = rules
        while len(self._decided) > 8:  # a few trees (params, a reshard target) at a time
            del self._decided[next(iter(self._decided))]
        return rules

    def __add__(self, other: Rule | ShardOver | Rules) -> Rules:
        return Rules(self) + other

    def __radd__(self, other: Rule | ShardOver | int) -> Rules:
        return Rules(self) if isinstance(other, int) and other == 0 else Rules(other, self)

    def __repr__(self) -> str:
        return self.label


ShardOver.__add__ = Rule.__add__  # type: ignore[method-assign]
ShardOver.__radd__ = Rule.__radd__  # type: ignore[method-assign]
ModuleRule.__add__ = Rule.__add__  # type: ignore[attr-defined]
ModuleRule.__radd__ = Rule.__radd__  # type: ignore[attr-defined]


def _spread(items: Iterable[Any]) -> Iterator[Any]:
    """``items`` with lists and tuples of rules spread in place (``Rules([a, b])``)."""
    for item in items:
        if type(item) in (list, tuple):  # not a PartitionSpec (a tuple too)
            yield from _spread(item)
        else:
            yield item


def is_rules(value: Any) -> bool:
    """Whether ``value`` is rules: a :class:`Rule`, :class:`ShardOver`,
    :class:`ModuleRule`, :class:`Deferred`, :class:`Rules`, or a non-empty
    list of them."""
    kinds = (Rule, ShardOver, ModuleRule, Deferred, Offload, Rules)
    if type(value) in (list, tuple):
        return bool(value) and all(is_rules(v) for v in value)
    return isinstance(value, kinds)


def as_rules(specs: Any, paths: Iterable[str] | None = None) -> Rules | None:
    """``specs`` as :class:`Rules` when it is rules (a list of rules too),
    else None; with ``paths`` (the key paths of a tree's tensors), its
    :class:`Deferred` entries decided by them."""
    rules = specs if isinstance(specs, Rules) else Rules(specs) if is_rules(specs) else None
    return rules.resolve(paths) if rules is not None and paths is not None else rules


def _glob_regex(pattern: str) -> str:
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)


@attrs.frozen(init=False, repr=False)
class Rules:
    """An ordered set of rules; the first that matches a path wins, and
    unmatched leaves are replicated — or, with ``strict=True``, an error that
    lists every unmatched path. ``divisible=True`` makes a split dim that the
    axes do not divide evenly an error. Compose with ``+`` (flags OR).

    The rules' specs are the *compute* layouts (what modules see). On top of
    them, :class:`ShardOver` entries (as ``rules.zero`` returns) split the
    params, grads or optimizer state of matching leaves over more axes; their
    order does not matter. ``spec_for(..., role=...)`` gives each role's spec.

    A list of rules is rules too: ``Rules([a, b])`` is ``Rules(a, b)``.

    >>> rules = Rules(Rule(r".*\\.weight", P("dp")), strict=True)
    >>> rules.spec_for("mlp.weight", (8, 4), AbstractMesh({"dp": 2}))
    P('dp')
    >>> rules.spec_for("mlp.bias", (8,), AbstractMesh({"dp": 2}))
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: no rule matches 'mlp.bias' (shape (8,)) and the rules are strict; add a rule such as Rule('mlp\\\\.bias', P()) or Rule('.*', P()) at the end

    ``tensor_parallel=axes`` says the rules mean to split every weight
    matrix over those axes (``rules.megatron`` sets it): laying out a tree
    whose 2-D ``.weight`` tensors they leave whole there warns, naming them
    (:class:`shardax.UnshardedWeightWarning`; strict rules raise) — unless a
    rule replicates one on purpose, ``Rule(path, P())``
    (:meth:`unsplit_weights` lists them).

    :class:`Deferred` entries are decided by the paths of the tree the rules
    lay out (:meth:`resolve`; ``shard``, ``init_params``, ``explain`` and
    ``reshard`` do it): ``rules.megatron(names="auto")`` is one. The
    per-path methods (``match``, ``spec_for``, ``placement``) need them
    decided first.
    """

    rules: tuple[Rule, ...]
    overs: tuple[ShardOver, ...]
    strict: bool
    divisible: bool
    modules: tuple[ModuleRule, ...] = ()
    tensor_parallel: tuple[str, ...] = ()
    deferred: tuple[tuple[int, int, Deferred], ...] = ()  # (at rule, at module rule, entry)
    offloads: tuple[Offload, ...] = ()

    def __init__(
        self,
        *rules: Rule | ShardOver | ModuleRule | Deferred | Offload | Rules,
        strict: bool = False,
        divisible: bool = False,
        tensor_parallel: str | Iterable[str] = (),
    ) -> None:
        flat: list[Rule] = []
        overs: list[ShardOver] = []
        modules: list[ModuleRule] = []
        deferred: list[tuple[int, int, Deferred]] = []
        offloads: list[Offload] = []
        tp = list(normalize_axes(tensor_parallel))
        for r in _spread(rules):
            if isinstance(r, Rules):
                deferred.extend((i + len(flat), j + len(modules), d) for i, j, d in r.deferred)
                flat.extend(r.rules)
                overs.extend(o for o in r.overs if o not in overs)
                modules.extend(r.modules)
                offloads.extend(o for o in r.offloads if o not in offloads)
                tp.extend(a for a in r.tensor_parallel if a not in tp)
                strict, divisible = strict or r.strict, divisible or r.divisible
            elif isinstance(r, Rule):
                flat.append(r)
            elif isinstance(r, ShardOver):
                if r not in overs:
                    overs.append(r)
            elif isinstance(r, ModuleRule):
                modules.append(r)
            elif isinstance(r, Deferred):
                deferred.append((len(flat), len(modules), r))
            elif isinstance(r, Offload):
                if r not in offloads:
                    offloads.append(r)
            else:
                raise ShardingError(
                    f"Rules takes Rule, ShardOver, ModuleRule, Offload or Rules values (or lists "
                    f"of them); got {r!r}"
                )
        self.__attrs_init__(
            tuple(flat),
            tuple(overs),
            bool(strict),
            bool(divisible),
            tuple(modules),
            tuple(dict.fromkeys(tp)),
            tuple(deferred),
            tuple(offloads),
        )

    def __add__(self, other: Rule | ShardOver | Rules) -> Rules:
        return Rules(self, other)

    def __radd__(self, other: Rule | ShardOver | int) -> Rules:
        return self if isinstance(other, int) and other == 0 else Rules(other, self)  # sum([...])

    def __iter__(self) -> Any:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def resolve(self, paths: Iterable[str]) -> Rules:
        """These rules with every :class:`Deferred` entry decided by
        ``paths``, the key paths of all the tensors of a tree; rules without
        such entries are returned as they are.

        >>> import torch, shardax as sx
        >>> rules = sx.rules.megatron("tp", names="auto")
        >>> rules
        Rules(megatron('tp', names='auto'))
        >>> rules.resolve(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"]).rules[0]
        Rule('(model\\\\.layers\\\\.\\\\d+\\\\.(self_attn\\\\.[qkv]_proj|mlp\\\\.(shared_expert\\\\.)?(gate|up)_proj))\\\\.weight', P('tp', None))
        """
        if not self.deferred:
            return self
        paths = tuple(paths)
        parts: list[Any] = []
        r0 = m0 = 0
        for i, j, entry in self.deferred:
            parts += [*self.rules[r0:i], *self.modules[m0:j], entry.rules_for(paths)]
            r0, m0 = i, j
        parts += [*self.rules[r0:], *self.modules[m0:], *self.overs, *self.offloads]
        return Rules(
            *parts,
            strict=self.strict,
            divisible=self.divisible,
            tensor_parallel=self.tensor_parallel,
        )

    def _need_decided(self, what: str) -> None:
        if self.deferred:
            raise ShardingError(
                f"Rules.{what} takes rules decided for one tree, and {self.deferred[0][2]!r} is "
                "decided by a tree's paths: use rules.resolve(paths) (shard, init_params and "
                "explain do), or name the model's modules explicitly (names=...)"
            )

    def match(self, path: str) -> Rule | None:
        """The first rule matching ``path``, or None."""
        self._need_decided("match")
        return next((r for r in self.rules if r.matches(path)), None)

    def spec_for(
        self, path: str, shape: Sequence[int], mesh: AbstractMesh, role: str = "params"
    ) -> PartitionSpec:
        """The spec for one leaf in ``role`` (``"params"``, ``"compute"``,
        ``"grads"`` or ``"opt_state"``), checked against its shape and the mesh."""
        self._need_decided("spec_for")
        if role not in ROLES:
            raise ShardingError(f"unknown role {role!r}; roles are {ROLES!r}")
        if len(shape) == 0:
            return P()
        shape = tuple(int(n) for n in shape)
        rule = self.match(path)
        if rule is None:
            if self.strict:
                raise ShardingError(
                    f"no rule matches {path!r} (shape {tuple(shape)}) and the rules are strict; add a "
                    f"rule such as Rule({re.escape(path)!r}, P()) or Rule('.*', P()) at the end"
                )
            spec = P()
        else:
            spec = fit_spec(rule.spec, shape, mesh, path=path, divisible=self.divisible, rule=rule)
        for over in self.overs:
            if over.splits(path, shape, role):
                spec = fit_spec(over.extend(spec, shape, mesh), shape, mesh, path=path)
        return spec

    def placement(self, path: str, shape: Sequence[int], mesh: AbstractMesh) -> Placement:
        """The compute, grads and opt_state layouts of one leaf."""
        self._need_decided("placement")
        rule = self.match(path) if len(shape) else None
        partial = rule.partial if rule is not None else ()
        compute = Layout(mesh, self.spec_for(path, shape, mesh, "compute"), partial=partial)
        grads, opt = (Layout(mesh, self.spec_for(path, shape, mesh, r)) for r in ROLES[2:])
        memory = {}
        for offload in self.offloads:  # the first that places a role wins
            if offload.matches(path):
                for role in offload.roles:
                    memory.setdefault(role, offload.kind)
        weights, secondary, keep = "exact", None, False
        zeropp = any(o.quantize_weights or o.secondary or o.keep_gathered for o in self.overs)
        if zeropp and len(shape) and self.spec_for(path, shape, mesh, "params") != compute.spec:
            # gathered for compute: how (ZeRO++)
            for over in self.overs:
                if over.splits(path, shape, "params"):
                    weights = "int8" if over.quantize_weights else weights
                    keep = keep or over.keep_gathered
                    if over.secondary and secondary is None and not compute.partial:
                        spec = ShardOver(over.secondary).extend(compute.spec, shape, mesh)
                        spec = fit_spec(spec, shape, mesh, path=path)
                        secondary = Layout(mesh, spec) if spec != compute.spec else None
        across: tuple[str, ...] = ()
        if grads.spec != compute.spec and not compute.partial:  # reduce-scattered: how (qgZ)
            over = next((o for o in self.overs if o.quantize_grads and "grads" in o.roles
                         and o.matches(path)), None)  # fmt: skip
            if over is not None and set(over.axis) <= set(grads.spec.axes):
                across = over.axis[:1]
        return Placement(
            compute, grads, opt, modules=self.modules, memory=memory, weights=weights,
            secondary=secondary, grads_across=across, keep_gathered=keep,
        )  # fmt: skip

    def unmatched(self, paths: Iterable[str]) -> list[str]:
        """The paths no rule matches."""
        paths = list(paths)
        rules = self.resolve(paths)
        return [p for p in paths if rules.match(p) is None]

    def unsplit_weights(self, shapes: Mapping[str, Sequence[int]]) -> list[str]:
        """The weight matrices — 2-D tensors whose path ends in ``.weight``
        — of ``shapes`` (path → shape, every tensor of a tree) that these
        rules do not split over their ``tensor_parallel`` axes: no rule
        matches them, or the one that does splits them over other axes
        only. A rule that replicates (``P()``) is a choice, not an
        omission: its weights are not listed.

        >>> rules = Rules(Rule("fc.weight", P("tp")), Rule("pos.weight", P()), tensor_parallel="tp")
        >>> rules.unsplit_weights({"fc.weight": (8, 4), "pos.weight": (8, 4), "out.weight": (4, 8), "norm.weight": (4,)})
        ['out.weight']
        """
        rules = self.resolve(shapes)
        tp = set(rules.tensor_parallel)
        if not tp:
            return []
        out = []
        for path, shape in shapes.items():
            if len(shape) != 2 or path.rsplit(".", 1)[-1] != "weight":
                continue
            rule = rules.match(path)
            if rule is None or (rule.spec.axes and not tp & set(rule.spec.axes)):
                out.append(path)
        return out

    def replicated(
        self, tree: Any, mesh: AbstractMesh, axis: str | None = None, role: str = "compute"
    ) -> list[tuple[str, tuple[int, ...], int]]:
        """The tensors of ``tree`` (meta tensors do) that these rules leave
        whole over ``axis`` (over every axis when None) in ``role`` —
        ``(path, shape, bytes)``, largest first: the check that a
        parallelism preset's names reached every large weight.

        >>> import torch, shardax as sx
        >>> tree = {"fc.weight": torch.empty(64, 16, device="meta"), "norm.weight": torch.empty(16, device="meta")}
        >>> sx.Rules(sx.Rule("fc.weight", sx.P("tp"))).replicated(tree, sx.AbstractMesh({"tp": 2}), "tp")
        [('norm.weight', (16,), 64)]
        """
        from .._tree import flatten_with_paths

        paths, leaves, _ = flatten_with_paths(tree)
        rules = self.resolve(p for p, x in zip(paths, leaves, strict=True) if hasattr(x, "shape"))
        out = []
        for path, x in zip(paths, leaves, strict=True):
            shape = tuple(getattr(x, "shape", ()))
            if not hasattr(x, "dtype") or not shape:
                continue
            used = set(rules.spec_for(path, shape, mesh, role).axes)
            if (axis in used) if axis is not None else used:
                continue
            out.append((path, shape, math.prod(shape) * x.dtype.itemsize))
        return sorted(out, key=lambda r: -r[2])

    def __repr__(self) -> str:
        flags = (
            (", strict=True" if self.strict else "")
            + (", divisible=True" if self.divisible else "")
            + (f", tensor_parallel={self.tensor_parallel!r}" if self.tensor_parallel else "")
        )
        entries: list[Any] = []
        r0 = 0
        for i, _, entry in self.deferred:
            entries += [*self.rules[r0:i], entry]
            r0 = i
        entries += [*self.rules[r0:], *self.overs, *self.modules, *self.offloads]
        return "Rules(" + ", ".join(repr(r) for r in entries) + flags + ")"


def fit_spec(
    spec: PartitionSpec,
    shape: Sequence[int],
    mesh: AbstractMesh,
    *,
    path: str = "",
    divisible: bool = False,
    rule: Rule | None = None,
) -> PartitionSpec:
    """Check ``spec`` fits a tensor of ``shape`` on ``mesh``; return it.

    >>> fit_spec(P("dp"), (6,), AbstractMesh({"dp": 4}), path="w", divisible=True)
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: 'w': dim 0 (size 6) of shape (6,) is not divisible by 4, the size of axes ('dp',) in P('dp') on AbstractMesh({'dp': 4}); pad the dim, pick other axes, or allow uneven shards (divisible=False)
    """
    where = f"{path!r}: " if path else ""
    src = f" (from {rule!r})" if rule is not None else ""
    try:
        sharding = NamedSharding(mesh, spec)
    except ShardingError as err:
        raise ShardingError(f"{where}{err}{src}") from None
    if sharding.spec.zigzagged:
        raise ShardingError(
            f"{where}{spec!r}{src} on {mesh!r} splits a dim zigzag, which lays out batches "
            "(sx.data) and activations under rules.context_parallel, not parameters or other "
            "stored tensors; split the dim plainly (P('cp') rather than P(zigzag('cp'))) or "
            "with blocks(...)"
        )
    sharding.check_shape(shape, path=path, source=src)
    for d, (size, k) in enumerate(zip(shape, sharding.spec.dim_blocks(len(shape)), strict=True)):
        if size % k:
            raise ShardingError(
                f"{where}dim {d} (size {size}) of shape {tuple(shape)} cannot be {k} equal blocks, "
                f"as {spec!r}{src} says on {mesh!r}; the rule is for another tensor, or the "
                "block count is wrong"
            )
    if divisible:
        for d, (size, axes) in enumerate(zip(shape, sharding.dim_axes(len(shape)), strict=True)):
            n = math.prod(mesh.size(a) for a in axes) * sharding.spec.dim_blocks(len(shape))[d]
            if size % n:
                raise ShardingError(
                    f"{where}dim {d} (size {size}) of shape {tuple(shape)} is not divisible by {n}, "
                    f"the size of axes {axes!r} in {spec!r}{src} on {mesh!r}; pad the dim, pick other "
                    "axes, or allow uneven shards (divisible=False)"
                )
    return spec
