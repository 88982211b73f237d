"""Roles of a parameter: where it is stored, computed with, reduced to and
optimised in — and ``ShardOver``, the rule that makes ZeRO.

A parameter has four layouts. Its *params* layout is where it lives between
steps (the ``Sharded`` leaf's own layout). Its *compute* layout is what the
module sees inside :func:`shardax.apply` (tensor-parallel splits stay, data
axes are gathered). Its *grads* layout is where :func:`shardax.value_and_grad`
reduces its gradient to, and its *opt_state* layout is where the optimizer
keeps its moments. ZeRO stages differ only in which of the last three are
split over the data axes (Rajbhandari et al., 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models"):

=====  ===========  =============  ============
stage  params       grads          opt_state
=====  ===========  =============  ============
0      replicated   replicated     replicated
1      replicated   replicated     split
2      replicated   split          split
3      split        split          split
=====  ===========  =============  ============
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, normalize_axes
from ._layout import Layout
from ._spec import Blocks, P, PartitionSpec

__all__ = ["ROLES", "Placement", "ShardOver", "memory_kind", "role_layout", "weights_of"]

ROLES = ("params", "compute", "grads", "opt_state")
_SPLITTABLE = ("params", "grads", "opt_state")


def _roles(value: str | Iterable[str]) -> tuple[str, ...]:
    roles = (value,) if isinstance(value, str) else tuple(value)
    for role in roles:
        if role not in _SPLITTABLE:
            raise ShardingError(
                f"ShardOver roles are some of {_SPLITTABLE!r}; got {role!r} (the compute layout "
                "comes from the ordinary rules)"
            )
    return tuple(r for r in _SPLITTABLE if r in roles)


def _axes(value: str | Iterable[str]) -> tuple[str, ...]:
    axes = normalize_axes(value)
    if not axes:
        raise ShardingError("ShardOver needs at least one mesh axis, e.g. ShardOver('dp')")
    return axes


@attrs.frozen(repr=False)
class ShardOver:
    """Additionally split the leaves matching ``pattern`` over ``axis`` in the
    given roles, on top of the spec the ordinary rules give them. The split
    goes on the first dim that stays evenly divisible (else dim 0, in uneven
    chunks), after any axes already on that dim. Of several axes, those a
    leaf is already split over are left out (experts split over ``ep`` by
    ``rules.experts`` take ZeRO's ``("dp", "ep")`` over ``dp`` only, the data
    ranks that hold the same experts); leaves split over all of them, and
    scalars, are left alone. ``rules.zero`` is made of these.

    >>> from shardax import AbstractMesh, P
    >>> over = ShardOver("dp", roles=("grads", "opt_state"))
    >>> over
    ShardOver('dp', roles=('grads', 'opt_state'))
    >>> mesh = AbstractMesh({"dp": 2, "tp": 2})
    >>> over.extend(P("tp", None), (8, 6), mesh)
    P(('tp', 'dp'))
    >>> over.extend(P(), (3, 4), mesh)
    P(None, 'dp')
    >>> ShardOver(("dp", "tp")).extend(P("tp", None), (8, 6), mesh)
    P(('tp', 'dp'))
    """

    axis: tuple[str, ...] = attrs.field(converter=_axes)
    roles: tuple[str, ...] = attrs.field(default=_SPLITTABLE, converter=_roles)
    pattern: str = ".*"
    quantize_weights: bool = attrs.field(default=False, kw_only=True, converter=bool)
    """ZeRO++'s qwZ: the params → compute gathers send int8 blocks."""
    secondary: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=normalize_axes)
    """ZeRO++'s hpZ: the axes (within a node) a second copy of each gathered
    parameter stays split over until backward, which gathers it over these
    axes only."""
    quantize_grads: bool = attrs.field(default=False, kw_only=True, converter=bool)
    """ZeRO++'s qgZ: gradients reduce-scattered in int4, by an all-to-all
    over the later axes (within a node), then one over the first (across
    nodes)."""
    keep_gathered: bool = attrs.field(default=False, kw_only=True, converter=bool)
    """The forward's gathered parameters are kept until backward has used
    them, not gathered again (FSDP2's ``reshard_after_forward=False``)."""
    persist_below: int = attrs.field(default=0, kw_only=True)
    """Leaves of fewer elements than this are not split in the params role
    (whole on every rank: no gathers in forward or backward; their
    gradients and optimizer state still split): DeepSpeed's
    ``stage3_param_persistence_threshold``."""
    _regex: re.Pattern[str] = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.quantize_grads and ("grads" not in self.roles or len(self.axis) < 2):
            raise ShardingError(
                f"ShardOver({self.axis!r}, roles={self.roles!r}, quantize_grads=True): qgZ "
                "reduce-scatters split gradients hierarchically, so it needs ZeRO-2 or 3 "
                "(roles including 'grads') over two axes, the one across nodes first: "
                "rules.zero(3, ('node', 'local'), quantize_grads=True)"
            )
        if (self.quantize_weights or self.secondary) and "params" not in self.roles:
            option = "quantize_weights" if self.quantize_weights else "secondary"
            raise ShardingError(
                f"ShardOver({option}=...) changes how split parameters are gathered, and "
                f"{self.roles!r} does not split the parameters: use ZeRO-3 "
                "(rules.zero(3, ...), roles including 'params')"
            )
        n = self.persist_below
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ShardingError(
                f"ShardOver(persist_below={n!r}): a number of elements >= 0 (0: split every leaf)"
            )
        if self.keep_gathered and ("params" not in self.roles or self.secondary):
            raise ShardingError(
                f"ShardOver({self.axis!r}, roles={self.roles!r}, keep_gathered=True"
                + (f", secondary={self.secondary!r}" if self.secondary else "")
                + "): keeping the gathered parameters for backward needs ZeRO-3 (roles including "
                "'params'), and makes hpZ's secondary copy pointless (backward gathers nothing): "
                "choose one of keep_gathered and secondary"
            )
        if n and "params" not in self.roles:
            raise ShardingError(
                f"ShardOver(persist_below={n}) keeps small parameters whole, and "
                f"{self.roles!r} does not split the parameters: use ZeRO-3 "
                "(rules.zero(3, persist_below=...), roles including 'params')"
            )
        outside = [a for a in self.secondary if a not in self.axis]
        if outside or self.secondary == self.axis:
            raise ShardingError(
                f"ShardOver(secondary={self.secondary!r}): the secondary copy is split over some "
                f"of the axes the parameters are split over, {self.axis!r}, not all of them "
                f"(the node-local ones, e.g. secondary={self.axis[-1]!r})"
                + (f"; {outside!r} are not among them" if outside else "")
            )

    @_regex.default
    def _make_regex(self) -> re.Pattern[str]:
        try:
            return re.compile(self.pattern)
        except re.error as err:
            raise ShardingError(
                f"ShardOver pattern {self.pattern!r} is not a valid regex: {err}"
            ) from None

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None

    def splits(self, path: str, shape: Sequence[int], role: str) -> bool:
        """Whether this entry splits the leaf ``path`` of ``shape`` in ``role``.

        >>> over = ShardOver("dp", persist_below=100)
        >>> [over.splits("w", (8, 16), "params"), over.splits("b", (8,), "params"), over.splits("b", (8,), "grads")]
        [True, False, True]
        """
        if role not in self.roles or not self.matches(path):
            return False
        return role != "params" or math.prod(shape) >= self.persist_below

    def extend(
        self, spec: PartitionSpec, shape: Sequence[int], mesh: AbstractMesh
    ) -> PartitionSpec:
        """``spec`` with ``axis`` added on the dim it fits best."""
        mesh.check_axes(self.axis, what=f"axes of {self!r}")
        adding = tuple(a for a in self.axis if a not in spec.axes)
        if not shape or not adding:
            return spec
        entries = list(spec) + [None] * (len(shape) - len(spec))
        new = math.prod(mesh.size(a) for a in adding)

        ks = spec.dim_blocks(len(shape))

        def existing(d: int) -> tuple[str, ...]:
            e = entries[d]
            if isinstance(e, Blocks):
                return e.axes
            return () if e is None else (e,) if isinstance(e, str) else tuple(e)

        def fits(d: int) -> bool:  # each block (the dim, unblocked) splits evenly
            have = math.prod(mesh.size(a) for a in existing(d))
            size = shape[d] // ks[d]
            return size % (have * new) == 0 and size >= have * new

        dim = next((d for d in range(len(shape)) if fits(d)), 0)
        axes = existing(dim) + adding
        entries[dim] = Blocks(ks[dim], axes) if ks[dim] > 1 else axes[0] if len(axes) == 1 else axes
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def __repr__(self) -> str:
        axis = self.axis[0] if len(self.axis) == 1 else self.axis
        roles = "" if self.roles == _SPLITTABLE else f", roles={self.roles!r}"
        pattern = "" if self.pattern == ".*" else f", pattern={self.pattern!r}"
        q = ", quantize_weights=True" if self.quantize_weights else ""
        q += ", quantize_grads=True" if self.quantize_grads else ""
        second = self.secondary[0] if len(self.secondary) == 1 else self.secondary
        secondary = f", secondary={second!r}" if self.secondary else ""
        persist = ", keep_gathered=True" if self.keep_gathered else ""
        persist += f", persist_below={self.persist_below}" if self.persist_below else ""
        return f"ShardOver({axis!r}{roles}{pattern}{q}{secondary}{persist})"


