"""``apply``: run a module with parameters from a pytree, each module's
parameters relaid from their storage layout to their compute layout just
before it runs and released after.

The module tree is cut into *units* (by default: the root and every module
held in a ``ModuleList``/``ModuleDict``/``Sequential`` — the transformer
blocks). A unit's parameters are gathered in one collective when its forward
starts and the next unit's gather is started meanwhile (prefetch); when the
unit's forward ends they are released. Under :func:`shardax.value_and_grad`
the gathered tensors that autograd saves for backward are not kept: they are
saved as tokens and gathered again when backward needs them (ZeRO-3 peak
memory ≈ the shards plus about one unit), and each parameter's gradient is
handed to the bucketed reducer the moment it is final.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..collectives._agree import moving
from ..errors import ShardingError
from ._grad import current_tape
from ._layout import Layout
from ._matching import as_rules
from ._memory import prefetch_all, release_all
from ._modules import install
from ._placement import role_layout, weights_of
from ._regather import Regather
from ._remat import Recompute, applying
from ._sharded import Sharded
from ._transfer import Batch, program, through_int8, transfer, transfer_many

__all__ = ["StopForward", "apply"]


class StopForward(Exception):
    """Raised by a hook inside :func:`apply`'s forward to end it early:
    ``apply`` returns ``value`` (a pipeline stage's output, the rest of the
    model being other stages'), its gathers released as at a normal end."""

    def __init__(self, value: Any) -> None:
        super().__init__("forward stopped early")
        self.value = value


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
Units = str | Callable[[str, nn.Module], bool] | None


def _is_unit(units: Units) -> Callable[[str, nn.Module, nn.Module | None], bool]:
    if units is None:
        return lambda path, m, parent: (
            isinstance(parent, _CONTAINERS) and not isinstance(m, _CONTAINERS)
        )
    if isinstance(units, str):
        regex = re.compile(units)
        return lambda path, m, parent: regex.fullmatch(path) is not None
    if callable(units):
        return lambda path, m, parent: bool(units(path, m))
    raise ShardingError(f"units is a regex over module paths, a predicate or None; got {units!r}")


class _Unit:
    __slots__ = ("index", "module", "path", "slots")

    def __init__(self, index: int, path: str, module: nn.Module) -> None:
        self.index, self.path, self.module = index, path, module
        self.slots: list[tuple[str, Any, list[tuple[nn.Module, str, bool]]]] = []


Shared = list[tuple[str, Any, list[str]]]
"""``(key path, leaf, module paths)`` of each parameter several modules use."""


def _plan(model: nn.Module, params: dict[str, Any], units: Units) -> tuple[list[_Unit], Shared]:
    """The units in forward order, each with its leaves and their owners;
    and the parameters several modules share (tied weights)."""
    is_unit = _is_unit(units)
    unit_of: dict[str, _Unit] = {"": _Unit(0, "", model)}
    order = [unit_of[""]]
    parents: dict[str, str] = {}
    owners: dict[int, list[tuple[str, nn.Module, str, bool]]] = {}
    canonical: dict[int, str] = {}
    users: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if path:
            parent_path = path.rpartition(".")[0]
            parent = model.get_submodule(parent_path) if parent_path else model
            if is_unit(path, module, parent):
                if path not in unit_of:
                    unit_of[path] = _Unit(len(order), path, module)
                    order.append(unit_of[path])
                parents[path] = path
            else:
                parents[path] = parents.get(parent_path, "")
        else:
            parents[path] = ""
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is None:
                    continue
                full = f"{path}.{name}" if path else name
                canonical.setdefault(id(t), full)
                owners.setdefault(id(t), []).append((parents[path], module, name, kind == "param"))
                if kind == "param":
                    users.setdefault(id(t), []).append(path)
    known = {canonical[k]: k for k in canonical}
    params = dict(params)
    for path in sorted(set(known) - set(params)):  # a buffer left out: the model's own
        _, module, name, is_param = owners[known[path]][0]
        own = module._buffers.get(name) if not is_param else None
        if own is not None and own.device.type != "meta":
            params[path] = own
    missing = sorted(set(known) - set(params))
    extra = sorted(set(params) - set(known))
    if missing or extra:
        raise ShardingError(
            "apply: the params do not match the model's parameters and buffers"
            + (f"; missing: {missing}" if missing else "")
            + (f"; unexpected: {extra}" if extra else "")
            + " (build them with shardax.params_of(model) or shardax.init_params(model, ...))"
        )
    for path, key in sorted(known.items()):
        unit_paths = {u for u, _, _, _ in owners[key]}
        unit = unit_of[unit_paths.pop()] if len(unit_paths) == 1 else unit_of[""]
        where = [(m, name, is_param) for _, m, name, is_param in owners[key]]
        x = params[path]
        _, module, name, is_param = owners[key][0]
        own = (module._parameters if is_param else module._buffers)[name]
        shape = x.shape if isinstance(x, (Sharded, torch.Tensor)) else None
        if shape is not None and tuple(shape) != tuple(own.shape):
            raise ShardingError(
                f"apply: params[{path!r}] has shape {tuple(shape)}, the model's tensor "
                f"{tuple(own.shape)}; a parameter keeps its shape under every layout (were "
                "the params made for another model?)"
            )
        unit.slots.append((path, x, where))
    shared = [
        (path, params[path], users[k]) for path, k in known.items() if len(users.get(k, ())) > 1
    ]
    return order, shared


def _moved(unit: _Unit) -> str:
    """The parameters a unit's gathers move, for collective error messages."""
    paths = [path for path, x, _ in unit.slots if isinstance(x, Sharded)]
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    return f"{shown} (gathered for {unit.path or 'the model'})"


def _gather(unit: _Unit, kept: list[Sharded | None] | None = None) -> Batch:
    """Start gathering ``unit``'s parameters to their compute layouts —
    in int8 where their placement says so (ZeRO++'s qwZ), from the
    secondary copies in ``kept`` where given (hpZ) —; the shards on disk
    (``rules.offload("params", ...)``) leave the process once the gather
    has read them."""
    items = _items(unit)
    kept = [None] * len(items) if kept is None else kept
    int8 = [k is None and weights_of(x) == "int8" for (x, _), k in zip(items, kept, strict=True)]
    sources = [(x if k is None else k, layout) for (x, layout), k in zip(items, kept, strict=True)]
    with moving(_moved(unit)):
        batch = transfer_many(sources, int8=int8)
    return batch.then(lambda: release_all(x.local for x, _ in items))


class _ThroughInt8(torch.autograd.Function):
    """The values an int8 gather delivers, with the gradient passed
    straight through (as the quantized gathers' weights get theirs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return through_int8(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _int8_values(x: Sharded, layout: Layout) -> Sharded:
    """Under plain autograd, a leaf gathered in int8 (qwZ) takes the
    values the quantized gather gives, moved at full width by the
    differentiable transfer."""
    if weights_of(x) != "int8" or not program(x.layout, layout, x.shape).ops:
        return x
    return Sharded(_ThroughInt8.apply(x.local), x.layout, x.shape, placement=x.placement)


def _secondaries(unit: _Unit, values: Sequence[torch.Tensor]) -> list[Sharded | None] | None:
    """hpZ: of each of ``unit``'s gathered parameters whose placement has a
    secondary layout, this rank's piece in it (a copy, the gathered buffer
    goes), else None; None when the unit has none."""
    kept: list[Sharded | None] = []
    for (x, layout), value in zip(_items(unit), values, strict=True):
        second = x.placement.secondary if x.placement is not None else None
        if second is None:
            kept.append(None)
            continue
        local = program(layout, second, x.shape).run(value.detach()).clone()
        kept.append(Sharded(local, second, x.shape, placement=x.placement))
    return kept if any(k is not None for k in kept) else None


def _keeps_gathered(unit: _Unit) -> bool:
    """Whether ``unit``'s gathered parameters stay alive for its backward
    (``rules.zero(3, keep_gathered=True)`` placed each of them): autograd
    keeps what it saves of them, and backward gathers nothing."""
    items = _items(unit)
    return bool(items) and all(
        x.placement is not None and x.placement.keep_gathered for x, _ in items
    )


def _items(unit: _Unit) -> list[tuple[Sharded, Layout]]:
    """A unit's Sharded parameters, each with the layout it computes in."""
    return [(x, role_layout(x, "compute")) for _, x, _ in unit.slots if isinstance(x, Sharded)]


