"""The machinery of :func:`shardax.init_params`: which tensors an
initialiser writes, running it on dense copies of just those, and the
initialisation sequence of a Hugging Face model's constructor.

An initialiser is run twice on a module. First on the ``meta`` model, each
tensor slot (``module._parameters[name]``, ``module._buffers[name]``) of the
module's subtree holding its own meta stand-in, under a mode that records the
slots whose tensors are written in place (through views and ``.data`` too):
meta tensors hold no values and draw no random numbers, so this costs
nothing and changes nothing. Then on dense tensors in exactly the slots
written, and nowhere else: an initialiser that rescales a child's weight
(GPT-2's residual projections, initialised by their parent) gets that
weight, and the root module's initialiser never materialises the model.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ShardingError

# The calls that return a view of (or an alias for) their first argument: a
# write through one writes the tensor.
_ALIASING = frozenset(
    [
        "__getitem__",
        "__get__",
        "as_strided",
        "chunk",
        "detach",
        "diagonal",
        "expand",
        "flatten",
        "mT",
        "narrow",
        "permute",
        "reshape",
        "select",
        "split",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unflatten",
        "unsqueeze",
        "view",
        "view_as",
    ]
)
# The random draws a constructor may make: in place on a tensor, or creating one.
_DRAWS = frozenset(
    [
        "bernoulli_",
        "cauchy_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "normal_",
        "random_",
        "uniform_",
        "kaiming_normal_",
        "kaiming_uniform_",
        "orthogonal_",
        "sparse_",
        "trunc_normal_",
        "xavier_normal_",
        "xavier_uniform_",
        "bernoulli",
        "multinomial",
        "normal",
        "rand",
        "rand_like",
        "randint",
        "randint_like",
        "randn",
        "randn_like",
        "randperm",
    ]
)

Slot = tuple[nn.Module, str, str]  # (module, "_parameters" or "_buffers", name)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
    return first if isinstance(first, torch.Tensor) else None


def _meta_draw(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor an in-place random draw would fill, where it is on
    ``meta`` — which holds no values, so the draw is skipped, not run: run,
    torch's meta kernel for it imports ``torch._dynamo`` (some 75 MiB of
    resident memory in every process that merely builds a model); else
    None."""
    name = getattr(func, "__name__", "")
    if name not in _DRAWS or not name.endswith("_"):
        return None
    first = _first_tensor(args, kwargs)
    return first if first is not None and first.device.type == "meta" else None


def _factories() -> frozenset[Any]:
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors())


class _Writes(TorchFunctionMode):
    """Records which of the given tensors are written in place; with
    ``meta``, tensors made without a device are made on ``meta`` (a dry run
    draws no random numbers)."""

    def __init__(self, watched: dict[int, Any], meta: bool) -> None:
        super().__init__()
        self.root = dict(watched)  # id(tensor or alias) -> its key
        self.alive: list[torch.Tensor] = []  # aliases kept alive: their ids stay theirs
        self.written: set[Any] = set()
        self.factories = _factories() if meta else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        skipped = _meta_draw(func, args, kwargs)
        out = skipped if skipped is not None else func(*args, **kwargs)
        first = _first_tensor(args, kwargs)
        key = self.root.get(id(first)) if first is not None else None
        if key is None:
            return out
        name = getattr(func, "__name__", "")
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
            self.written.add(key)
        elif name in _ALIASING:
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and id(t) not in self.root:
                    self.root[id(t)] = key
                    self.alive.append(t)
        return out


def subtree_slots(module: nn.Module) -> list[Slot]:
    """Every tensor slot of ``module`` and its descendants (each module once)."""
    return [
        (m, table, name)
        for m in module.modules()
        for table in ("_parameters", "_buffers")
        for name, t in getattr(m, table).items()
        if t is not None
    ]


@contextmanager
def holding(slots: dict[Slot, torch.Tensor]) -> Iterator[dict[int, Slot]]:
    """The slots hold the given tensors (as parameters where they held
    parameters) for the block, then their own again; yields ``id`` of what
    each slot holds -> slot."""
    saved = [(slot, getattr(slot[0], slot[1])[slot[2]]) for slot in slots]
    held: dict[int, Slot] = {}
    try:
        for slot, old in saved:
            value = slots[slot]
            if isinstance(old, nn.Parameter):
                value = nn.Parameter(value, requires_grad=old.requires_grad)
            getattr(slot[0], slot[1])[slot[2]] = value
            held[id(value)] = slot
        yield held
    finally:
        for (module, table, name), old in saved:
            getattr(module, table)[name] = old


def written_slots(module: nn.Module, fn: Callable[[nn.Module], Any]) -> list[Slot]:
    """The slots of ``module``'s subtree that ``fn(module)`` writes, found by
    running it with a meta stand-in in every slot (no values, no draws)."""
    slots = subtree_slots(module)
    stand_ins = {slot: _meta_like(getattr(slot[0], slot[1])[slot[2]]) for slot in slots}
    with torch.no_grad(), holding(stand_ins) as held, _Writes(held, meta=True) as mode:
        fn(module)
    return [slot for slot in slots if slot in mode.written]