@attrs.frozen(repr=False)
class Placement:
    """The layouts of a parameter's other roles (its own layout is the params
    role), and the module rules that go with them. Built by
    :func:`shardax.shard` (and ``init_params``) from rules; carried by the
    ``Sharded`` parameter so that :func:`shardax.apply`,
    :func:`shardax.value_and_grad` and the optimizers need no rules.

    >>> from shardax import AbstractMesh, Layout, P
    >>> mesh = AbstractMesh({"dp": 2})
    >>> Placement(Layout(mesh), Layout(mesh, P("dp")), Layout(mesh, P("dp")))
    Placement(compute=P(), grads=P('dp'), opt_state=P('dp'))
    """

    compute: Layout
    grads: Layout
    opt_state: Layout
    modules: tuple[Any, ...] = attrs.field(default=(), kw_only=True, converter=tuple)
    """The module rules (:class:`~shardax.ModuleRule`) of the rules that
    placed it: :func:`shardax.apply` installs them, with no ``rules=``."""
    memory: tuple[tuple[str, str], ...] = attrs.field(
        default=(), kw_only=True, converter=lambda m: tuple(dict(m).items())
    )
    """The memory kind of each role not on the device (``rules.offload``):
    ``(("opt_state", "disk:/scratch/opt"),)``."""
    weights: str = attrs.field(default="exact", kw_only=True)
    """How the params → compute gathers send it: ``"exact"``, or ``"int8"``
    blocks (ZeRO++'s qwZ, ``rules.zero(3, quantize_weights=True)``)."""
    secondary: Layout | None = attrs.field(default=None, kw_only=True)
    """ZeRO++'s hpZ: the layout a second copy of the gathered parameter
    keeps from forward to backward, which gathers it from there."""
    grads_across: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=tuple)
    """ZeRO++'s qgZ: the axes across nodes, when the gradient contributions
    are reduce-scattered in int4 (within a node over the grads layout's
    other axes, then across these); () for an exact reduction."""
    keep_gathered: bool = attrs.field(default=False, kw_only=True, converter=bool)
    """The forward's gather is kept for the backward, not made again
    (``rules.zero(3, keep_gathered=True)``)."""

    def memory_kind(self, role: str) -> str:
        """Where ``role``'s local data lives: ``"device"`` unless offloaded.

        >>> from shardax import AbstractMesh, Layout
        >>> mesh = AbstractMesh({"dp": 2})
        >>> Placement(Layout(mesh), Layout(mesh), Layout(mesh), memory={"opt_state": "host"}).memory_kind("opt_state")
        'host'
        """
        return dict(self.memory).get(role, "device")

    def __attrs_post_init__(self) -> None:
        meshes = {self.compute.mesh, self.grads.mesh, self.opt_state.mesh}
        if self.secondary is not None:
            meshes.add(self.secondary.mesh)
        if self.weights not in ("exact", "int8"):
            raise ShardingError(
                f"a Placement's weights are 'exact' or 'int8'; got {self.weights!r}"
            )
        if len(meshes) != 1:
            raise ShardingError(f"a Placement's layouts must share one mesh; got {meshes!r}")
        for role in ("grads", "opt_state"):  # compute may be partial (a masked bias)
            if getattr(self, role).partial:
                raise ShardingError(f"a Placement's {role} layout cannot be partial")
        if set(self.compute.partial) & set(self.grads.spec.axes):
            raise ShardingError(
                f"a compute layout partial over {self.compute.partial!r} needs grads replicated "
                f"there; got {self.grads.spec!r}"
            )

    def __repr__(self) -> str:
        partial = f" partial={self.compute.partial!r}" if self.compute.partial else ""
        memory = f", memory={dict(self.memory)!r}" if self.memory else ""
        weights = f", weights={self.weights!r}" if self.weights != "exact" else ""
        secondary = f", secondary={self.secondary.spec!r}" if self.secondary is not None else ""
        if self.grads_across:
            secondary += f", grads_across={self.grads_across!r}"
        if self.keep_gathered:
            secondary += ", keep_gathered=True"
        return (
            f"Placement(compute={self.compute.spec!r}{partial}, grads={self.grads.spec!r}, "
            f"opt_state={self.opt_state.spec!r}{memory}{weights}{secondary})"
        )


