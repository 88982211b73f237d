"""``value_and_grad``: the loss and the gradients of a function of sharded
parameters, each gradient reduced to the layout its placement asks for.

Gradient convention (see docs/collectives.md): every rank's local gradient
is a *contribution*, and the true gradient is their sum. Each rank returns
its own loss (a mean over its local batch); the value is the mean over all
ranks and backward is seeded with ``1 / world size``, so a value computed
identically on several ranks (tensor-parallel replicas) is counted once and
data-parallel ranks average, as PyTorch DDP does. Contributions are then
summed into the gradient layout: ``psum`` where it is replicated (ZeRO 0/1),
``psum_scatter`` where it is split (ZeRO 2/3), in buckets started while
backward still runs.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .._timing import phase
from .._tree import flatten_with_paths
from ..errors import ShardingError
from ..mesh._mesh import normalize_axes
from ._layout import Layout
from ._memory import detached, placed, release
from ._placement import memory_kind, role_layout
from ._sharded import Sharded
from ._transfer import Reducer, transfer

__all__ = ["current_tape", "value_and_grad"]

_TAPE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("shardax_tape", default=None)


def current_tape() -> Tape | None:
    """The tape of the :func:`value_and_grad` call running now, if any."""
    return _TAPE.get()


class _Lift(torch.autograd.Function):
    """Identity on a gathered parameter whose backward hands the gradient to
    a sink instead of flowing it into the gather (so the gathered tensor
    need not live until backward)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor, sink: Any) -> torch.Tensor:
        ctx.sink = sink
        ctx.set_materialize_grads(False)  # no gradient reached it: nothing to hand on
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[None, None, None]:
        if g is not None:
            ctx.sink(g)
        return None, None, None


class _Slot:
    """One tracked parameter and its reduced gradient (no reference back to
    the tape: no cycle keeps gradients alive after the call)."""

    __slots__ = ("accumulate", "grad", "grads_layout", "held", "leaf", "path", "reducer")

    def __init__(
        self, reducer: Reducer, path: str, leaf: Any, accumulate: bool, grads_layout: Layout
    ) -> None:
        self.reducer, self.path, self.leaf = reducer, path, leaf
        self.accumulate = accumulate
        self.grads_layout = grads_layout  # where contributions are reduced to
        self.grad: torch.Tensor | None = None
        self.held: torch.Tensor | None = None  # contributions summed here, reduced at flush

    def sink(self, g: torch.Tensor) -> None:
        """Where autograd hands a contribution: reduced at once, or (a
        pipeline's micro-batches) summed here and reduced in :meth:`Tape.finish`."""
        if self.accumulate:
            if self.held is None:  # autograd's fresh tensor: kept as it is
                self.held = g if g._base is None and g.is_contiguous() else g.clone()
            else:
                self.held.add_(g)
        else:
            self.reduce(g)

    def add(self, g: torch.Tensor) -> None:
        kind = memory_kind(self.leaf, "grads")
        if kind == "device" or not kind.startswith("disk:"):
            self.grad = g if self.grad is None else self.grad + g
        elif self.grad is None:  # rules.offload("grads", "disk"): reduced, then to its file
            self.grad = placed(g, kind)
        else:
            self.grad.add_(g)
            release(self.grad)

    def reduce(self, g: torch.Tensor) -> None:
        x = self.leaf
        compute = role_layout(x, "compute")
        across = x.placement.grads_across if x.placement is not None else ()
        self.reducer.add(g, compute.dual(), self.grads_layout, x.shape, self.add, across)


