"""Dispatch and combine: tokens to their experts' buffers and back.

:func:`dispatch` turns ``[tokens, d]`` and a :class:`~._router.Routing`
into one buffer per rank — ``[local experts, slots, d]``, the tokens of
each expert side by side, padded to the fullest; or ``[rows, d]``, each
expert's exact rows one after another (``layout="rows"``) — so that every
expert runs in one batched matmul or one grouped GEMM
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
from typing import NamedTuple

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
    offsets: torch.Tensor  # [local experts] int32: where each one's rows end in the rows layout


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
    layout: str = "padded",
) -> tuple[torch.Tensor, Plan]:
    """``x`` (``[tokens, d]``) laid out for the experts, and its plan.

    ``layout="padded"``: a buffer ``[local experts, slots, d]``, each
    expert's rows in its own block, zeros past them to the fullest expert's
    count — the shape an experts module of your own batches over.
    ``layout="rows"``: ``[rows, d]``, each local expert's exact rows one
    after another, the expert ``i``'s ending at ``plan.offsets[i]`` — no
    padding, for a grouped GEMM (``swiglu_experts(...,
    offsets=plan.offsets)``): an uneven load costs its rows, not the
    fullest expert's count for every expert.

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
    >>> rows, plan = dispatch(torch.arange(3.0)[:, None], r, layout="rows")
    >>> rows[:, 0].tolist(), plan.offsets.tolist()
    ([0.0, 2.0, 1.0], [2, 3])
    """
    if x.dim() != 2 or routing.experts.shape[0] != x.shape[0]:
        raise ShardingError(
            f"dispatch takes x as [tokens, d] with one routing row per token; got x "
            f"{tuple(x.shape)} and routing for {routing.experts.shape[0]} tokens"
        )
    if capacity is not None and capacity_factor is not None:
        raise ShardingError("dispatch: give capacity (slots) or capacity_factor, not both")
    if layout not in ("padded", "rows"):
        raise ShardingError(f"dispatch: layout is 'padded' or 'rows'; got {layout!r}")
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
    # each row's place among its expert's rows, the experts in order
    here_sorted, by_expert = torch.sort(here, stable=True)
    offsets = torch.cumsum(local_counts, 0)
    starts = offsets - local_counts
    within = torch.empty_like(here)
    within[by_expert] = torch.arange(here.numel(), device=x.device) - starts[here_sorted]
    if layout == "rows":
        slot, shape = starts[here] + within, (here.numel(), x.shape[1])
    else:
        fullest = int(local_counts.max()) if local_counts.numel() else 0
        slot, shape = here * fullest + within, (local, fullest, x.shape[1])
    buffer = rows.new_zeros(math.prod(shape[:-1]), x.shape[1]).index_add(0, slot, rows)
    plan = Plan(
        tokens, token, weight, slot, send, recv, dropped, axis, mesh, load,
        offsets.to(torch.int32),
    )  # fmt: skip
    _stats.record(plan, _batch_axes(batch, axis) if mesh is not None else ())
    return buffer.view(shape), plan


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


def swiglu_experts(
    buffer: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str | Callable[[torch.Tensor], torch.Tensor] = "silu",
    *,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert's gated MLP at once, as Mixtral's and Qwen2-MoE's
    experts compute it: ``down(act(gate(x)) · up(x))`` with the weights
    stacked as Hugging Face stores them — ``gate_up`` ``[experts, 2f, d]``
    (gate rows first), ``down`` ``[experts, d, f]``. ``buffer``: padded,
    ``[experts, slots, d]`` (two batched matmuls), or the rows layout
    ``[rows, d]`` with ``offsets`` (:attr:`Plan.offsets`: two grouped
    GEMMs, each expert's exact rows).
    ``act``: ``"silu"``, ``"gelu"``, ``"relu"`` or a function.

    >>> import torch
    >>> swiglu_experts(torch.ones(2, 3, 4), torch.ones(2, 10, 4), torch.ones(2, 4, 5)).shape
    torch.Size([2, 3, 4])
    >>> offsets = torch.tensor([1, 3], dtype=torch.int32)  # expert 0: row 0; expert 1: rows 1, 2
    >>> swiglu_experts(torch.ones(3, 4), torch.ones(2, 8, 4), torch.ones(2, 4, 4), offsets=offsets).shape
    torch.Size([3, 4])
    """
    activation = act if callable(act) else {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}.get(act)
    if activation is None:
        raise ShardingError(f"swiglu_experts: act is 'silu', 'gelu' or 'relu'; got {act!r}")
    n = gate_up.shape[0]
    if buffer.dim() != (3 if offsets is None else 2) or (offsets is None and buffer.shape[0] != n):
        raise ShardingError(
            f"swiglu_experts: a buffer of shape {tuple(buffer.shape)} for {n} experts"
            f"{'' if offsets is None else ' with offsets'}; it takes the padded layout "
            "[experts, slots, d], or the rows layout [rows, d] with offsets=plan.offsets "
            "(dispatch(..., layout='rows'))"
        )
    if offsets is not None and offsets.shape != (n,):
        raise ShardingError(
            f"swiglu_experts: offsets has shape {tuple(offsets.shape)}; it holds where each of "
            f"the {n} experts' rows end (plan.offsets)"
        )
    gate, up = _expert_mm(buffer, gate_up, offsets).chunk(2, dim=-1)
    return _expert_mm(activation(gate) * up, down, offsets)


def _expert_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """Each expert's rows of ``x`` times its ``w``ᵀ: a batched matmul over
    a padded buffer, or a grouped GEMM over the rows layout (a padded
    batched matmul where the grouped GEMM cannot run: see
    :func:`_grouped_fits`)."""
    if offsets is None:
        return torch.bmm(x, w.transpose(1, 2))
    if _grouped_fits(x, w):
        y = F.grouped_mm(x, w.transpose(1, 2), offs=offsets)
        if y.requires_grad:  # its backward needs the 16-byte rows (a broadcast grad has none)
            y.register_hook(torch.Tensor.contiguous)
        return y
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    expert = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), counts)
    within = torch.arange(x.shape[0], device=x.device) - (offsets.long() - counts)[expert]
    fullest = int(counts.max()) if counts.numel() else 0
    padded = x.new_zeros(w.shape[0], fullest, x.shape[1]).index_put((expert, within), x)
    return torch.bmm(padded, w.transpose(1, 2))[expert, within]


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs ``x [rows, d] @ w[e]ᵀ`` (``w``
    ``[experts, n, d]``): on CPU (its CUDA kernels have not run here yet),
    in fp32, bf16 or fp16, with every row of ``x``, of ``w`` and of the
    output starting at a multiple of 16 bytes, as it requires."""
    if not hasattr(F, "grouped_mm") or x.device.type != "cpu" or w.device != x.device:
        return False
    if x.dtype not in _GROUPED_DTYPES or w.dtype != x.dtype:
        return False
    align = 16 // x.element_size()
    strides = (x.stride(0), w.stride(0), w.stride(1), w.shape[1])
    return x.stride(1) == 1 and w.stride(2) == 1 and all(s % align == 0 for s in strides)
