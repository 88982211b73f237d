"""Splitting a backward into its input half (``I``) and its weight half
(``W``), as zero-bubble schedules need.

While a split micro-batch's forward runs, every ``torch.nn.functional.linear``
(``nn.Linear``, Hugging Face's linears: where nearly all of a transformer's
weight gradients come from) goes through :class:`_Linear`, whose backward
computes only the input's gradient and keeps ``(input, output gradient)``
in a :class:`WeightGrads` store; ``W`` later computes each weight's and
bias's gradient from them and hands it to the parameter's own gradient
path (the tape's, under ZeRO). Other weights (norms, embeddings) get theirs
in ``I``, as in the zero-bubble papers. ``I`` + ``W`` cost what ``B`` does:
nothing is computed twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..shard._grad import _Lift
from ..shard._remat import recomputing

LIFT_NODE = _Lift._backward_cls

__all__ = ["WeightGrads", "deferring"]


class WeightGrads:
    """The weight-gradient work ``I`` left for ``W``: for each linear of one
    micro-batch's forward, its weight (and bias) as the forward used them,
    its input, and — once ``I`` ran — its output gradient."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[list[Any]] = []  # [weight route, bias route, input, output grad]

    @torch.no_grad()
    def run(self) -> None:
        """Compute and deliver every kept weight gradient (``W``)."""
        leaves: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for weight, bias, x, gy in self.pending:
            if gy is None:  # no gradient reached this linear's output
                continue
            g2 = gy.reshape(-1, gy.shape[-1])
            if weight is not None:
                _deliver(weight, g2.t().mm(x.reshape(-1, x.shape[-1])), leaves, grads)
            if bias is not None:
                _deliver(bias, g2.sum(0), leaves, grads)
        self.pending.clear()
        if leaves:
            torch.autograd.backward(leaves, grads)


def _deliver(route: tuple[Any, torch.dtype], g: torch.Tensor, leaves: list, grads: list) -> None:
    target, dtype = route
    if isinstance(target, torch.Tensor):  # autograd carries it
        leaves.append(target)
        grads.append(g.to(dtype))
    else:  # the node a gathered parameter came in through: its gradient path
        target.apply(g.to(dtype))


def _route(t: torch.Tensor | None) -> tuple[Any, torch.dtype] | None:
    """Where ``t``'s gradient goes, without keeping a gathered parameter
    alive until ``W``: the node it came in through from the tape (whose
    backward hands the gradient on), else ``t`` itself (a leaf, or a weight
    computed in the forward: autograd carries its gradient back)."""
    if t is None or not t.requires_grad:
        return None
    return (t.grad_fn if isinstance(t.grad_fn, LIFT_NODE) else t), t.dtype


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        entry: list[Any],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.entry = entry
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.entry[2], ctx.entry[3] = x.detach(), gy.detach()
        gx = gy.matmul(weight.to(gy.dtype)) if ctx.needs_input_grad[0] else None
        return gx, None, None, None


class deferring(TorchFunctionMode):
    """Within it, ``F.linear`` defers its weight gradients into ``store``."""

    def __init__(self, store: WeightGrads) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.requires_grad or (bias is not None and bias.requires_grad):
                if recomputing():  # rules.remat: saves what the forward saved; its
                    entry = [None, None, None, None]  # graph is dropped: nothing for W
                else:
                    entry = [_route(weight), _route(bias), None, None]
                    self.store.pending.append(entry)
                return _Linear.apply(x, weight, bias, entry)
        return func(*args, **kwargs)