class _Run:
    """One call of :func:`apply`'s forward: each unit's parameters relaid
    to their compute layouts when the unit starts (the next unit's gather
    started meanwhile, with ``prefetch``), put in its modules, and put back
    when it ends.

    How they are relaid depends on who differentiates. Under
    :func:`shardax.value_and_grad`, gathers are not differentiable: each
    parameter goes in through ``lift`` (which routes its gradient to the
    tape) and the gathered buffers are held by ``regather`` while the unit
    runs (backward gathers them again). Under plain autograd, each parameter
    is moved by the differentiable :func:`transfer` instead; without grad,
    gathered as under ``value_and_grad``, with nothing kept for backward.
    """

    def __init__(
        self,
        units: list[_Unit],
        prefetch: bool,
        lift: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        regather: Regather | None = None,
    ) -> None:
        self.units, self.prefetch, self.lift, self.regather = units, prefetch, lift, regather
        self.differentiable = lift is None and torch.is_grad_enabled()
        self.pending: dict[int, Batch] = {}
        self.originals: dict[tuple[int, str], Any] = {}
        self.kept: dict[int, list[Sharded | None]] = {}  # hpZ: unit -> its secondary copies

    def gather_again(self, index: int) -> Batch:
        """Backward's gather of unit ``index``: from its secondary copies
        where forward kept them (hpZ), else as forward's."""
        return _gather(self.units[index], self.kept.pop(index, None))

    def _start(self, unit: _Unit) -> Batch:
        if unit.index not in self.pending:
            self.pending[unit.index] = _gather(unit)
            if self.prefetch and unit.index + 1 < len(self.units):  # shards on disk: read ahead
                prefetch_all(x.local for x, _ in _items(self.units[unit.index + 1]))
        return self.pending[unit.index]

    def enter(self, unit: _Unit) -> None:
        if self.differentiable:
            with moving(_moved(unit)):
                values = [
                    transfer(_int8_values(x, layout), layout).local for x, layout in _items(unit)
                ]
            release_all(x.local for x, _ in _items(unit))
        else:
            gathered = self._start(unit)
            self.pending.pop(unit.index, None)
            values = gathered.wait()
            if self.regather is not None and not _keeps_gathered(unit):
                self.regather.hold(unit.index, gathered)
                kept = _secondaries(unit, values)
                if kept is not None:
                    self.kept[unit.index] = kept
        if self.prefetch and not self.differentiable and unit.index + 1 < len(self.units):
            self._start(self.units[unit.index + 1])
        it = iter(values)
        for _path, x, where in unit.slots:
            value = next(it) if isinstance(x, Sharded) else x
            if not any(is_param for _, _, is_param in where):
                value = value.detach()  # a buffer: never trained, its gradient None
            elif self.lift is not None:
                value = self.lift(x, value)
            for module, name, is_param in where:
                table = module._parameters if is_param else module._buffers
                self.originals.setdefault((id(module), name), (table, name, table[name]))
                table[name] = value

    def leave(self, unit: _Unit) -> None:
        for _, _, where in unit.slots:
            for module, name, _ in where:
                table, _, original = self.originals.pop((id(module), name))
                table[name] = original
        if self.regather is not None:
            self.regather.release(unit.index)

    def close(self) -> None:
        for table, name, original in self.originals.values():
            table[name] = original
        self.originals.clear()
        for gathered in self.pending.values():
            gathered.wait()  # every rank started it: finish it, then drop it
        self.pending.clear()


