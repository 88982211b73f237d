"""Ring attention: attention over a sequence split over a mesh axis, the
key/value blocks passed around the ring with ``ppermute`` (Liu et al., 2023,
"Ring Attention with Blockwise Transformers for Near-Infinite Context").

Each rank holds its piece of the sequence — queries, keys and values of the
same positions. In ``n`` steps every rank attends its queries to every
rank's keys and values: at each step it computes attention against the
block it holds while the block moves on to the next rank (the transfer of
the next block overlaps this block's compute), and merges the partial
results by their log-sum-exp (the online softmax of flash attention). The
backward is the same ring run again: each block's key/value gradients
travel with it around the ring and arrive, summed, back at the rank that
owns it. No rank ever holds more than two blocks: nothing of the whole
sequence exists anywhere.

Under a causal mask a plain split gives the last rank all the work (its
queries see every key) and the first almost none, so the sequence is split
*zigzag* (head–tail): cut into ``2n`` chunks, member ``i`` holds chunks
``i`` and ``2n-1-i``. Then at every step but the first each rank attends
exactly half a block — all its queries to the first half of a block from a
rank before it, or the second half of its queries to the whole block of a
rank after it — and every rank does the same work.

:class:`RingAttention` runs ``F.scaled_dot_product_attention`` calls this
way (a ``TorchFunctionMode``): ``rules.context_parallel`` installs it on the
attention modules, so a model that calls SDPA needs no rewrite.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs
import torch

from ..collectives import _api as C
from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, normalize_axes
from ._spec import zigzag_bounds

__all__ = ["Order", "local_positions", "ring_attention"]

Order = Literal["zigzag", "contiguous"]
_ORDERS = ("zigzag", "contiguous")


def local_positions(length: int, n: int, index: int, order: Order = "zigzag") -> torch.Tensor:
    """The global positions of member ``index``'s ``length`` tokens when a
    sequence is split over ``n`` members in ``order``: zigzag, chunks
    ``index`` and ``2n-1-index`` of ``2n``; contiguous, chunk ``index`` of
    ``n``.

    >>> local_positions(4, 2, 0).tolist(), local_positions(4, 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> local_positions(4, 2, 1, "contiguous").tolist()
    [4, 5, 6, 7]
    """
    if order not in _ORDERS:
        raise ShardingError(f"the order of a sequence split is one of {_ORDERS}; got {order!r}")
    if order == "contiguous":
        return torch.arange(index * length, (index + 1) * length)
    if length % 2:
        raise ShardingError(
            f"a zigzag piece holds two equal chunks; this rank holds {length} tokens, an odd "
            f"number: the sequence length must be a multiple of {2 * n} (2 x the {n} ranks)"
        )
    (a, b), (c, d) = zigzag_bounds(length * n, n, index)
    return torch.cat([torch.arange(a, b), torch.arange(c, d)])


# --- one block: attention of some queries to some keys, with its log-sum-exp ---


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` → ``[B, Hkv·groups, T, D]``, each key/value head
    repeated for its group of query heads (as Hugging Face's ``repeat_kv``)."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def _fold_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The transpose of :func:`_expand_heads`: each group's gradients summed."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x.view(b, h // groups, groups, t, d).sum(2)


def _bias(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A key mask ``[B, Tk]`` (True: attend) as an additive ``[B, 1, 1, Tk]`` bias."""
    if allowed is None:
        return None
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, float("-inf"))[:, None, None, :]


def _empty_rows(allowed: torch.Tensor | None, tq: int, causal: bool) -> torch.Tensor | None:
    """``[B, Tq]``: the query rows of a block with no key to attend (their
    kernel output is 0 and their log-sum-exp must be -inf), or None."""
    if allowed is None:
        return None
    if causal:  # row i sees keys 0..i
        return allowed.cumsum(-1)[:, :tq] == 0
    return (~allowed.any(-1, keepdim=True)).expand(-1, tq)


