"""Parameters in: ``params_of`` (a module's tensors as a dict pytree) and
``init_params`` (a ``meta``-device module initialised straight into its
shards, never whole on one rank)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..mesh._mesh import Mesh
from ._api import _shard_one, gather, layouts_for, rules_for_tree
from ._init import (
    Draw,
    Init,
    Slot,
    hugging_face_steps,
    is_hugging_face,
    named_tensors,
    run_on,
    written_slots,
)
from ._memory import placed
from ._sharded import Sharded

__all__ = ["init_params", "params_of"]


def params_of(model: nn.Module, *, buffers: bool = True) -> dict[str, torch.Tensor]:
    """The parameters (and buffers) of ``model`` as a dict keyed by path
    (``"blocks.0.attn.qkv.weight"``), detached. A tied parameter appears once,
    under its first path.

    >>> import torch, shardax as sx
    >>> sorted(sx.params_of(torch.nn.Linear(3, 2)))
    ['bias', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise ShardingError(f"params_of needs an nn.Module; got {type(model).__name__}")
    out = {name: p.detach() for name, p in model.named_parameters()}
    if buffers:
        out.update((name, b.detach()) for name, b in model.named_buffers())
    return out


def init_params(
    model: nn.Module,
    mesh: Mesh,
    specs: Any,
    *,
    init_fn: Callable[[nn.Module], Any] | None = None,
    device: torch.device | str = "cpu",
    only: Iterable[str] | None = None,
) -> dict[str, Sharded]:
    """Initialise the parameters and buffers of ``model`` (built on the
    ``meta`` device) directly into their shards: the values equal
    ``shard(params_of(model_built_densely), mesh, specs)`` under the same
    ``torch.manual_seed``, but no rank ever holds more than its shards plus
    the tensors one initialiser writes.

    How the dense values are reproduced:

    - A Hugging Face model (a ``transformers.PreTrainedModel``): its
      construction is replayed — every random draw of the module
      constructors (on a scratch tensor when a later step overwrites it) and
      every ``_init_weights(module)`` call of its ``post_init``, in order,
      parent-level ones included (GPT-2 rescales its residual projections
      from their parent); then the ties. Buffers its ``_init_weights``
      fills (rotary frequencies) get their values too.
    - Any other model: each module's ``reset_parameters()`` runs in module
      order, which repeats the random draws of the dense constructor (for
      models that create submodules in the order they register them, as
      ordinary PyTorch code does).
    - Then ``init_fn(module)``, if given, runs on every module in
      ``model.apply`` order (children first), as a custom
      ``model.apply(init_fn)`` after construction would.

    Each initialiser runs on dense copies of exactly the tensors it writes
    (found by a dry run on ``meta``, which draws nothing) — its module's own,
    or a child's where a parent initialises it. A tied parameter keeps the
    values of its first owner, as a tie made after construction does. A
    tensor still on ``meta`` after all this is an error naming it.

    Args:
        model: a module, usually built under ``torch.device("meta")``; it is
            not modified.
        mesh: the live mesh.
        specs: rules (e.g. ``rules.zero(3)``) or specs, as for :func:`shardax.shard`.
        init_fn: an optional per-module initialiser run after construction.
        device: where the shards live (and the draws are made).
        only: keep just these key paths (a pipeline rank's stages); the
            others are still drawn, so the kept values are the dense
            model's, but never kept.

    >>> import torch, shardax as sx
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(4, 2)
    >>> _ = torch.manual_seed(0)
    >>> params = sx.init_params(model, sx.Mesh({"dp": 1}), sx.rules.zero(3))
    >>> _ = torch.manual_seed(0)
    >>> torch.equal(sx.gather(params)["weight"], torch.nn.Linear(4, 2).weight.detach())
    True

    ``init_fn`` gives values where no ``reset_parameters`` does:

    >>> class Gain(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gain = torch.nn.Parameter(torch.empty(3))
    >>> with torch.device("meta"):
    ...     model = Gain()
    >>> def ones(m):
    ...     if isinstance(m, Gain):
    ...         torch.nn.init.ones_(m.gain)
    >>> sx.gather(sx.init_params(model, sx.Mesh({"dp": 1}), sx.rules.zero(3), init_fn=ones))
    {'gain': tensor([1., 1., 1.])}
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"init_params needs a live Mesh; got {mesh!r}")
    if init_fn is not None and not callable(init_fn):
        raise ShardingError(f"init_fn is a function of one module; got {init_fn!r}")
    state = _Initialising(model, mesh, specs, device, None if only is None else set(only))
    if state.only is not None and state.only - set(state.tensor_of):
        unknown = sorted(state.only - set(state.tensor_of))
        raise ShardingError(
            f"init_params(only=...): {unknown[:5]} are not key paths of the model's parameters "
            "or buffers (shardax.params_of(model) lists them)"
        )
    with torch.no_grad():
        if is_hugging_face(model):
            state.replay_hugging_face()
        else:
            for _, module in model.named_modules():
                if callable(getattr(module, "reset_parameters", None)):
                    state.initialise(module, _reset)
        if init_fn is not None:
            for module in _post_order(model):
                state.initialise(module, init_fn)
        return state.finish()


class _Initialising:
    """One :func:`init_params` call: the shards kept so far, and how to run
    an initialiser on dense copies of the tensors it writes."""

    def __init__(
        self, model: nn.Module, mesh: Mesh, specs: Any, device: Any, only: set[str] | None
    ) -> None:
        self.model, self.mesh, self.device, self.only = model, mesh, device, only
        paths, leaves, _, layouts = layouts_for(params_of(model), mesh, specs)
        self.layout_of = dict(zip(paths, layouts, strict=True))
        self.rules = rules_for_tree(specs, paths, leaves)
        self.path_of: dict[Slot, str] = {}  # a tensor's first slot -> its path
        self.tensor_of: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}
        for mpath, module in model.named_modules(remove_duplicate=False):
            for table in ("_parameters", "_buffers"):
                for name, t in getattr(module, table).items():
                    full = f"{mpath}.{name}" if mpath else name
                    if t is not None and first.setdefault(id(t), full) == full:
                        self.path_of.setdefault((module, table, name), full)
                        self.tensor_of[full] = t
        self.out: dict[str, Sharded] = {}

    def keep(self, path: str, value: torch.Tensor) -> None:
        if self.only is not None and path not in self.only:
            return
        x = _shard_one(value, self.mesh, self.layout_of[path], None)
        placement = (
            self.rules.placement(path, x.shape, self.mesh) if self.rules is not None else None
        )
        local = x.local if placement is None else placed(x.local, placement.memory_kind("params"))
        self.out[path] = Sharded(local, x.layout, x.shape, placement=placement)

    def dense(self, slot: Slot) -> torch.Tensor:
        """What an initialiser writing ``slot`` starts from: the value kept
        so far (gathered), else the model's own (empty where meta); a
        scratch tensor for a tied tensor's later slots."""
        t = getattr(slot[0], slot[1])[slot[2]]
        path = self.path_of.get(slot)
        if path is not None and path in self.out:
            return gather(self.out[path]).to(self.device).clone()
        if path is None or t.device.type == "meta":
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return t.detach().to(self.device).clone()

    def initialise(
        self, module: nn.Module, fn: Callable[[nn.Module], Any], slots: list[Slot] | None = None
    ) -> None:
        """Run ``fn(module)`` on dense copies of the tensors it writes (found
        by a dry run unless given) and keep them."""
        if slots is None:
            slots = written_slots(module, fn)
        dense = {slot: self.dense(slot) for slot in slots}
        written = run_on(module, fn, dense)
        for slot in slots:
            if slot in written and slot in self.path_of:
                self.keep(self.path_of[slot], dense[slot])

    def replay_hugging_face(self) -> None:
        """The dense construction's steps, in order: each draw into the
        tensor it fills when no later ``_init_weights`` writes that tensor
        (else on scratch), each ``_init_weights`` call on what it writes."""
        built, steps = hugging_face_steps(self.model)
        tensor_path = {id(t): path for path, t in named_tensors(built)}
        module_path = {id(m): path for path, m in built.named_modules()}
        planned: list[tuple[Any, Any]] = []
        for step in steps:
            if isinstance(step, Draw):
                planned.append((step, tensor_path.get(id(step.target))))
                continue
            where, owner = module_path.get(id(step.module)), module_path.get(id(step.owner))
            if where is None or owner is None:  # a module the constructor dropped
                planned.append((step, None))
                continue
            module = self.model.get_submodule(where)
            fn = _hf_init(self.model.get_submodule(owner))
            planned.append((step, (module, fn, written_slots(module, fn))))
        rewritten: list[set[str]] = []  # per step: the paths a later _init_weights writes
        later: set[str] = set()
        for step, what in reversed(planned):
            rewritten.append(set(later))
            if isinstance(step, Init) and what is not None:
                later.update(self.path_of[s] for s in what[2] if s in self.path_of)
        for (step, what), overwritten in zip(planned, reversed(rewritten), strict=True):
            if isinstance(step, Draw):
                if what is not None and what not in overwritten:
                    t = self.tensor_of[what]
                    value = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                    step.replay(value, self.device)
                    self.keep(what, value)
                else:
                    step.replay(None, self.device)
            elif what is None:
                step.owner._init_weights(step.module.to_empty(device=self.device))
            else:
                self.initialise(*what)

    def finish(self) -> dict[str, Sharded]:
        """The shards, after keeping the model's own values of real tensors
        nothing initialised; an error for meta ones."""
        unset = []
        for path, t in self.tensor_of.items():
            if path in self.out or (self.only is not None and path not in self.only):
                continue
            if t.device.type == "meta":
                unset.append(path)
            else:
                self.keep(path, t.detach().to(self.device))
        if unset:
            more = f" and {len(unset) - 6} more" if len(unset) > 6 else ""
            raise ShardingError(
                f"init_params: {', '.join(map(repr, unset[:6]))}{more} "
                f"{'is' if len(unset) == 1 else 'are'} on the meta device and nothing gave "
                f"{'it' if len(unset) == 1 else 'them'} values (no reset_parameters() of a "
                "module wrote it, nor init_fn); pass init_fn=... that sets it, or create it "
                "on a real device"
            )
        return dict(sorted(self.out.items()))


def _reset(module: nn.Module) -> None:
    module.reset_parameters()


def _hf_init(owner: nn.Module) -> Callable[[nn.Module], Any]:
    return lambda module: owner._init_weights(module)


def _post_order(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out
