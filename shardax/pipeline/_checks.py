"""What the executor checks on its first step, on every rank of the
pipeline at once (one rank's mistake is an error on all of them, not a
hang on the others): that a rank of middle stages was given the rules its
stand-ins need (:func:`check_rules`), and that the blocks take nothing
computed from outer parameters it does not hold (:class:`Probe`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import collectives as C
from ..errors import ScheduleError
from ..mesh._mesh import Mesh
from ..shard._sharded import Sharded
from ._stages import Stages, stand_in

__all__ = ["Probe", "check_rules"]


def check_rules(params: dict[str, Any], rules: Any, middle: bool, mesh: Mesh, axis: str) -> None:
    """A rank that runs only middle stages (``middle``) runs the outer
    modules on stand-ins, which must be the pieces the params' module rules
    (tensor or sequence parallelism) expect — from ``rules=``. Without
    them, a ScheduleError on every rank of ``axis``."""
    placed = any(
        isinstance(x, Sharded) and x.placement is not None and x.placement.modules
        for x in params.values()
    )
    mine = torch.tensor([int(rules is None and middle and placed)], dtype=torch.int64)
    every = C.all_gather(mine, axis, mesh=mesh)
    if bool(every.any()):
        ranks = [r for r in range(every.shape[0]) if every[r]]
        raise ScheduleError(
            f"rank(s) {ranks} of {axis!r} run only middle stages, whose outer modules run on "
            "stand-ins of the first and last stage's parameters, and the params carry module "
            "rules (tensor or sequence parallelism) that check their pieces: pass the rules "
            "(pipeline.value_and_grad(..., rules=rules)) so the stand-ins take their shapes"
        )


class Probe:
    """The first step's check that a stage computes everything its blocks
    take: the stand-ins of the outer parameters this rank does not hold
    require grad for that step (:meth:`swapping`), and every tensor a block
    takes besides the hidden state is traced back through autograd
    (:meth:`look`, a forward pre-hook); one that reaches a stand-in (a
    learned bias computed outside the blocks and passed to each) would be
    computed from zeros here."""

    def __init__(self, leaves: dict[int, str]) -> None:
        self.leaves = leaves  # id of a stand-in that requires grad -> its key path
        self.found: set[str] = set()

    @classmethod
    def swapping(
        cls, full: dict[str, Any], params: dict[str, Any], buffers: set[str], stages: Stages
    ) -> Probe:
        """A probe for this step; the stand-ins of the outer parameters in
        ``full`` (those not in ``params``) swapped for ones that require grad."""
        leaves: dict[int, str] = {}
        for k, x in full.items():
            if k in params or k in buffers or stages.stage_of(k) is not None:
                continue
            if not x.dtype.is_floating_point:
                continue
            if isinstance(x, Sharded):
                piece = stand_in(x.local.shape, x.dtype).requires_grad_()
                full[k] = Sharded(piece, x.layout, x.shape, placement=x.placement)
            else:
                piece = full[k] = stand_in(x.shape, x.dtype).requires_grad_()
            leaves[id(piece)] = k
        return cls(leaves)

    def look(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if args:  # the hidden state first
            taken = [*args[1:], *kwargs.values()]
        else:
            taken = [v for k, v in kwargs.items() if k != "hidden_states"]
        tensors = _tensors(taken)
        stack: list[Any] = [t.grad_fn for t in tensors if t.grad_fn is not None]
        stack += [t for t in tensors if t.grad_fn is None and id(t) in self.leaves]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, torch.Tensor):  # a stand-in passed as it is
                self.found.add(self.leaves[id(node)])
                continue
            variable = getattr(node, "variable", None)  # a leaf's AccumulateGrad
            if variable is not None and id(variable) in self.leaves:
                self.found.add(self.leaves[id(variable)])
            stack.extend(n for n, _ in node.next_functions if n is not None)

    def agree(self, keys: list[str], mesh: Mesh, axis: str) -> None:
        """What the probes of every rank of ``axis`` found (``keys``: every
        parameter path, in the same order on every rank): a ScheduleError
        naming the parameters and the ranks, else nothing."""
        mine = torch.tensor([k in self.found for k in keys], dtype=torch.int64)
        every = C.all_gather(mine[None], axis, mesh=mesh)
        where = every.nonzero().tolist()
        if where:
            names = sorted({keys[j] for _, j in where})
            ranks = sorted({r for r, _ in where})
            raise ScheduleError(
                f"rank(s) {ranks} of {axis!r} run blocks that take, besides the hidden state, "
                f"values computed from the outer parameters {names}, which those ranks do not "
                "hold (they run only middle stages: the values would come from stand-ins); name "
                f"them in pipeline.split(..., shared={names!r}) so every stage holds them"
            )


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in ``values`` (and in tuples, lists and dicts in them)."""
    out: list[torch.Tensor] = []
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out
