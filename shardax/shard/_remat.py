"""Activation checkpointing (rematerialisation), as JAX's ``jax.checkpoint``:
a region's activations are not kept for backward but computed again from
its inputs when backward needs them, under a *policy* that says what is
kept after all.

Two forms. :func:`remat` wraps a function of tensors (its parameters among
its arguments, or fixed). Inside :func:`shardax.apply`, a module is
rematerialised by a rule — ``rules.remat(r"blocks\\.\\d+")``, a
:class:`~shardax.rules.ModuleRule` with a :class:`Remat` — because its
recomputation runs in backward, after ``apply`` has put the model's own
parameters back: the rule's recomputation gathers the module's parameters
again (ZeRO-3: the same gather its forward made, the module before it in
forward order prefetched meanwhile), re-installs the module rules under it
(tensor-parallel forwards and relayouts), and replays the random numbers
the forward drew (torch's checkpoint restores the generator's state), so
dropout masks are the same.

The recomputation is torch's non-reentrant checkpoint: backward flows
through the forward's own graph, the recomputed forward only supplies the
tensors it saves — so parameter gradients reach
:func:`shardax.value_and_grad`'s reducer as without remat.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..collectives._agree import moving
from ..errors import ShardingError
from ._keep import keeping_contexts, save_matmuls, takes_part
from ._memory import check_kind, release_all
from ._placement import role_layout, weights_of
from ._sharded import Sharded
from ._transfer import Batch, transfer_many

__all__ = ["POLICIES", "Recompute", "Remat", "applying", "checkpointed", "recomputing", "remat"]

POLICIES = ("save_nothing", "save_matmuls", "save_names", "offload_names")
"""What a rematerialised region keeps for backward: nothing but its inputs;
the outputs of its matrix products (JAX's ``dots_saveable``: the expensive
ops are not run again, the cheap elementwise ones are); everything
computed inside its submodules named by ``names`` (those are not run
again, the rest is); or that, kept in memory ``kind`` — pinned host memory
beside a GPU, files on disk — and brought back when backward needs it
(JAX's ``save_and_offload_only_these_names``)."""

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardax_recomputing", default=False
)


def recomputing() -> bool:
    """Whether backward is recomputing a rematerialised region now — for
    code with side effects beyond its outputs (statistics, counters) that
    must happen once per forward, not again in backward. Run such code's
    torch ops under :func:`uncounted`: the policies that keep outputs
    (``save_matmuls``, ``save_names``, ``offload_names``) hand them back in
    the forward's order, and ops that run only in the forward would be
    refused there.

    >>> import torch
    >>> from shardax import uncounted
    >>> stats = []
    >>> def layer(x):
    ...     if not recomputing():
    ...         with uncounted():
    ...             stats.append(x.abs().mean().item())
    ...     return torch.tanh(x @ x.T)
    >>> remat(layer, "save_matmuls")(torch.ones(2, 2, requires_grad=True)).sum().backward()
    >>> stats
    [1.0]
    """
    return _RECOMPUTING.get()


def _policy(value: str) -> str:
    if value not in POLICIES:
        raise ShardingError(f"remat: policy is one of {', '.join(POLICIES)}; got {value!r}")
    return value