def apply(
    model: nn.Module,
    params: dict[str, Any],
    *args: Any,
    units: Units = None,
    prefetch: bool = True,
    rules: Any = None,
    method: str | None = None,
    **kwargs: Any,
) -> Any:
    """Call ``model(*args, **kwargs)`` with its parameters and buffers taken
    from ``params`` (a dict of tensors or :class:`Sharded` leaves keyed like
    :func:`shardax.params_of`), each module's relaid to its compute layout
    just in time: under ``rules.zero(3)`` all-gathered when its unit starts,
    released when it ends, and gathered again for backward. ``model`` may
    live on the ``meta`` device; it is never modified.

    Buffers need no handling: given in ``params`` (as ``params_of`` and
    ``init_params`` give them) they are laid out by the rules like any
    tensor, and under :func:`shardax.value_and_grad` they get no gradient
    (None), so :func:`shardax.optim.step` leaves them as they are; left out
    of ``params``, the model's own are used (unless they are on ``meta``).

    Args:
        model: the module (its own parameters are ignored).
        params: the parameters (and buffers), by key path.
        *args: positional arguments of ``model``'s forward.
        units: which modules gather together: a regex over module paths, a
            predicate ``(path, module) -> bool``, or None for the root plus
            every module held in a ``ModuleList``/``ModuleDict``/``Sequential``.
        prefetch: start the next unit's gather while this one computes.
        rules: :class:`Rules` whose :class:`ModuleRule` entries relayout
            activations at module boundaries or replace a module's forward
            (tensor and sequence parallelism: ``rules.megatron``). Not
            needed for params made by :func:`shardax.shard` or
            :func:`shardax.init_params` from rules: they carry their
            placements and these module rules, which apply installs; given,
            they are used instead.
        method: the name of another method of ``model`` to call instead of
            its forward, with the parameters in place for every forward it
            runs (flax's ``apply(..., method=)``): ``"generate"`` for a
            Hugging Face model's sampling loop.
        **kwargs: keyword arguments of ``model``'s forward (or ``method``).

    Returns:
        Whatever ``model`` returns, with the model's own shapes: an output
        a rule split over a mesh axis comes back gathered, or marked as a
        :class:`Sharded` where the rule says so (``rules.megatron(...,
        logits="vocab_parallel")``) — never a bare piece.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(3, 2)
    >>> params = sx.shard({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, mesh, sx.rules.zero(3))
    >>> sx.apply(model, params, torch.ones(1, 3))
    tensor([[3., 3.]])
    """
    if not isinstance(model, nn.Module):
        raise ShardingError(f"apply needs an nn.Module; got {type(model).__name__}")
    call = model
    if method is not None:
        call = getattr(model, method, None) if isinstance(method, str) else None
        if not callable(call):
            raise ShardingError(
                f"apply(method={method!r}): {type(model).__name__} has no such method; give the "
                "name of one, such as 'generate'"
            )
    if not isinstance(params, dict) or any(not isinstance(k, str) for k in params):
        raise ShardingError(
            "apply takes params as a dict keyed by parameter path (as shardax.params_of returns)"
        )
    tape = current_tape()
    plan, shared = _plan(model, params, units)
    regather = None
    if tape is not None:  # backward gathers again what autograd saves of the gathers
        regather = Regather(lambda i: run.gather_again(i), prefetch)
        tape.defer(regather.close)
    run = _Run(plan, prefetch, tape.lift if tape is not None else None, regather)
    if tape is not None:
        tape.defer(run.kept.clear)  # secondary copies backward did not need
    hooks = []
    mesh = next((x.mesh for x in params.values() if isinstance(x, Sharded)), None)
    bound = None
    if rules is not None:  # decided by these params' paths (names="auto")
        bound = as_rules(rules, paths=[k for k, v in params.items() if hasattr(v, "shape")])
    if rules is not None and bound is None:
        raise ShardingError(
            f"apply(rules=...) takes Rules (or a Rule, or a list of them); got {type(rules).__name__}"
        )
    module_rules = bound.modules if bound is not None else _bound_modules(params)
    _check_shared_splits(model, shared, module_rules)
    recompute = None
    if any(r.remat is not None for r in module_rules):
        recompute = Recompute(
            plan,
            lambda path: install(model, module_rules, mesh, under=path),
            _needs_grad(tape),
            prefetch,
        )
        if tape is not None:
            tape.defer(recompute.close)
    uninstall = install(model, module_rules, mesh, record=recompute.record if recompute else None)
    try:
        for unit in run.units[1:]:
            hooks.append(unit.module.register_forward_pre_hook(_pre(run, unit)))
            hooks.append(unit.module.register_forward_hook(_post(run, unit), always_call=True))
        run.enter(run.units[0])
        try:
            with applying():
                if regather is not None:
                    with torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack):
                        out = call(*args, **kwargs)
                else:
                    out = call(*args, **kwargs)
        except StopForward as stop:
            out = stop.value
        run.leave(run.units[0])
    finally:
        for h in hooks:
            h.remove()
        uninstall()
        run.close()
    return out


