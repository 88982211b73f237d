"""Sharding rules: key-path patterns → specs, first match wins.

Parallelism presets (``rules.zero``, ``rules.megatron``, …) are functions
that return :class:`Rules`; nothing more magical than that.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh
from ._spec import NamedSharding, P, PartitionSpec, as_spec

__all__ = ["Rule", "Rules", "fit_spec"]


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
    """

    pattern: str
    spec: PartitionSpec = attrs.field(converter=as_spec)
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

    def __add__(self, other: Rule | Rules) -> Rules:
        return Rules(self) + other

    def __radd__(self, other: Rule | int) -> Rules:
        return Rules(self) if isinstance(other, int) and other == 0 else Rules(other, self)

    def __repr__(self) -> str:
        return f"Rule({self.pattern!r}, {self.spec!r})"


def _glob_regex(pattern: str) -> str:
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)


@attrs.frozen(init=False, repr=False)
class Rules:
    """An ordered set of rules; the first that matches a path wins, and
    unmatched leaves are replicated — or, with ``strict=True``, an error that
    lists every unmatched path. ``divisible=True`` makes a split dim that the
    axes do not divide evenly an error. Compose with ``+`` (flags OR).

    >>> rules = Rules(Rule(r".*\\.weight", P("dp")), strict=True)
    >>> rules.spec_for("mlp.weight", (8, 4), AbstractMesh({"dp": 2}))
    P('dp')
    >>> rules.spec_for("mlp.bias", (8,), AbstractMesh({"dp": 2}))
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: no rule matches 'mlp.bias' (shape (8,)) and the rules are strict; add a rule such as Rule('mlp\\\\.bias', P()) or Rule('.*', P()) at the end
    """

    rules: tuple[Rule, ...]
    strict: bool
    divisible: bool

    def __init__(self, *rules: Rule | Rules, strict: bool = False, divisible: bool = False) -> None:
        flat: list[Rule] = []
        for r in rules:
            if isinstance(r, Rules):
                flat.extend(r.rules)
                strict, divisible = strict or r.strict, divisible or r.divisible
            elif isinstance(r, Rule):
                flat.append(r)
            else:
                raise ShardingError(f"Rules takes Rule or Rules values; got {r!r}")
        self.__attrs_init__(tuple(flat), bool(strict), bool(divisible))

    def __add__(self, other: Rule | Rules) -> Rules:
        return Rules(self, other)

    def __radd__(self, other: Rule | int) -> Rules:
        return self if isinstance(other, int) and other == 0 else Rules(other, self)  # sum([...])

    def __iter__(self) -> Any:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def match(self, path: str) -> Rule | None:
        """The first rule matching ``path``, or None."""
        return next((r for r in self.rules if r.matches(path)), None)

    def spec_for(self, path: str, shape: Sequence[int], mesh: AbstractMesh) -> PartitionSpec:
        """The spec for one leaf, checked against its shape and the mesh."""
        if len(shape) == 0:
            return P()
        rule = self.match(path)
        if rule is None:
            if self.strict:
                raise ShardingError(
                    f"no rule matches {path!r} (shape {tuple(shape)}) and the rules are strict; add a "
                    f"rule such as Rule({re.escape(path)!r}, P()) or Rule('.*', P()) at the end"
                )
            return P()
        return fit_spec(rule.spec, shape, mesh, path=path, divisible=self.divisible, rule=rule)

    def unmatched(self, paths: Iterable[str]) -> list[str]:
        """The paths no rule matches."""
        return [p for p in paths if self.match(p) is None]

    def __repr__(self) -> str:
        flags = (", strict=True" if self.strict else "") + (
            ", divisible=True" if self.divisible else ""
        )
        return "Rules(" + ", ".join(repr(r) for r in self.rules) + flags + ")"


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
    sharding.check_shape(shape, path=path, source=src)
    if divisible:
        for d, (size, axes) in enumerate(zip(shape, sharding.dim_axes(len(shape)), strict=True)):
            n = math.prod(mesh.size(a) for a in axes)
            if size % n:
                raise ShardingError(
                    f"{where}dim {d} (size {size}) of shape {tuple(shape)} is not divisible by {n}, "
                    f"the size of axes {axes!r} in {spec!r}{src} on {mesh!r}; pad the dim, pick other "
                    "axes, or allow uneven shards (divisible=False)"
                )
    return spec
