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
owns it. No rank ever holds more than three blocks (its own, kept for the
backward, and two passing through): nothing of the whole sequence exists
anywhere.

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
from collections.abc import Sequence
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
    out: torch.Tensor,
    lse: torch.Tensor,
    part: torch.Tensor,
    part_lse: torch.Tensor,
    first: bool,
) -> None:
    """``out``/``lse`` (fp32) ← the softmax-weighted union with a partial
    result over other keys, in place; rows empty in both stay 0 / -inf.
    ``first``: nothing is there yet (the part is copied; a kernel's output
    is 0 on rows with no key)."""
    if first:
        out.copy_(part)
        lse.copy_(part_lse)
        return
    # the part's share of the union, exp(part_lse) / (exp(lse) + exp(part_lse));
    # 0 on rows empty in both (-inf - -inf: NaN), where the part is 0 too
    take = torch.sigmoid(part_lse - lse).nan_to_num_(0.0)
    out.lerp_(part.to(out.dtype), take[..., None])
    torch.logaddexp(lse, part_lse, out=lse)


def _token_major(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized ``[B, H, T, D]`` tensor laid out ``[B, T, H, D]`` in
    memory, as a projection makes queries, keys and values, the CPU kernel
    returns its gradients, and the model's ``transpose(1, 2)`` + reshape
    back to ``[B, T, H·D]`` reads without a copy."""
    b, h, t, d = shape
    return torch.empty(b, t, h, d, dtype=dtype, device=device).transpose(1, 2)


def _own(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy where ``x`` is a view of a larger buffer (a slice of
    a fused projection's output): what is saved for the backward must not
    keep the rest of that buffer alive."""
    if x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size():
        return x
    return _token_major(x.shape, x.dtype, x.device).copy_(x)


class _Blocks:
    """Where the keys, values and key mask of one block lie in one flat
    buffer, so one ``ppermute`` moves the block: keys then values,
    ``[B, Hkv, T, D]`` each laid out ``[B, T, Hkv, D]``, then the mask as
    0/1 in their dtype. The flat buffers of a block's key/value gradients
    (in the accumulation dtype) take the same layout, without the mask."""

    def __init__(self, k_shape: torch.Size, masked: bool) -> None:
        self.k_shape, self.masked = k_shape, masked
        self.nk = math.prod(k_shape)

    def pack(self, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """A new buffer holding ``k``, ``v`` and ``allowed`` (one copy each)."""
        b, _, t, _ = self.k_shape
        buffer = torch.empty(
            2 * self.nk + (b * t if self.masked else 0), dtype=k.dtype, device=k.device
        )
        kb, vb = self.kv(buffer)
        kb.copy_(k)
        vb.copy_(v)
        if allowed is not None:
            buffer[2 * self.nk :].copy_(allowed.reshape(-1))
        return buffer

    def kv(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values (or their gradients) in ``buffer``, ``[B, Hkv, T, D]`` views."""
        b, h, t, d = self.k_shape
        pair = buffer[: 2 * self.nk].view(2, b, t, h, d).transpose(2, 3)
        return pair[0], pair[1]

    def unpack(
        self, buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k, v = self.kv(buffer)
        if not self.masked:
            return k, v, None
        b, _, t, _ = self.k_shape
        return k, v, buffer[2 * self.nk :].view(b, t) > 0.5


def _receiver(step: int, spares: list[torch.Tensor]) -> torch.Tensor:
    """The spare block buffer that receives at ``step``: never the rank's
    own block (saved for the backward), nor the one sent at the step before
    (two spares taking turns; a ring of two needs one)."""
    return spares[step % len(spares)]


def _ring(n: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)]


def _attend(
    q: torch.Tensor,
    held: torch.Tensor,
    blocks: _Blocks,
    groups: int,
    work: Sequence[_Work],
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    first: bool,
) -> None:
    """One forward step: ``q``'s work against the block in ``held``,
    merged into ``out``/``lse`` (``first``: the own block, every query)."""
    kb, vb, mb = blocks.unpack(held)
    kb, vb = _expand_heads(kb, groups), _expand_heads(vb, groups)
    for w in work:
        part, part_lse = _forward_block(
            q[:, :, w.q], kb[:, :, w.k], vb[:, :, w.k], w.causal,
            None if mb is None else mb[:, w.k], scale,
        )  # fmt: skip
        _merge(out[:, :, w.q], lse[:, :, w.q], part, part_lse, first)


def _grads(
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    held: torch.Tensor,
    blocks: _Blocks,
    groups: int,
    work: Sequence[_Work],
    scale: float,
    dq: torch.Tensor,
    first: bool,
) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """One backward step: the query gradients of ``work`` against the block
    in ``held`` added to ``dq`` (``first``: the own block, copied in), and
    the block's key/value gradients (``[B, Hkv, ·, D]``) by key range."""
    kb, vb, mb = blocks.unpack(held)
    kb, vb = _expand_heads(kb, groups), _expand_heads(vb, groups)
    parts = []
    for w in work:
        gq, gk, gv = _backward_block(
            dout[:, :, w.q], q[:, :, w.q], kb[:, :, w.k], vb[:, :, w.k],
            out[:, :, w.q], lse[:, :, w.q], w.causal,
            None if mb is None else mb[:, w.k], scale,
        )  # fmt: skip
        if first:
            dq.copy_(gq)
        else:
            dq[:, :, w.q] += gq
        parts.append((w.k, _fold_heads(gk, groups), _fold_heads(gv, groups)))
    return parts


def _accumulate(
    into: tuple[torch.Tensor, torch.Tensor],
    parts: list[tuple[slice, torch.Tensor, torch.Tensor]],
    first: bool,
) -> None:
    """A block's key/value gradients ``into`` += this rank's ``parts``
    (``first``: the own block's, which cover every key, copied in)."""
    tk, tv = into
    for keys, gk, gv in parts:
        if first:
            tk.copy_(gk)
            tv.copy_(gv)
        else:
            tk[:, :, keys] += gk
            tv[:, :, keys] += gv


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
        blocks = _Blocks(k.shape, allowed is not None)
        own = blocks.pack(k, v, allowed)
        spares = [torch.empty_like(own) for _ in range(min(n - 1, 2))]
        q = _own(q)
        acc = _acc(q.dtype)
        out = _token_major(q.shape, acc, q.device)  # step 0 (the rank's own block) fills it
        lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
        held = own
        for step, work in enumerate(ring.work):
            into = _receiver(step, spares) if step < n - 1 else None
            moving = ring.permute(held, into) if into is not None else None
            _attend(q, held, blocks, groups, work, ring.scale, out, lse, first=step == 0)
            if moving is not None:
                moving.wait()
                held = into
        result = out.to(q.dtype)
        ctx.ring, ctx.groups, ctx.blocks = ring, groups, blocks
        ctx.save_for_backward(q, own, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, own, out, lse = ctx.saved_tensors
        ring, groups, blocks = ctx.ring, ctx.groups, ctx.blocks
        n = ring.size
        lse = lse.masked_fill(lse == -math.inf, math.inf)  # rows that attend to nothing: p = 0
        spares = [torch.empty_like(own) for _ in range(min(n - 1, 2))]
        acc = _acc(q.dtype)
        dq = _token_major(q.shape, acc, q.device)  # step 0 (the rank's own block) fills it
        # A block's key/value gradients, flat, in two buffers taking turns: the
        # sum from the ranks before arrives in one while the other, summed
        # with this rank's part, is sent on.
        grads = [torch.empty(2 * blocks.nk, dtype=acc, device=q.device) for _ in range(min(n, 2))]
        held, in_flight, total = own, None, grads[0]
        for step, work in enumerate(ring.work):
            into = _receiver(step, spares) if step < n - 1 else None
            moving = ring.permute(held, into) if into is not None else None
            parts = _grads(dout, q, out, lse, held, blocks, groups, work, ring.scale, dq, step == 0)
            # the block's gradients: this rank's part, plus the sum of the ranks'
            # before it (arriving meanwhile; at step 0 there are none)
            total = grads[0] if in_flight is None else in_flight.wait()
            _accumulate(blocks.kv(total), parts, first=step == 0)
            parts = []
            if n > 1:  # on with its block
                in_flight = ring.permute(total, grads[(step + 1) % 2])
            if moving is not None:
                moving.wait()
                held = into
        if in_flight is not None:  # this rank's own block, summed over every rank
            total = in_flight.wait()
        dk, dv = blocks.kv(total)
        return dq.to(q.dtype), dk.to(own.dtype), dv.to(own.dtype), None, None


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
    return _RingFunction.apply(q, k, v, key_mask, ring)