def _check_shared_splits(model: nn.Module, shared: Shared, rules: Sequence[Any]) -> None:
    """Refuse a weight that computes split over mesh axes and is shared by a
    module that no module rule completes (a head tied to a vocab-parallel
    embedding, with no ``head`` in the names): that module's output would
    be this rank's piece of its whole output, passing for all of it."""
    for key, x, paths in shared:
        if not isinstance(x, Sharded) or x.placement is None:
            continue
        compute = role_layout(x, "compute")
        split = [a for axes in compute.spec.dim_axes(len(x.shape)) for a in axes]
        if not split:
            continue
        for path in paths:
            if not any(r.matches(path) and (r.forward or r.output) for r in rules):
                raise ShardingError(
                    f"apply: params[{key!r}] {x.shape} computes split over {split} "
                    f"({compute.spec!r}) and is shared with {path or 'the model'!r} "
                    f"({type(model.get_submodule(path)).__name__}), which no module rule "
                    "completes: its output would be this rank's piece. Name that module in the "
                    "rules (a tied LM head: TransformerNames(head=...)), or keep the weight "
                    f"whole with Rule({key!r}, P()) before the preset's rules"
                )


def _needs_grad(tape: Any) -> Callable[[Any], bool]:
    """Whether a parameter's value in the forward requires grad: lifted
    onto the tape, or moved by the differentiable transfer."""
    if tape is not None:
        return lambda x: id(x) in tape.slots or bool(getattr(x, "requires_grad", False))
    return lambda x: bool((x.local if isinstance(x, Sharded) else x).requires_grad)


def _bound_modules(params: dict[str, Any]) -> tuple[Any, ...]:
    """The module rules the params were placed with (every ``Sharded``
    parameter placed by rules carries them); one set, or an error naming
    two parameters placed by different rules."""
    first: tuple[str, tuple[Any, ...]] | None = None
    for path, x in params.items():
        if not isinstance(x, Sharded) or x.placement is None:
            continue
        if first is None:
            first = (path, x.placement.modules)
        elif x.placement.modules != first[1]:
            raise ShardingError(
                f"apply: params[{first[0]!r}] and params[{path!r}] were placed by rules with "
                "different module rules; shard all params with one Rules, or pass rules= to "
                "say which apply installs"
            )
    return first[1] if first is not None else ()


def _pre(run: _Run, unit: _Unit) -> Callable[..., None]:
    def hook(module: nn.Module, args: Sequence[Any]) -> None:
        run.enter(unit)

    return hook


def _post(run: _Run, unit: _Unit) -> Callable[..., None]:
    def hook(module: nn.Module, args: Sequence[Any], output: Any) -> None:
        run.leave(unit)

    return hook