class Tape:
    """What one :func:`value_and_grad` call records for the code it runs.

    It tracks the parameters: :meth:`track` makes each a fresh leaf that
    requires grad, and gives each ``Sharded`` one a slot, where its
    gradient contributions arrive (from :func:`apply`, through
    :meth:`lift`) and are summed once ``reducer`` has reduced them to the
    grads layout. And it keeps what must finish before the gradients are
    read (:meth:`defer`). It moves no data itself: the reducer runs the
    reductions, and :func:`apply` the gathers (forward and backward).
    """

    def __init__(
        self, reducer: Reducer, *, accumulate: bool = False, unreduced: tuple[str, ...] = ()
    ) -> None:
        self.anchor = torch.zeros((), requires_grad=True)
        self.reducer = reducer
        self.accumulate = accumulate
        self.unreduced = unreduced
        self.slots: dict[int, _Slot] = {}
        self._deferred: list[Callable[[], None]] = []

    def track(self, tree: Any) -> tuple[Any, list[tuple[str, Any, Any]]]:
        """``tree`` with its floating leaves made fresh leaves that require
        grad, and ``(path, leaf, tracked leaf or None)`` for each leaf."""
        paths, leaves, spec = flatten_with_paths(
            tree, is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True
        )
        out, tracked = [], []
        for path, x in zip(paths, leaves, strict=True):
            if isinstance(x, Sharded) and x.dtype.is_floating_point:
                t = Sharded(
                    detached(x.local).requires_grad_(), x.layout, x.shape, placement=x.placement
                )
                grads = _grads_layout(path, t, self.unreduced)
                self.slots[id(t)] = _Slot(self.reducer, path, t, self.accumulate, grads)
            elif isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
                t = detached(x).requires_grad_()
            else:
                out.append(x)
                tracked.append((path, x, None))
                continue
            out.append(t)
            tracked.append((path, x, t))
        return optree.tree_unflatten(spec, out), tracked

    def lift(self, x: Any, value: torch.Tensor) -> torch.Tensor:
        """``value`` (the gathered ``x``) as a tensor whose gradient goes to
        ``x``'s slot."""
        slot = self.slots.get(id(x))
        if slot is None:
            return x if isinstance(x, torch.Tensor) else value
        return _Lift.apply(self.anchor, value, slot.sink)

    def defer(self, done: Callable[[], None]) -> None:
        """Call ``done`` when backward is over, before the last reductions
        finish (work that every rank started, such as regathers)."""
        self._deferred.append(done)

    def finish(self) -> None:
        """Run what was deferred, then finish the reductions — with
        ``accumulate``, first reduce each parameter's summed contributions
        once (a pipeline's micro-batches: one reduction per step, not per
        micro-batch), in tracking order, the same on every rank."""
        deferred, self._deferred = self._deferred, []
        for done in deferred:
            done()
        for slot in self.slots.values():
            if slot.held is not None:
                held, slot.held = slot.held, None
                slot.reduce(held)
        self.reducer.finish()


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int = 0,
    has_aux: bool = False,
    *,
    bucket_bytes: int = 25 * 2**20,
    unreduced: str | Sequence[str] = (),
) -> Callable[..., Any]:
    """A function returning ``(value, grads)`` of ``fn`` with respect to its
    argument ``argnums`` (a pytree of parameters: :class:`Sharded` leaves or
    tensors), like ``jax.value_and_grad``.

    ``fn`` returns this rank's scalar loss (the mean over its local batch;
    with ``has_aux``, ``(loss, aux)``). The value is the mean over all ranks;
    grads are the gradients of that mean, shaped like the parameters, each
    ``Sharded`` in its placement's grads layout (replicated under ZeRO 0/1,
    split under ZeRO 2/3). A leaf that no gradient reached (a buffer, an
    unused or integer parameter) gets None, as ``p.grad`` is None in PyTorch.

    Args:
        fn: the function to differentiate.
        argnums: which positional argument holds the parameters.
        has_aux: ``fn`` returns ``(loss, aux)``; the result is then
            ``((value, aux), grads)``.
        bucket_bytes: gradient reductions travel in buckets of about this
            size, each started as soon as it fills during backward.
        unreduced: mesh axes over which each rank keeps its own gradient
            contribution, not summed: the gradients come back partial over
            them (``Sharded`` with ``partial=`` those axes; their sum is the
            gradient), for optimizers that reduce them themselves, compressed
            (:func:`shardax.optim.onebit_adam`). A parameter whose gradient
            is split over one of them (ZeRO-2/3 there) is refused.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> params = sx.shard({"w": torch.tensor([1.0, 2.0])}, mesh, sx.rules.zero(2))
    >>> value, grads = sx.value_and_grad(lambda p: (sx.gather(p)["w"] ** 2).sum())(params)
    >>> value, grads["w"].local
    (tensor(5.), tensor([2., 4.]))
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not 0 <= argnums < len(args):
            raise ShardingError(
                f"value_and_grad: argnums={argnums} but the function got {len(args)} positional "
                "arguments; pass the parameters positionally"
            )
        tape = Tape(Reducer(bucket_bytes), unreduced=normalize_axes(unreduced))
        traced, tracked = tape.track(args[argnums])
        new_args = (*args[:argnums], traced, *args[argnums + 1 :])
        meshes = {x.mesh for _, x, _ in tracked if isinstance(x, Sharded)}
        world = max((m.world_size for m in meshes), default=1)
        token = _TAPE.set(tape)
        try:
            with phase("forward"):
                out = fn(*new_args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            _check_loss(loss)
            with phase("backward"):
                if loss.requires_grad:
                    loss.backward(torch.full_like(loss, 1.0 / world))
        finally:
            _TAPE.reset(token)
            with phase("backward"):  # the last gradient reductions finish here
                tape.finish()
        grads = [_grad_of(tape, x, t) for _, x, t in tracked]
        value = loss.detach()
        if world > 1:
            from ..collectives._api import pmean

            mesh = next(iter(meshes))
            value = pmean(value, mesh.axis_names, mesh=mesh)
        _, _, spec = flatten_with_paths(
            args[argnums], is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True
        )
        grads_tree = optree.tree_unflatten(spec, grads)
        return ((value, aux), grads_tree) if has_aux else (value, grads_tree)

    return wrapped


def _grads_layout(path: str, x: Sharded, unreduced: tuple[str, ...]) -> Layout:
    """Where ``x``'s gradient contributions are reduced to: its grads
    layout, left partial over the ``unreduced`` axes it is replicated on."""
    grads = role_layout(x, "grads")
    if not unreduced:
        return grads
    x.mesh.check_axes(unreduced, what="value_and_grad(unreduced=...)")
    split = [a for a in unreduced if a in grads.spec.axes]
    if split:
        raise ShardingError(
            f"value_and_grad(unreduced={unreduced!r}): the gradient of {path} (shape "
            f"{tuple(x.shape)}) is split over {split} (grads layout {grads.spec!r}, on "
            f"{x.mesh!r}), so its contributions must be summed there; keep gradients "
            "unreduced only over axes they are replicated on (ZeRO-0 or 1 there)"
        )
    return Layout(grads.sharding, partial=tuple(dict.fromkeys((*grads.partial, *unreduced))))


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)
        raise ShardingError(
            f"value_and_grad: the function must return a scalar loss tensor (or (loss, aux) with "
            f"has_aux=True); got {what}"
        )
    if not loss.dtype.is_floating_point:
        raise ShardingError(f"value_and_grad: the loss must be floating point; got {loss.dtype}")


def _grad_of(tape: Tape, x: Any, t: Any) -> Any:
    if t is None:
        return None
    if not isinstance(x, Sharded):
        return t.grad
    slot = tape.slots[id(t)]
    grads_layout = slot.grads_layout
    g = slot.grad
    if t.local.grad is not None:  # used outside apply: contributions in the dual layout
        other = transfer(Sharded(t.local.grad, t.layout.dual(), t.shape), grads_layout).local
        g = other if g is None else g + other
    if g is None:
        return None
    return Sharded(g, grads_layout, t.shape)
