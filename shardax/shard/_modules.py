"""Rules for modules: the layouts of activations at module boundaries, and
functional replacements for modules that compute differently when sharded.

A :class:`ModuleRule` names modules by path (a regex, like :class:`Rule`
does for parameters) and says what :func:`shardax.apply` does around them:
relayout positional inputs before the module runs and its output after
(each a :class:`Relayout`: the layout the tensor arrives in → the layout
wanted, moved by :func:`shardax.transfer`, so backward gets the transposed
collective), or run a ``forward`` of its own instead of the module's. This
is how tensor parallelism is stated as data: a row-parallel linear yields a
partial sum over ``tp`` that becomes replicated (a ``psum``) or, with
sequence parallelism, split over the sequence (a ``psum_scatter``).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, normalize_axes
from ._layout import Layout
from ._random import Streams
from ._remat import Remat, checkpointed
from ._sharded import Sharded
from ._spec import PartitionSpec, as_spec

__all__ = ["ModuleRule", "Relayout", "SplitOutput", "install"]


@attrs.frozen(repr=False)
class Relayout:
    """Move an activation from layout ``src`` (with pending sums over
    ``partial``) to layout ``dst``, on the parameters' mesh. Activations are
    split evenly: a dim split over axes of total size ``n`` holds ``1/n`` of
    the global dim on every rank.

    >>> from shardax import P
    >>> Relayout(P(), P(), partial="tp")          # a row-parallel output: psum
    Relayout(P(), P(), partial=('tp',))
    >>> Relayout(P(None, "tp"), P())               # sequence-split → replicated: all_gather
    Relayout(P(None, 'tp'), P())

    A dim of equal blocks is moved block by block (:func:`shardax.blocks`):
    a packed ``[B, T, 3·d]`` q/k/v output goes from a sequence split to a
    split of each of its three blocks (each rank: its heads of q, of k and
    of v).

    >>> from shardax import blocks
    >>> Relayout(P(None, "sp"), P(None, None, blocks(3, "sp")))
    Relayout(P(None, 'sp'), P(None, None, blocks(3, 'sp')))
    """

    src: PartitionSpec = attrs.field(converter=as_spec)
    dst: PartitionSpec = attrs.field(converter=as_spec)
    partial: tuple[str, ...] = attrs.field(default=(), converter=normalize_axes, kw_only=True)

    def __call__(self, t: torch.Tensor, mesh: AbstractMesh, where: str = "") -> torch.Tensor:
        """``t`` (this rank's piece in ``src``) moved to ``dst``: this rank's piece."""
        from ._transfer import transfer

        if not isinstance(t, torch.Tensor):
            raise ShardingError(f"{where}: {self!r} needs a tensor; got {type(t).__name__}")

        if len(self.src.entries) > t.ndim or len(self.dst.entries) > t.ndim:
            raise ShardingError(
                f"{where}: {self!r} has more entries than the activation has dims "
                f"(shape {tuple(t.shape)})"
            )
        shape = list(t.shape)
        for d, axes in enumerate(self.src.dim_axes(t.ndim)):
            shape[d] *= math.prod(mesh.size(a) for a in axes)
        for d, (was, axes) in enumerate(
            zip(self.src.dim_axes(t.ndim), self.dst.dim_axes(t.ndim), strict=True)
        ):
            n = math.prod(mesh.size(a) for a in axes if a not in was)
            if shape[d] % n:
                raise ShardingError(
                    f"{where}: {self!r} splits dim {d} of a {tuple(shape)} activation over "
                    f"{axes!r} ({n} ranks), which does not divide {shape[d]}: activations split "
                    f"evenly — give sequences whose length divides by {n} (to sample one token "
                    "at a time, apply the same params with rules that do not split the "
                    "sequence: rules.megatron(tp) without sequence_parallel, or no rules under "
                    "Ulysses)"
                )
        src = Layout(mesh, self.src, partial=self.partial)
        moved = transfer(Sharded(t, src, tuple(shape)), Layout(mesh, self.dst)).local
        return moved.contiguous()  # modules .view() their inputs (Conv1D does)

    def __repr__(self) -> str:
        tail = f", partial={self.partial!r}" if self.partial else ""
        return f"Relayout({self.src!r}, {self.dst!r}{tail})"


@attrs.frozen(repr=False)
class SplitOutput:
    """What becomes of a module output whose dim ``dim`` (counted from the
    end when negative) comes out split over ``axis`` — a
    vocabulary-parallel LM head's logits: with ``gather`` (the default)
    it is all-gathered into the whole tensor, so what the model returns
    has its own shape on every rank and any loss, sampling or Hugging
    Face's ``labels=`` works; without, this rank's piece comes back
    *marked*, as a :class:`shardax.Sharded` that knows its layout, which
    :func:`shardax.vocab_parallel_cross_entropy` takes as it is and every
    plain torch op refuses (:class:`shardax.SplitTensorError`). Never a
    bare piece that could pass for the whole tensor.

    The whole size of the dim is the module's own (``out_features`` of an
    ``nn.Linear``, ``nf`` of Hugging Face's ``Conv1D``), so an output that
    is already whole — the module's weight kept whole by a rule of yours —
    comes back as it is (without ``gather``: a ``Sharded`` laid out
    ``P()``), and uneven pieces are laid out as ``torch.chunk`` lays them
    (an output of any other size is an error).

    >>> SplitOutput("tp")
    SplitOutput('tp')
    >>> SplitOutput("tp", gather=False)
    SplitOutput('tp', gather=False)
    """

    axis: tuple[str, ...] = attrs.field(converter=normalize_axes)
    dim: int = attrs.field(default=-1, kw_only=True)
    gather: bool = attrs.field(default=True, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.axis:
            raise ShardingError("SplitOutput needs the mesh axis the output is split over")

    def __call__(
        self, t: torch.Tensor, mesh: AbstractMesh, where: str = "", module: Any = None
    ) -> Any:
        """``t`` (this rank's piece of ``module``'s output) gathered, or
        marked as a ``Sharded``."""
        from ._transfer import transfer

        if not isinstance(t, torch.Tensor):
            raise ShardingError(f"{where}: {self!r} needs a tensor; got {type(t).__name__}")
        if not -t.ndim <= self.dim < t.ndim:
            raise ShardingError(
                f"{where}: {self!r} splits dim {self.dim}, the output has shape {tuple(t.shape)}"
            )
        dim = self.dim % t.ndim
        whole = _features(module)
        if whole is None:
            raise ShardingError(
                f"{where}: {self!r} cannot tell the whole size of dim {dim} of a "
                f"{type(module).__name__} output: it reads out_features (nn.Linear) or nf "
                "(transformers' Conv1D); give the module rule a forward of its own"
            )
        shape = (*t.shape[:dim], whole, *t.shape[dim + 1 :])
        split = Layout(mesh, PartitionSpec(*[None] * dim, self.axis))
        if t.shape[dim] == whole and split.local_shape(shape, getattr(mesh, "rank", 0)) != shape:
            # the weight kept whole (a rule before the preset's): whole, marked so if asked
            return t if self.gather else Sharded(t, Layout(mesh, PartitionSpec()), shape)
        rank = getattr(mesh, "rank", 0)
        if split.local_shape(shape, rank) != tuple(t.shape):
            raise ShardingError(
                f"{where}: {self!r}: this rank's output has shape {tuple(t.shape)}, neither the "
                f"whole {shape} nor its piece {split.local_shape(shape, rank)} under {split!r}; "
                "is the module's weight laid out over another axis?"
            )
        piece = Sharded(t, split, shape)
        if self.gather:
            return transfer(piece, Layout(mesh, PartitionSpec())).local
        return piece

    def __repr__(self) -> str:
        axis = self.axis[0] if len(self.axis) == 1 else self.axis
        tail = (f", dim={self.dim}" if self.dim != -1 else "") + (
            "" if self.gather else ", gather=False"
        )
        return f"SplitOutput({axis!r}{tail})"


def _features(module: Any) -> int | None:
    """The whole output width a module declares (``nn.Linear``,
    ``transformers``' ``Conv1D``), or None."""
    for name in ("out_features", "nf"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


Forward = Callable[..., Any]
"""``forward(module, mesh, *args, **kwargs)``: the module's computation when
sharded; its parameters are its compute-layout pieces."""


def _is_input_move(r: Any) -> bool:
    """A :class:`Relayout`, or another input transform of its protocol
    (``r(t, mesh, where)``: :class:`shardax.GlobalPositions`, the check of
    a batch's sequence split ``rules.context_parallel`` makes)."""
    from ._ring_modes import GlobalPositions, SequencePiece

    return isinstance(r, Relayout | GlobalPositions | SequencePiece)


def _relayouts(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    items = (value,) if _is_input_move(value) else tuple(value)
    for r in items:
        if r is not None and not _is_input_move(r):
            raise ShardingError(
                "ModuleRule inputs are Relayout, GlobalPositions, SequencePiece or None (one per "
                "argument); "
                f"got {r!r}"
            )
    return items


@attrs.frozen(repr=False)
class ModuleRule:
    """What :func:`shardax.apply` does around the modules whose path fully
    matches the regex ``pattern``: relayout the positional ``inputs`` (one
    :class:`Relayout` or None per argument) before the module runs and its
    ``output`` after, or run ``forward(module, mesh, *args, **kwargs)``
    instead of the module's own forward; with ``rng=axes``, the module draws
    random numbers (dropout) from a stream of its own for each index along
    ``axes`` — the regions a tensor-parallel axis splits — and the shared
    stream continues the same on every rank after it; ``rejoin=True``
    returns the enclosing region to the shared stream once the module has
    run (its output is a replica again: a row-parallel linear's ``psum``);
    ``remat``: the module's forward rematerialised (:class:`Remat`,
    ``rules.remat``). Every matching rule applies; for each of inputs,
    output, forward, rng and remat the first matching rule that sets it
    wins.

    >>> from shardax import P
    >>> ModuleRule(r"blocks\\.\\d+\\.mlp\\.proj", output=Relayout(P(), P(), partial="tp"))
    ModuleRule('blocks\\\\.\\\\d+\\\\.mlp\\\\.proj', output=Relayout(P(), P(), partial=('tp',)))
    """

    pattern: str
    inputs: tuple[Any, ...] = attrs.field(default=(), converter=_relayouts, kw_only=True)
    output: Relayout | SplitOutput | None = attrs.field(default=None, kw_only=True)
    forward: Forward | None = attrs.field(default=None, kw_only=True)
    rng: tuple[str, ...] = attrs.field(default=(), converter=normalize_axes, kw_only=True)
    rejoin: bool = attrs.field(default=False, kw_only=True)
    remat: Remat | None = attrs.field(default=None, kw_only=True)
    within: Callable[[AbstractMesh], Any] | None = attrs.field(default=None, kw_only=True)
    _regex: re.Pattern[str] = attrs.field(init=False, eq=False)

    @_regex.default
    def _make_regex(self) -> re.Pattern[str]:
        if not isinstance(self.pattern, str):
            raise ShardingError(
                f"a module rule pattern is a string (a regex); got {self.pattern!r}"
            )
        try:
            return re.compile(self.pattern)
        except re.error as err:
            raise ShardingError(
                f"module rule pattern {self.pattern!r} is not a valid regex: {err}"
            ) from None

    def __attrs_post_init__(self) -> None:
        if self.output is not None and not isinstance(self.output, (Relayout, SplitOutput)):
            raise ShardingError(
                f"ModuleRule output is a Relayout, a SplitOutput or None; got {self.output!r}"
            )
        if self.forward is not None and not callable(self.forward):
            raise ShardingError(f"ModuleRule forward must be callable; got {self.forward!r}")
        if self.within is not None and not callable(self.within):
            raise ShardingError(
                f"ModuleRule within is a callable (mesh -> context manager); got {self.within!r}"
            )
        if self.remat is not None and not isinstance(self.remat, Remat):
            raise ShardingError(
                f"ModuleRule remat is a Remat (rules.remat makes one); got {self.remat!r}"
            )

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None

    def __repr__(self) -> str:
        parts = [repr(self.pattern)]
        if self.inputs:
            parts.append(f"inputs={self.inputs!r}")
        if self.output is not None:
            parts.append(f"output={self.output!r}")
        if self.forward is not None:
            parts.append(f"forward={getattr(self.forward, '__name__', self.forward)!s}")
        if self.rng:
            parts.append(f"rng={self.rng!r}")
        if self.rejoin:
            parts.append("rejoin=True")
        if self.within is not None:
            parts.append(f"within={self.within!r}")
        if self.remat is not None:
            parts.append(f"remat={self.remat!r}")
        return f"ModuleRule({', '.join(parts)})"


_MESHED = ("inputs", "output", "forward", "within", "rng", "rejoin")
"""The aspects of a module rule that need the parameters' mesh (remat does not)."""


def install(
    model: nn.Module,
    rules: Sequence[ModuleRule],
    mesh: AbstractMesh | None,
    *,
    under: str | None = None,
    record: Callable[[str, nn.Module], Callable[[], Any]] | None = None,
) -> Callable[[], None]:
    """Hook ``rules`` onto the matching modules of ``model``; returns the
    function that removes every hook and restores every forward.

    ``under``: only the modules strictly inside that module (the
    recomputation of a rematerialised one: no remat there). ``record(path,
    module)``: what a rematerialised module's forward calls, each time it
    runs, for the context its recomputation runs in (:func:`shardax.apply`
    gathers its parameters again); without it, remat rules are refused."""
    undo: list[Callable[[], None]] = []
    if not rules:
        return lambda: None
    streams = Streams(mesh) if mesh is not None else None
    seen: dict[int, int] = {}  # remat rule -> the modules it matched so far
    rematerialised: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        matching = [r for r in rules if r.matches(path)]
        inside = under is None or (path.startswith(f"{under}.") if under else bool(path))
        if not matching or not inside:
            continue
        if (mesh is None or streams is None) and any(
            getattr(r, a) for r in matching for a in _MESHED
        ):
            raise ShardingError(
                f"module rule {matching[0]!r} matches {path!r} but no parameter is Sharded: module "
                "rules run on the parameters' mesh (shard them with shardax.shard or init_params)"
            )

        def first(aspect: str, matching: list[ModuleRule] = matching) -> Any:
            return next((r for r in matching if getattr(r, aspect)), None)

        if (rule := first("inputs")) is not None:
            hook = _inputs(rule, mesh, path, module)
            undo.append(module.register_forward_pre_hook(hook, with_kwargs=True).remove)
        if (rule := first("output")) is not None:
            undo.append(module.register_forward_hook(_output(rule, mesh, path)).remove)
        if (rule := first("forward")) is not None:
            undo.append(_set_forward(module, _bound(rule.forward, module, mesh)))
        if (rule := first("within")) is not None:  # inside remat: its recomputation too
            undo.append(_set_forward(module, _inside(rule.within, module.forward, mesh)))
        if (rule := first("remat")) is not None and under is None:
            count = seen[id(rule)] = seen.get(id(rule), -1) + 1
            if count % rule.remat.every == 0:
                if record is None:
                    raise ShardingError(
                        f"{rule!r} matches {path!r}: remat runs inside shardax.apply"
                    )
                rematerialised.append((path, module))
                run = checkpointed(
                    module.forward, rule.remat, module, functools.partial(record, path, module)
                )
                undo.append(_set_forward(module, run))
        if (rule := first("rng")) is not None:
            pre, post = streams.fork(rule.rng)
            undo.append(module.register_forward_pre_hook(pre, prepend=True).remove)
            undo.append(module.register_forward_hook(post, always_call=True).remove)
        if first("rejoin") is not None:
            undo.append(module.register_forward_hook(streams.rejoin, always_call=True).remove)

    def remove() -> None:
        for u in reversed(undo):
            u()

    try:
        _check_remat(rules, rematerialised)
    except ShardingError:
        remove()
        raise
    return remove


def _check_remat(rules: Sequence[ModuleRule], remat: list[tuple[str, nn.Module]]) -> None:
    """Refuse what a recomputation could not replay: a rematerialised
    module inside another, or one holding a module that rejoins the shared
    random stream of a region forked outside it (its recomputation would
    not rejoin, and draw other dropout masks)."""
    paths = {path for path, _ in remat}
    for outer, module in remat:
        for path, _ in module.named_modules(prefix=outer):
            if path == outer:
                continue
            if path in paths:
                raise ShardingError(
                    f"remat: {path!r} is rematerialised inside {outer!r}, which is too; remat one "
                    "of them (rules.remat patterns that do not nest)"
                )
            if not any(r.rejoin and r.matches(path) for r in rules):
                continue
            steps = (path[len(outer) + 1 :] if outer else path).split(".")
            forks = [".".join(filter(None, [outer, *steps[: i + 1]])) for i in range(len(steps))]
            if not any(r.rng and r.matches(f) for f in forks for r in rules):
                raise ShardingError(
                    f"remat: {outer!r} holds {path!r}, which rejoins the shared random stream of "
                    "a region forked outside it: its recomputation could not replay the dropout "
                    "masks. Remat the module that holds the whole region (the block)"
                )


def _parameter_names(module: nn.Module) -> list[str]:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _inputs(rule: ModuleRule, mesh: AbstractMesh, path: str, module: nn.Module) -> Any:
    """A pre-hook moving the forward's ``i``-th argument by ``rule.inputs[i]``,
    passed positionally or by keyword (Hugging Face modules call their
    submodules with keywords)."""
    names = _parameter_names(module)

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        moved, named = list(args), dict(kwargs)
        for i, r in enumerate(rule.inputs):
            if r is None:
                continue
            if i < len(moved):
                moved[i] = r(moved[i], mesh, f"{path} input {i}")
            elif i < len(names) and names[i] in named:
                named[names[i]] = r(named[names[i]], mesh, f"{path} input {names[i]!r}")
        return tuple(moved), named

    return hook


def _output(rule: ModuleRule, mesh: AbstractMesh, path: str) -> Callable[..., Any]:
    assert rule.output is not None

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(rule.output, SplitOutput):
            return rule.output(output, mesh, f"{path} output", module)
        return rule.output(output, mesh, f"{path} output")

    return hook


def _bound(forward: Forward, module: nn.Module, mesh: AbstractMesh) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return forward(module, mesh, *args, **kwargs)

    return run


def _inside(
    within: Callable[[AbstractMesh], Any], forward: Callable[..., Any], mesh: AbstractMesh
) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with within(mesh):
            return forward(*args, **kwargs)

    return run


def _set_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """``module.forward = forward``; returns what puts the old one back."""
    had = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = forward  # type: ignore[method-assign]

    def restore() -> None:
        if had:
            module.forward = own  # type: ignore[method-assign]
        else:
            del module.forward

    return restore