def run_on(
    module: nn.Module, fn: Callable[[nn.Module], Any], dense: dict[Slot, torch.Tensor]
) -> set[Slot]:
    """Run ``fn(module)`` with ``dense`` tensors in their slots (updated to
    what ``fn`` left there); returns the slots it wrote."""
    with torch.no_grad(), holding(dense) as held:
        with _Writes(held, meta=False) as mode:
            fn(module)
        for module_, table, name in dense:
            dense[(module_, table, name)] = getattr(module_, table)[name].detach()
    return mode.written


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# -- a Hugging Face model's constructor, as a sequence of steps -----------------------


class Draw:
    """A random draw the constructor made: replayed on a scratch tensor of
    the same shape (to draw the same numbers), or into the tensor it fills
    when nothing initialises that tensor again."""

    __slots__ = ("args", "factory", "func", "kwargs", "target")

    def __init__(self, func: Any, args: tuple, kwargs: dict, target: Any, factory: bool) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.target, self.factory = target, factory

    def replay(self, into: torch.Tensor | None, device: torch.device | str) -> None:
        """Draw again, on ``device``: into ``into`` where given."""

        def real(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if x is self.target and into is not None:
                return into
            return torch.zeros(x.shape, dtype=x.dtype, device=device)

        args = tuple(real(a) for a in self.args)
        kwargs = {k: real(v) for k, v in self.kwargs.items()}
        if self.factory and kwargs.get("device") is None:
            kwargs["device"] = device
        with torch.no_grad():
            out = self.func(*args, **kwargs)
            if self.factory and into is not None:
                into.copy_(out)


class Init:
    """``owner._init_weights(module)``, as the Hugging Face ``post_init``
    called it (owner: the nearest ``PreTrainedModel`` at or above module)."""

    __slots__ = ("module", "owner")

    def __init__(self, owner: nn.Module, module: nn.Module) -> None:
        self.owner, self.module = owner, module


class _Construction(TorchFunctionMode):
    """Builds every tensor on ``meta`` (as ``torch.device("meta")`` does)
    while recording the random draws, in order, into ``steps``."""

    def __init__(self, steps: list[Any]) -> None:
        super().__init__()
        self.factories = _factories()
        self.steps = steps

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        draw = getattr(func, "__name__", "") in _DRAWS
        recorded = dict(kwargs)
        if func in self.factories and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        skipped = _meta_draw(func, args, kwargs)
        out = skipped if skipped is not None else func(*args, **kwargs)
        if draw:
            factory = func in self.factories
            target = out if factory else _first_tensor(args, kwargs)
            self.steps.append(Draw(func, args, recorded, target, factory))
        return out


def is_hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (never
    imports transformers)."""
    hf = sys.modules.get("transformers")
    return hf is not None and isinstance(model, hf.PreTrainedModel)


def hugging_face_steps(model: nn.Module) -> tuple[nn.Module, list[Any]]:
    """Build ``type(model)(model.config)`` on ``meta`` and return it with the
    steps of its dense construction: each random draw of the module
    constructors, and each ``_init_weights`` call of ``post_init`` (which
    Hugging Face skips on meta; here it is recorded, not run), in order."""
    import transformers.modeling_utils as hf

    steps: list[Any] = []
    original = hf.PreTrainedModel._initialize_weights

    def record(self: Any, module: nn.Module, is_custom_code: bool = False) -> None:
        if getattr(module, "_is_hf_initialized", False):
            return
        steps.append(Init(self, module))
        module._is_hf_initialized = True

    device_check = hf.get_torch_context_manager_or_global_device
    hf.PreTrainedModel._initialize_weights = record
    hf.get_torch_context_manager_or_global_device = lambda: None  # post_init runs: recorded
    try:
        with _Construction(steps):
            built = type(model)(copy.deepcopy(model.config))
    finally:
        hf.PreTrainedModel._initialize_weights = original
        hf.get_torch_context_manager_or_global_device = device_check
    for m in built.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    mine = {n: tuple(t.shape) for n, t in named_tensors(model)}
    theirs = {n: tuple(t.shape) for n, t in named_tensors(built)}
    if mine != theirs:
        changed = sorted(set(mine.items()) ^ set(theirs.items()))[:4]
        raise ShardingError(
            f"init_params: {type(model).__name__} differs from {type(model).__name__}(config) "
            f"(e.g. {changed}), so its own initialisation cannot be replayed; pass "
            "init_fn=... that initialises it, or build the model on a real device"
        )
    return built, steps


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters then buffers, by path (each tensor once)."""
    return list(model.named_parameters()) + list(model.named_buffers())