def role_layout(x: Any, role: str) -> Layout:
    """The layout of ``x`` (a ``Sharded`` parameter) in ``role``: its own for
    ``"params"``; from its placement otherwise; without a placement (sharded by
    spec, not rules) compute is replicated and grads / opt_state follow the
    params. A param diverged over some axes (each rank's own copy) is
    computed diverged there: every rank with the copy it holds.

    >>> import torch, shardax as sx
    >>> x = sx.shard(torch.ones(4), sx.Mesh({"dp": 1}), sx.P("dp"))
    >>> role_layout(x, "compute"), role_layout(x, "grads")
    (Layout(Mesh({'dp': 1}), P()), Layout(Mesh({'dp': 1}), P('dp')))
    """
    if role not in ROLES:
        raise ShardingError(f"unknown role {role!r}; roles are {ROLES!r}")
    if role == "params":
        return x.layout
    placement = getattr(x, "placement", None)
    if placement is None:
        layout = Layout(x.mesh) if role == "compute" else x.layout.settled()
    else:
        layout = getattr(placement, role)
    diverged = x.layout.diverged
    if role != "compute" or not diverged:
        return layout
    # Each rank computes with its own copy (0/1 Adam's local steps): the
    # compute layout is diverged where the params are.
    try:
        return Layout(layout.sharding, partial=layout.partial, diverged=diverged)
    except ShardingError as err:
        raise ShardingError(
            f"a param diverged over {diverged!r} ({x.layout!r}) cannot be computed "
            f"{layout!r}: {err}. Transfer it to {x.layout.settled()!r} (the ranks' mean) first"
        ) from None


def memory_kind(x: Any, role: str) -> str:
    """Where ``x``'s data lives in ``role``: ``"device"`` unless its
    placement offloads that role (``rules.offload``)."""
    placement = getattr(x, "placement", None)
    return "device" if placement is None else placement.memory_kind(role)


def weights_of(x: Any) -> str:
    """How ``x``'s params → compute gathers send it: ``"exact"``, or
    ``"int8"`` (ZeRO++'s qwZ)."""
    placement = getattr(x, "placement", None)
    return "exact" if placement is None else placement.weights