def _forward_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    allowed: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` ``[B, H, Tq, D]`` attending to ``k``/``v``
    (already expanded to ``H`` heads); ``lse`` ``[B, H, Tq]`` in fp32,
    -inf on rows that attend to nothing."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(allowed, q.dtype), scale=scale
        )
        lse = lse.to(_acc(q.dtype))
    else:
        out, lse = _math_forward(q, k, v, causal, allowed, scale)
    empty = _empty_rows(allowed, q.shape[2], causal)
    if empty is not None:
        lse = lse.masked_fill(empty[:, None, :], float("-inf"))
    return out, lse


def _backward_block(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    allowed: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the *whole* attention's ``out``
    and ``lse`` of these queries (+inf on rows that attend to nothing
    anywhere: their probabilities are 0)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(allowed, q.dtype), scale=scale
        )
    return _math_backward(dout, q, k, v, out, lse, causal, allowed, scale)


def _scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, allowed: torch.Tensor | None, scale: float
) -> torch.Tensor:
    acc = _acc(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if causal:
        tq, tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None, None, :], -math.inf)
    return s


def _math_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    allowed: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block in plain matmuls (devices without a kernel that returns the
    log-sum-exp; and the reference the kernel is tested against)."""
    s = _scores(q, k, causal, allowed, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])
    return torch.matmul(p, v.to(s.dtype)).to(q.dtype), lse


def _math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    allowed: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = _scores(q, k, causal, allowed, scale)
    p = torch.exp(s - lse[..., None])  # the whole row's probabilities, restricted to this block
    acc = s.dtype
    do = dout.to(acc)
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.to(acc).transpose(-2, -1))
    ds = p * (dp - (do * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results merge in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- the ring ---


@attrs.frozen
class _Work:
    """One piece of a step's attention: rows ``q`` of this rank's queries
    against columns ``k`` of the block held, causal (the diagonal) or full."""

    q: slice
    k: slice
    causal: bool


def _steps(n: int, me: int, t: int, order: Order, causal: bool) -> list[list[_Work]]:
    """For each step (holding the block of member ``me - step``), the work:
    what this rank's ``t`` queries attend to in that block."""
    whole, first, second = slice(0, t), slice(0, t // 2), slice(t // 2, t)
    out: list[list[_Work]] = []
    for step in range(n):
        src = (me - step) % n
        if not causal:
            out.append([_Work(whole, whole, False)])
        elif src == me:
            out.append([_Work(whole, whole, True)])  # positions increase along the piece
        elif order == "contiguous":
            out.append([_Work(whole, whole, False)] if src < me else [])
        elif src < me:  # both chunks come after the block's first chunk, before its second
            out.append([_Work(whole, first, False)])
        else:  # only this rank's second chunk comes after the block (both its chunks)
            out.append([_Work(second, whole, False)])
    return out


def _merge(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """``out``/``lse`` (fp32) ← the softmax-weighted union with a partial
    result over other keys, in place; rows empty in both stay 0 / -inf."""
    new = torch.logaddexp(lse, part_lse)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    keep = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new))
    take = torch.where(finite, torch.exp(part_lse - safe), torch.zeros_like(new))
    out.mul_(keep[..., None]).add_(part.to(out.dtype) * take[..., None])
    lse.copy_(new)


class _Packed:
    """Keys, values and the key mask of one block in one flat buffer, so
    one ``ppermute`` moves the block."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> None:
        self.k_shape, self.v_shape = k.shape, v.shape
        self.dtype, self.masked = k.dtype, allowed is not None
        self.mask_shape = None if allowed is None else allowed.shape
        parts = [k.reshape(-1), v.reshape(-1)]
        if allowed is not None:
            parts.append(allowed.reshape(-1).to(k.dtype))
        self.buffer = torch.cat(parts)

    def unpack(
        self, buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        nk, nv = math.prod(self.k_shape), math.prod(self.v_shape)
        k = buffer[:nk].view(self.k_shape)
        v = buffer[nk : nk + nv].view(self.v_shape)
        allowed = buffer[nk + nv :].view(self.mask_shape) > 0.5 if self.masked else None
        return k, v, allowed


def _turns(step: int, buffers: int) -> tuple[int, int]:
    """Which of the backward's gradient buffers takes this step's
    contributions, and which receives the sum the previous rank sends on:
    neither is the one still being sent from the step before (three buffers
    going round: 0, 2, 1, 0, ...; one rank needs one)."""
    if buffers == 1:
        return 0, 0
    mine = -step % 3
    return mine, (mine + 1) % 3


def _ring(n: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)]


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor | None,
        ring: _Ring,
    ) -> torch.Tensor:
        n = ring.size
        groups = q.shape[1] // k.shape[1]
        packed = _Packed(k, v, allowed)
        held, spare = packed.buffer, torch.empty_like(packed.buffer)
        acc = _acc(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
        for step, work in enumerate(ring.work):
            moving = ring.permute(held, spare) if step < n - 1 else None
            kb, vb, mb = packed.unpack(held)
            kb, vb = _expand_heads(kb, groups), _expand_heads(vb, groups)
            for w in work:
                part, part_lse = _forward_block(
                    q[:, :, w.q], kb[:, :, w.k], vb[:, :, w.k], w.causal,
                    None if mb is None else mb[:, w.k], ring.scale,
                )  # fmt: skip
                _merge(out[:, :, w.q], lse[:, :, w.q], part, part_lse)
            if moving is not None:
                moving.wait()
                held, spare = spare, held
        result = out.to(q.dtype)
        ctx.ring, ctx.groups = ring, groups
        ctx.save_for_backward(q, k, v, allowed, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, allowed, out, lse = ctx.saved_tensors
        ring, groups = ctx.ring, ctx.groups
        n = ring.size
        lse = lse.masked_fill(lse == -math.inf, math.inf)  # rows that attend to nothing: p = 0
        dout = dout.contiguous()
        packed = _Packed(k, v, allowed)
        held, spare = packed.buffer, torch.empty_like(packed.buffer)
        acc = _acc(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # A block's key/value gradients, flat (dk then dv), in three buffers
        # taking turns: at each step one takes this rank's contributions
        # while the previous step's sum is still being sent from the second
        # and the one before it arrives in the third (_turns).
        nk = k.numel()
        grads = [torch.empty(2 * nk, dtype=acc, device=q.device) for _ in range(3 if n > 1 else 1)]
        wide = (  # the block's gradients over the query heads, folded into the flat buffer
            None
            if groups == 1
            else torch.empty((2, *q.shape[:2], *k.shape[2:]), dtype=acc, device=q.device)
        )
        in_flight = None
        for step, work in enumerate(ring.work):
            moving = ring.permute(held, spare) if step < n - 1 else None
            kb, vb, mb = packed.unpack(held)
            kb, vb = _expand_heads(kb, groups), _expand_heads(vb, groups)
            mine, arriving = _turns(step, len(grads))
            flat = grads[mine].zero_()
            dk, dv = (wide.zero_() if wide is not None else flat.view(2, *k.shape)).unbind(0)
            for w in work:
                gq, gk, gv = _backward_block(
                    dout[:, :, w.q], q[:, :, w.q], kb[:, :, w.k], vb[:, :, w.k],
                    out[:, :, w.q], lse[:, :, w.q], w.causal,
                    None if mb is None else mb[:, w.k], ring.scale,
                )  # fmt: skip
                dq[:, :, w.q] += gq
                dk[:, :, w.k] += gk
                dv[:, :, w.k] += gv
            if wide is not None:
                flat.view(2, *k.shape).copy_(
                    _fold_heads(wide.flatten(0, 1), groups).view(2, *k.shape)
                )
            if in_flight is not None:  # the block's gradients from the ranks before
                flat += in_flight.wait()
            if n > 1:  # on with its block
                in_flight = ring.permute(flat, grads[arriving])
            if moving is not None:
                moving.wait()
                held, spare = spare, held
        total = in_flight.wait() if n > 1 else flat  # this rank's own block, summed
        dk_own = total[:nk].view(k.shape).to(k.dtype)
        dv_own = total[nk:].view(v.shape).to(v.dtype)
        return dq.to(q.dtype), dk_own, dv_own, None, None


@attrs.frozen
class _Ring:
    """One call's ring: the axis on the mesh, this rank's place, the work of
    each step, the softmax scale."""

    axis: tuple[str, ...]
    mesh: Any = attrs.field(eq=False)
    size: int
    index: int
    work: tuple[tuple[_Work, ...], ...]
    scale: float

    def permute(self, x: torch.Tensor, into: torch.Tensor) -> Any:
        """Send ``x`` to the next member, receive the previous one's into ``into``."""
        if self.size == 1:
            raise ShardingError("internal: a ring of one member moves nothing")
        with torch.no_grad():
            return C.ppermute(
                x, self.axis, _ring(self.size), mesh=self.mesh, out=into, async_op=True
            )


def _axis_place(axis: tuple[str, ...], mesh: Any) -> tuple[int, int]:
    """``(size, index)`` of this rank along ``axis``."""
    size = mesh.size(axis)
    if size == 1:
        return 1, 0
    return size, C.axis_index(axis, mesh=mesh)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str | tuple[str, ...] = "cp",
    *,
    mesh: AbstractMesh,
    order: Order = "zigzag",
    is_causal: bool = True,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries to the keys and values of the
    whole sequence, which is split over ``axis`` in ``order``
    (:func:`shardax.zigzag` for a causal mask, or contiguous chunks).

    ``q`` ``[B, H, T, D]``, ``k``/``v`` ``[B, Hkv, T, D]`` (grouped-query
    attention: ``H`` a multiple of ``Hkv``; the blocks travel with ``Hkv``
    heads) are this rank's piece — ``T`` tokens, the same number on every
    rank. ``key_mask`` ``[B, T]``: True where a key may be attended (a
    padding mask, this rank's piece of it). A query that may attend to no
    key gets zeros and no gradient. Differentiable; ``n - 1`` transfers of
    a block each way, each overlapped with a block's compute.

    >>> import torch, shardax as sx
    >>> q, k, v = torch.randn(3, 1, 2, 4, 8).unbind(0)
    >>> out = ring_attention(q, k, v, "cp", mesh=sx.Mesh({"cp": 1}))
    >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    True
    """
    axes = normalize_axes(axis)
    if order not in _ORDERS:
        raise ShardingError(f"ring_attention: order is one of {_ORDERS}; got {order!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ShardingError(
            f"ring_attention takes q, k, v as [batch, heads, sequence, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, h, t, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise ShardingError(
            f"ring_attention: k and v are [batch, kv_heads, sequence, head_dim] of q's batch, "
            f"sequence piece and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)} (keys of another length than the queries — a KV cache — are "
            "not split over the ring: decode without context parallelism)"
        )
    if h % k.shape[1]:
        raise ShardingError(
            f"ring_attention: {h} query heads do not group over {k.shape[1]} key/value heads"
        )
    if key_mask is not None and (key_mask.shape != (b, t) or key_mask.dtype != torch.bool):
        raise ShardingError(
            f"ring_attention: key_mask is a bool [batch, sequence] = ({b}, {t}) tensor (True: "
            f"attend); got {key_mask.dtype} {tuple(key_mask.shape)}"
        )
    size, index = _axis_place(axes, mesh)
    if is_causal and order == "zigzag" and t % 2:
        raise ShardingError(
            f"ring_attention over {axes!r}: a zigzag piece is two equal chunks, and this rank "
            f"holds {t} tokens; use sequences whose length is a multiple of {2 * size}"
        )
    scale = d**-0.5 if scale is None else float(scale)
    work = tuple(tuple(w) for w in _steps(size, index, t, order, is_causal))
    ring = _Ring(axes, mesh, size, index, work, scale)
    return _RingFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), key_mask, ring)
