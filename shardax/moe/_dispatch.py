"""Dispatch and combine: tokens to their experts' buffers and back.

:func:`dispatch` turns ``[tokens, d]`` and a :class:`~._router.Routing`
into one buffer ``[local experts, slots, d]`` per rank — the tokens of
each expert side by side, so that every expert runs as one batched matmul
(:func:`swiglu_experts`: no Python loop over experts) — and a
:class:`Plan` of where each row came from; :func:`combine` runs the plan
backwards and sums each token's expert outputs with their weights.

Over an ``ep`` axis the experts are split in contiguous runs (rank ``r``
holds experts ``r·E/n … (r+1)·E/n − 1``): each rank sorts its (token,
choice) pairs by expert, exchanges the per-expert counts, and sends each
rank its experts' rows with :func:`~shardax.collectives.ragged_all_to_all`
(and back, whose transpose carries the gradients). Every step is
differentiable.

Choices are served in priority order: every token's first choice, in
token order, before any second choice (GShard, DeepSpeed). With a
``capacity``, the pairs past it on each expert are dropped — their
output is zero, the residual path carries the token — and the plan says
how many (:attr:`Plan.dropped`). Without one (dropless), every pair runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .. import collectives as C
from ..errors import ShardingError
from ..mesh._mesh import Mesh
from . import _stats
from ._router import Routing

__all__ = ["Plan", "capacity_of", "combine", "dispatch", "swiglu_experts"]


class Plan(NamedTuple):
    """Where the rows of one :func:`dispatch` went."""

    tokens: int  # rows of the input
    token: torch.Tensor  # [pairs kept] the token of each kept pair, in expert order
    weight: torch.Tensor  # [pairs kept] its combine weight
    slot: torch.Tensor  # [rows here] each row's place in the flat buffer [experts · slots]
    send: tuple[int, ...]  # rows sent to each member of the axis (empty: one rank)
    recv: tuple[int, ...]  # rows received from each
    dropped: int  # pairs past capacity, on this rank
    axis: str | None
    mesh: Mesh | None
    load: torch.Tensor  # [experts] pairs this rank routed to each, before capacity
    experts: torch.Tensor  # [blocks] the local expert of each block of the buffer


def capacity_of(tokens: int, experts: int, k: int, factor: float) -> int:
    """Slots per expert for ``tokens`` tokens, ``k`` choices each:
    ``ceil(factor · tokens · k / experts)`` (at least 1).

    >>> capacity_of(8, 4, 2, 1.0), capacity_of(8, 4, 2, 1.25)
    (4, 5)
    """
    return max(1, math.ceil(factor * tokens * k / experts))


def dispatch(
    x: torch.Tensor,
    routing: Routing,
    *,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    axis: str | None = None,
    batch: str | Sequence[str] | None = None,
    mesh: Mesh | None = None,
    num_experts: int | None = None,
    block: int | str | None = None,
) -> tuple[torch.Tensor, Plan]:
    """``x`` (``[tokens, d]``) laid out for the experts: a buffer
    ``[local experts, slots, d]`` (zeros in unused slots) and its plan.

    ``block``: blocks of that many rows instead — each expert's first
    ``block`` rows in its own block, in expert order, then extra blocks for
    the rows past them (:attr:`Plan.experts`: each block's expert) — so an
    uneven load pads each expert to a block rather than every expert to
    the fullest; ``"auto"``: whichever costs least, the padded layout or
    blocks of ``fullest / j`` rows, an extra block's weight gather counted
    as ``BLOCK_COST_ROWS`` rows. Run it with ``swiglu_experts(...,
    experts=plan.experts)``.

    ``axis``: the mesh axis the experts are split over (``mesh``'s); None:
    every expert here. ``capacity``: at most that many pairs per expert, or
    ``capacity_factor``: ``capacity_of(tokens, E, k, factor)`` slots for
    the step's tokens; neither: dropless (the slots the fullest expert
    needs). The capacity is the whole batch's: ``batch`` names the mesh
    axes its tokens are split over (default: ``axis``), their ranks'
    pairs queue for each expert in priority order, then rank order (the
    order of ``mesh.axis_index(batch)``), then token order — so the pairs
    dropped are exactly those one process would drop from the whole batch,
    on any mesh. Without ``batch`` or ``axis``, this rank's tokens alone.

    >>> import torch
    >>> from shardax.moe import route
    >>> r = route(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), 1)
    >>> buffer, plan = dispatch(torch.arange(3.0)[:, None], r)
    >>> buffer[..., 0].tolist(), plan.dropped, plan.load.tolist()
    ([[0.0, 2.0], [1.0, 0.0]], 0, [2, 1])
    >>> dispatch(torch.arange(3.0)[:, None], r, capacity=1)[1].dropped
    1
    >>> blocks, plan = dispatch(torch.arange(3.0)[:, None], r, block=1)
    >>> blocks[..., 0].tolist(), plan.experts.tolist()
    ([[0.0], [1.0], [2.0]], [0, 1, 0])
    """
    if x.dim() != 2 or routing.experts.shape[0] != x.shape[0]:
        raise ShardingError(
            f"dispatch takes x as [tokens, d] with one routing row per token; got x "
            f"{tuple(x.shape)} and routing for {routing.experts.shape[0]} tokens"
        )
    if capacity is not None and capacity_factor is not None:
        raise ShardingError("dispatch: give capacity (slots) or capacity_factor, not both")
    if (axis is not None or batch is not None) and mesh is None:
        raise ShardingError(
            "dispatch(axis=..., batch=...) needs the mesh: dispatch(..., mesh=mesh)"
        )
    n_experts = routing.num_experts if num_experts is None else num_experts
    k = routing.experts.shape[1]
    ranks = mesh.size(axis) if axis is not None and mesh is not None else 1
    if n_experts % ranks:
        raise ShardingError(
            f"dispatch: {n_experts} experts do not split evenly over {axis!r} of size {ranks}"
        )
    local = n_experts // ranks
    tokens = x.shape[0]
    # pairs in priority order: every first choice (token order), then every second, ...
    expert = routing.experts.t().reshape(-1)
    token = torch.arange(tokens, device=x.device).repeat(k)
    weight = routing.weights.t().reshape(-1)
    expert, order = torch.sort(expert, stable=True)
    token, weight = token[order], weight[order]
    counts = torch.bincount(expert, minlength=n_experts)
    load, dropped = counts, 0
    if capacity is not None or capacity_factor is not None:
        keep, capacity = _within_capacity(
            expert, order // tokens, k, n_experts, capacity, capacity_factor,
            _batch_axes(batch, axis), mesh,
        )  # fmt: skip
        dropped = int((~keep).sum())
        expert, token, weight = expert[keep], token[keep], weight[keep]
        counts = torch.bincount(expert, minlength=n_experts)
    rows = x[token]
    send: tuple[int, ...] = ()
    recv: tuple[int, ...] = ()
    if ranks > 1:
        assert axis is not None and mesh is not None
        mine = counts.view(ranks, local)  # row j: what this rank sends rank j, by its experts
        got = C.ragged_all_to_all(mine, axis, [1] * ranks, [1] * ranks, mesh=mesh)  # [src, local]
        send = tuple(int(s) for s in mine.sum(1).tolist())
        recv = tuple(int(r) for r in got.sum(1).tolist())
        rows = C.ragged_all_to_all(rows, axis, send, recv, mesh=mesh)
        # the rows arrive by source rank, each source's sorted by local expert
        here = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(ranks), got.reshape(-1)
        )
        local_counts = got.sum(0)
    else:
        here, local_counts = expert, counts
    fullest = int(local_counts.max()) if local_counts.numel() else 0
    size = fullest if block is None else _block_size(block, local_counts)
    # every expert's first `size` rows in its own block (expert order); the rows of an
    # expert past its first block in extra blocks after them (none when size is the fullest)
    extra_of = ((local_counts + size - 1) // max(size, 1) - 1).clamp(min=0)
    here_sorted, by_expert = torch.sort(here, stable=True)
    starts = torch.cumsum(local_counts, 0) - local_counts
    within = torch.empty_like(here)
    within[by_expert] = torch.arange(here.numel(), device=x.device) - starts[here_sorted]
    extra_first = local + torch.cumsum(extra_of, 0) - extra_of
    later = within // max(size, 1)  # 0: the first block
    block_of = torch.where(later == 0, here, extra_first[here] + later - 1)
    slot = block_of * size + within % max(size, 1)
    n_blocks = local + int(extra_of.sum())
    buffer = rows.new_zeros(n_blocks * size, x.shape[1]).index_add(0, slot, rows)
    ids = torch.arange(local, device=x.device)
    experts = torch.cat([ids, torch.repeat_interleave(ids, extra_of)])
    plan = Plan(tokens, token, weight, slot, send, recv, dropped, axis, mesh, load, experts)
    _stats.record(plan, _batch_axes(batch, axis) if mesh is not None else ())
    return buffer.view(n_blocks, size, x.shape[1]), plan


BLOCK_COST_ROWS = 64
"""What gathering one block's weights costs, in rows of expert compute (both
scale with ``d · f``): measured on CPU, forward and backward, d=512, f=1024."""


def _block_size(block: int | str, counts: torch.Tensor) -> int:
    """``block``, or for ``"auto"`` the size that costs least: the padded
    layout (``fullest`` rows for every expert), or ``fullest / j`` rows for
    every expert plus extra blocks for the fuller ones, each extra block's
    rows and its weights' gather (``BLOCK_COST_ROWS``) — blocks where they
    save at least a tenth."""
    if block != "auto":
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ShardingError(
                f"dispatch: block is a positive number of rows or 'auto'; got {block!r}"
            )
        return block
    fullest = int(counts.max()) if counts.numel() else 0
    best, cost = fullest, counts.numel() * fullest
    for j in range(2, 9):
        size = -(-fullest // j)
        if size < 1:
            break
        extra = int(((counts + size - 1) // size - 1).clamp(min=0).sum())
        total = counts.numel() * size + extra * (size + BLOCK_COST_ROWS)
        if total < cost:
            best, cost = size, total
    # blocks only where they save a tenth: the cost model is rough, padding is simple
    return best if cost < 0.9 * counts.numel() * fullest else fullest


def _batch_axes(batch: str | Sequence[str] | None, axis: str | None) -> tuple[str, ...]:
    if batch is None:
        return () if axis is None else (axis,)
    return (batch,) if isinstance(batch, str) else tuple(batch)


def _within_capacity(
    expert: torch.Tensor,
    level: torch.Tensor,
    k: int,
    n_experts: int,
    capacity: int | None,
    factor: float | None,
    batch: tuple[str, ...],
    mesh: Mesh | None,
) -> tuple[torch.Tensor, int]:
    """Which of the pairs (sorted by expert; ``level``: their choice 0…k-1)
    get a slot, the batch's ranks queueing as one process would."""
    here = torch.bincount(expert * k + level, minlength=n_experts * k).view(n_experts, k)
    if batch and mesh is not None and mesh.size(batch) > 1:
        everyone = C.all_gather(here[None], batch, mesh=mesh)  # [ranks, E, k]
        before_me = everyone[: mesh.axis_index(batch)].sum(0)
    else:
        everyone, before_me = here[None], torch.zeros_like(here)
    total = everyone.sum(0)  # [E, k]
    if capacity is None:
        assert factor is not None
        capacity = capacity_of(int(total.sum()) // k, n_experts, k, factor)
    # ahead of (expert e, choice j, this rank): every rank's pairs of e with an
    # earlier choice, then the earlier ranks' pairs of e with choice j
    ahead = torch.cumsum(total, 1) - total + before_me
    mine_before = torch.cumsum(here, 1) - here  # this rank's pairs of e with earlier choices
    starts = torch.cumsum(here.sum(1), 0) - here.sum(1)  # each expert's first pair here
    position = torch.arange(expert.numel(), device=expert.device) - starts[expert]
    queue = ahead[expert, level] + position - mine_before[expert, level]
    return queue < capacity, capacity


def combine(y: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The experts' outputs (``[local experts, slots, d']``) back to the
    tokens: ``[tokens, d']``, each token the weighted sum of its kept
    choices' outputs (dropped ones add nothing).

    >>> import torch
    >>> from shardax.moe import route
    >>> r = route(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 1)
    >>> buffer, plan = dispatch(torch.tensor([[1.0], [2.0]]), r)
    >>> combine(buffer * 10, plan).tolist()
    [[10.0], [20.0]]
    """
    rows = y.reshape(-1, y.shape[-1])[plan.slot]
    if plan.send:
        rows = C.ragged_all_to_all(rows, plan.axis, plan.recv, plan.send, mesh=plan.mesh)
    rows = rows * plan.weight[:, None].to(rows.dtype)
    return rows.new_zeros(plan.tokens, y.shape[-1]).index_add(0, plan.token, rows)


class _GroupedMM(torch.autograd.Function):
    """``x[b] @ w[experts[b]]ᵀ`` for every block ``b`` — one batched matmul
    over the gathered weights, which backward gathers again rather than
    keeping them (no copy of the experts' weights held for backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, experts)
        return torch.bmm(x, w.index_select(0, experts).transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, experts = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.bmm(grad, w.index_select(0, experts))
        if ctx.needs_input_grad[1]:
            per_block = torch.bmm(grad.transpose(1, 2), x)
            grad_w = torch.zeros_like(w).index_add_(0, experts, per_block)
        return grad_x, grad_w, None


def swiglu_experts(
    buffer: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str | Callable[[torch.Tensor], torch.Tensor] = "silu",
    *,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert's gated MLP at once, as Mixtral's and Qwen2-MoE's
    experts compute it: ``down(act(gate(x)) · up(x))`` with the weights
    stacked as Hugging Face stores them — ``gate_up`` ``[experts, 2f, d]``
    (gate rows first), ``down`` ``[experts, d, f]``. Two batched matmuls.
    ``experts``: the expert of each block of a buffer laid out in blocks
    (:attr:`Plan.experts`).
    ``act``: ``"silu"``, ``"gelu"``, ``"relu"`` or a function.

    >>> import torch
    >>> swiglu_experts(torch.ones(2, 3, 4), torch.ones(2, 10, 4), torch.ones(2, 4, 5)).shape
    torch.Size([2, 3, 4])
    """
    activation = act if callable(act) else {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}.get(act)
    if activation is None:
        raise ShardingError(f"swiglu_experts: act is 'silu', 'gelu' or 'relu'; got {act!r}")
    n = gate_up.shape[0]
    if experts is None and buffer.shape[0] != n:
        raise ShardingError(
            f"swiglu_experts: a buffer of {buffer.shape[0]} blocks for {n} experts; a buffer "
            "laid out in blocks (dispatch(..., block=...)) runs with experts=plan.experts"
        )
    gate, up = _expert_mm(buffer, gate_up, experts).chunk(2, dim=-1)
    return _expert_mm(activation(gate) * up, down, experts)


def _expert_mm(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
    """Each block of ``x`` times its expert's ``w``ᵀ: the first ``E`` blocks
    (one per expert, in order, as :func:`dispatch` lays them) against the
    weights as they are, the extra blocks against their gathered weights."""
    n = w.shape[0]
    first = torch.bmm(x[:n], w.transpose(1, 2))
    if experts is None or experts.numel() == n:
        return first
    return torch.cat([first, _GroupedMM.apply(x[n:], w, experts[n:])])