def _names(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    for name in names:
        try:
            re.compile(name)
        except (re.error, TypeError) as err:
            raise ShardingError(
                f"remat: names are regexes over submodule paths; {name!r}: {err}"
            ) from None
    return names


@attrs.frozen(repr=False)
class Remat:
    """How a region is rematerialised: ``policy`` (one of :data:`POLICIES`),
    ``names`` (for ``"save_names"`` and ``"offload_names"``: regexes over
    the paths of the region's submodules, relative to it, whose computation
    is kept), ``every`` (a rule rematerialises the 1st, (k+1)-th, (2k+1)-th
    … module it matches: JAX's and Megatron's every-k-th block) and
    ``kind`` (where ``"offload_names"`` keeps it: ``"host"``, or
    ``"disk:PATH"``).

    >>> Remat()
    Remat('save_nothing')
    >>> Remat("save_names", names=["attn"], every=2)
    Remat('save_names', names=('attn',), every=2)
    >>> Remat("offload_names", names="attn", kind="disk:/scratch/act")
    Remat('offload_names', names=('attn',), kind='disk:/scratch/act')
    >>> Remat("save_names")
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: remat: policy 'save_names' keeps the computation of the submodules named by names=(regexes over their paths, e.g. names=('attn',)); none given
    """

    policy: str = attrs.field(default="save_nothing", converter=_policy)
    names: tuple[str, ...] = attrs.field(default=(), converter=_names, kw_only=True)
    every: int = attrs.field(default=1, kw_only=True)
    kind: str = attrs.field(default="host", converter=check_kind, kw_only=True)

    def __attrs_post_init__(self) -> None:
        named = self.policy in ("save_names", "offload_names")
        if named and not self.names:
            raise ShardingError(
                f"remat: policy {self.policy!r} keeps the computation of the submodules named by "
                "names=(regexes over their paths, e.g. names=('attn',)); none given"
            )
        if self.names and not named:
            raise ShardingError(
                f"remat: names={self.names!r} are for policies 'save_names' and "
                f"'offload_names'; got {self.policy!r}"
            )
        if self.kind != "host" and self.policy != "offload_names":
            raise ShardingError(
                f"remat: kind= says where policy 'offload_names' keeps what it saves; got "
                f"kind={self.kind!r} with policy {self.policy!r}"
            )
        if self.kind == "device":
            raise ShardingError(
                "remat: offload_names keeps its activations off the device: kind='host' (pinned "
                "memory beside a GPU) or 'disk:PATH'; for the device, policy 'save_names'"
            )
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ShardingError(f"remat: every is a positive number of modules; got {self.every!r}")

    def __repr__(self) -> str:
        tail = f", names={self.names!r}" if self.names else ""
        tail += f", every={self.every}" if self.every != 1 else ""
        tail += f", kind={self.kind!r}" if self.kind != "host" else ""
        return f"Remat({self.policy!r}{tail})"

    def _selective(
        self, module: nn.Module | None
    ) -> tuple[Callable[[], Any] | None, Callable[[], Any]]:
        """``(context_fn, tracking)``: the ``context_fn`` torch's checkpoint
        runs the region under (None: save nothing), and a context manager
        both the forward and its recomputation run in — for
        ``save_names``, the hooks that say when a named submodule runs."""
        if self.policy == "save_nothing":
            return None, contextlib.nullcontext
        if self.policy == "save_matmuls":
            return functools.partial(keeping_contexts, save_matmuls, "device"), (
                contextlib.nullcontext
            )
        if module is None:
            raise ShardingError(f"remat: policy {self.policy!r} names submodules; remat a module")
        regexes = [re.compile(n) for n in self.names]
        named = [m for p, m in module.named_modules() if p and any(r.fullmatch(p) for r in regexes)]
        if not named:
            subs = [p for p, _ in module.named_modules() if p]
            raise ShardingError(
                f"remat: names={self.names!r} match none of {type(module).__name__}'s "
                f"submodules ({', '.join(subs[:8]) or 'it has none'})"
            )
        depth = [0]

        def policy(op: Any, args: Any, kwargs: Any) -> bool:
            return bool(depth[0]) and takes_part(op, args, kwargs)

        @contextmanager
        def tracking() -> Iterator[None]:
            def enter(*_: Any) -> None:
                depth[0] += 1

            def leave(*_: Any) -> None:
                depth[0] -= 1

            hooks = [h for m in named for h in (m.register_forward_pre_hook(enter),
                     m.register_forward_hook(leave, always_call=True))]  # fmt: skip
            try:
                yield
            finally:
                for h in hooks:
                    h.remove()

        kind = self.kind if self.policy == "offload_names" else "device"
        return functools.partial(keeping_contexts, policy, kind), tracking


_APPLYING: contextvars.ContextVar[bool] = contextvars.ContextVar("shardax_applying", default=False)


@contextmanager
def applying() -> Iterator[None]:
    """Marks :func:`shardax.apply`'s forward: :func:`remat` refuses to run
    inside it (the rule form gathers the parameters again)."""
    token = _APPLYING.set(True)
    try:
        yield
    finally:
        _APPLYING.reset(token)


def remat(
    fn: Callable[..., Any], policy: str = "save_nothing", *, names: Any = (), kind: str = "host"
) -> Any:
    """``fn`` rematerialised: called, it returns what ``fn`` returns, but
    keeps for backward only its inputs (and what ``policy`` saves), and
    runs ``fn`` again in backward to get the rest — random numbers (dropout)
    replayed, so the recomputation equals the forward. ``policy``: one of
    :data:`POLICIES`; ``names`` for ``"save_names"`` and ``"offload_names"``
    (``fn`` a module); ``kind``, where ``"offload_names"`` keeps what it
    saves (``"host"``, ``"disk:PATH"``).

    For a module inside :func:`shardax.apply`, use the rule
    ``rules.remat(pattern, policy)`` instead: its recomputation gathers the
    module's parameters again (this function refuses to run there).

    >>> import torch, shardax as sx
    >>> w = torch.ones(3, 3, requires_grad=True)
    >>> layer = sx.remat(lambda x: torch.tanh(x @ w), "save_matmuls")
    >>> layer(torch.ones(2, 3)).sum().backward()
    >>> round(w.grad[0, 0].item(), 4)
    0.0197
    """
    spec = Remat(policy, names=names, kind=kind)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _APPLYING.get():
            raise ShardingError(
                f"remat({getattr(fn, '__name__', type(fn).__name__)}) inside shardax.apply: its "
                "recomputation would run after apply has put the model's own parameters back. "
                "Remat the module with a rule instead: rules.remat(r'<its path regex>', "
                f"{policy!r}) composed with the model's rules"
            )
        return checkpointed(fn, spec, fn if isinstance(fn, nn.Module) else None, None)(
            *args, **kwargs
        )

    return run


def checkpointed(
    forward: Callable[..., Any],
    spec: Remat,
    module: nn.Module | None,
    record: Callable[[], Callable[[], Any]] | None,
) -> Callable[..., Any]:
    """``forward`` under torch's non-reentrant checkpoint with ``spec``'s
    policy. ``record()``, called with each forward, returns what makes the
    context its recomputation runs in (:func:`shardax.apply`'s: the
    parameters gathered again)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs = _without_cache(module, forward, args, kwargs)
        restore = record() if record is not None else None
        selective, tracking = spec._selective(module)
        modes = _function_modes()  # the forward's: backward would run without them

        def contexts() -> tuple[Any, Any]:
            if selective is None:
                inner = contextlib.nullcontext()
                return contextlib.nullcontext(), _Recomputation(restore, inner, modes)
            forward_context, recompute_context = selective()
            return forward_context, _Recomputation(restore, recompute_context, modes)

        def body(*a: Any, **k: Any) -> Any:
            with tracking():
                return forward(*a, **k)

        return checkpoint(body, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


_CACHES = ("past_key_values", "past_key_value", "layer_past")  # Hugging Face's names


def _without_cache(
    module: nn.Module | None,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A layer's key/value cache left out of its rematerialised forward
    (passed by name or position), as Hugging Face's gradient checkpointing
    does: the recomputation would append to the cache a second time and
    attend over twice the keys."""
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    try:
        signature = inspect.signature(
            forward.forward if isinstance(forward, nn.Module) else forward  # not __call__'s
        )
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    dropped = [k for k in _CACHES if bound.arguments.get(k) is not None]
    if bound.arguments.get("use_cache"):
        dropped.append("use_cache")
    if not dropped:
        return args, kwargs
    warnings.warn(
        f"remat: {type(module).__name__} is called with a key/value cache "
        f"({', '.join(dropped)}), which its recomputation would fill twice; it runs without "
        "one (call the model with use_cache=False to say so)",
        UserWarning,
        stacklevel=4,
    )
    for k in dropped:
        bound.arguments[k] = False if k == "use_cache" else None
    return bound.args, bound.kwargs


class _Recomputation:
    """What a recomputation runs in: :func:`recomputing` true, ``restore()``
    entered first (its gathers are not the region's ops: outside the
    selective checkpoint's ``inner`` context, which sees every op), and the
    torch function modes the forward ran under (the autograd engine runs
    backward without them: a pipeline's split backward defers its linears'
    weight gradients through one, and the recomputation must save what
    the forward saved) — those not active already. Entered again for each
    recomputation (a second backward through the region)."""

    def __init__(
        self, restore: Callable[[], Any] | None, inner: Any, modes: tuple[Any, ...] = ()
    ) -> None:
        self.restore, self.inner, self.modes = restore, inner, modes
        self.entered: list[tuple[contextvars.Token[bool], contextlib.ExitStack]] = []

    def __enter__(self) -> None:
        token = _RECOMPUTING.set(True)
        stack = contextlib.ExitStack()
        try:
            active = {id(m) for m in _function_modes()}
            for mode in self.modes:
                if id(mode) not in active:
                    stack.enter_context(mode)
            if self.restore is not None:
                stack.enter_context(self.restore())
            stack.enter_context(self.inner)
        except BaseException:
            stack.close()
            _RECOMPUTING.reset(token)
            raise
        self.entered.append((token, stack))

    def __exit__(self, *exc: Any) -> bool:
        token, stack = self.entered.pop()
        try:
            return bool(stack.__exit__(*exc))
        finally:
            _RECOMPUTING.reset(token)


def _function_modes() -> tuple[Any, ...]:
    """The torch function modes active now, outermost first."""
    stack = getattr(torch.overrides, "_get_current_function_mode_stack", lambda: [])
    return tuple(stack())


class Recompute:
    """The context a rematerialised module of one :func:`shardax.apply`
    call recomputes in: its parameters and buffers (every one of its
    submodules', from the apply's units) gathered again to their compute
    layouts and put in the modules, requiring grad as they did in the
    forward; the module rules under it installed again (``reinstall``).
    With ``prefetch``, recomputing one starts the gather of the one before
    it in forward order, which backward reaches next."""

    def __init__(
        self,
        units: list[Any],
        reinstall: Callable[[str], Callable[[], None]],
        needs_grad: Callable[[Any], bool],
        prefetch: bool,
    ) -> None:
        self.units, self.reinstall, self.prefetch = units, reinstall, prefetch
        self.needs_grad = needs_grad
        self.calls: list[tuple[str, list[tuple[Any, Any, bool]]]] = []
        self.ahead: dict[int, Batch] = {}
        self._closing = -1  # the backward that finishes what was prefetched
        self._slots: dict[int, list[tuple[Any, Any, bool]]] = {}

    def slots(self, module: nn.Module) -> list[tuple[Any, Any, bool]]:
        """``(x, where, needs grad)`` of every parameter and buffer held by
        ``module`` or its submodules."""
        key = id(module)
        if key not in self._slots:
            inside = {id(m) for m in module.modules()}
            self._slots[key] = [
                (x, where, any(p for _, _, p in where) and self.needs_grad(x))
                for unit in self.units
                for _, x, where in unit.slots
                if any(id(m) in inside for m, _, _ in where)
            ]
        return self._slots[key]

    def record(self, path: str, module: nn.Module) -> Callable[[], Any]:
        """Called as ``module``'s forward runs: what its recomputation enters."""
        self.calls.append((path, self.slots(module)))
        return functools.partial(self._restore, len(self.calls) - 1)

    def _gather(self, i: int) -> Batch:
        path, slots = self.calls[i]
        items = [(x, role_layout(x, "compute")) for x, _, _ in slots if isinstance(x, Sharded)]
        with moving(f"the parameters of {path or 'the model'} (gathered again to recompute it)"):
            batch = transfer_many(items, int8=[weights_of(x) == "int8" for x, _ in items])
        # shards on disk: out of the process once the gather has read them
        return batch.then(lambda: release_all(x.local for x, _ in items))

    @contextmanager
    def _restore(self, i: int) -> Iterator[None]:
        path, slots = self.calls[i]
        gathered = self.ahead.pop(i, None) or self._gather(i)
        values = iter(gathered.wait())
        if self.prefetch and i > 0 and i - 1 not in self.ahead:
            self.ahead[i - 1] = self._gather(i - 1)
            task = torch._C._current_graph_task_id()
            if task != -1 and task != self._closing:  # a backward without a tape, too
                self._closing = task
                torch.autograd.Variable._execution_engine.queue_callback(self.close)
        originals = []
        for x, where, grad in slots:
            value = (next(values) if isinstance(x, Sharded) else x).detach()
            if grad:
                value.requires_grad_(True)
                if isinstance(x, Sharded):  # not a leaf, as in the forward (lifted): autocast
                    value = value.view_as(value)  # casts it at each use there, so here too
            for module, name, is_param in where:
                table = module._parameters if is_param else module._buffers
                originals.append((table, name, table[name]))
                table[name] = value
        undo = self.reinstall(path)
        try:
            yield
        finally:
            undo()
            for table, name, original in reversed(originals):
                table[name] = original

    def close(self) -> None:
        """Finish the prefetched gathers backward did not use (every rank
        started them)."""
        for gathered in self.ahead.values():
            gathered.wait()
        self.ahead.clear()
