"""ZeRO++'s qgZ (Wang et al., 2023): a gradient reduce-scatter whose data
crosses the network as blockwise int4, in two all-to-alls.

``quantized_psum_scatter(x, outer, inner)`` gives the rank at (``outer``
index ``n``, ``inner`` index ``l``) piece ``n·L + l`` of the sum of every
rank's ``x`` (``L`` the size of ``inner``) — the piece
``psum_scatter(x, (outer, inner), 0)`` gives it, in the same torch.chunk
sizes (uneven ones included) — up to quantization:

1. each rank quantizes its pieces grouped by the ``inner`` index they end
   at, and trades them with the other ranks of its node (an all-to-all over
   ``inner``);
2. each dequantizes what arrives and sums it with its own pieces in fp32:
   the node's partial sums of the ``N`` pieces (one per node) that end at
   its ``inner`` index;
3. it quantizes those partial sums and trades them with the ranks of the
   same ``inner`` index on the other nodes (an all-to-all over ``outer``);
4. it dequantizes what arrives and sums it with its own partial sum.

Only quantized bytes cross nodes: for int4, ``ceil(m / 2)`` bytes and one
fp32 scale per 256 elements for a piece of ``m`` elements — 0.53 bytes an
element where fp32 takes 4 (``bits=8``: int8, 1.02). What a rank keeps for
itself is never quantized (it does not travel), nor is anything over an
axis of size 1; each piece is quantized on its own, its blocks starting at
its first element. Sums run in member order, in fp32.

Both exchanges are :func:`~shardax.collectives.ragged_all_to_all` calls on
one ``uint8`` buffer each (every piece's packed values, then its scales),
so :func:`~shardax.collectives.traffic` counts them as
``("ragged_all_to_all", inner axes)`` and ``("ragged_all_to_all", outer
axes)``, at exactly the bytes sent. DeepSpeed's ``all_to_all_quant_reduce``
does the same with fused CUDA kernels, averages instead of summing, and
falls back to a plain reduce-scatter for lengths that do not divide.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import CollectiveError
from ..kernels._quant import (
    dequantize_int4,
    dequantize_int8,
    int4_bytes,
    quantize_int4,
    quantize_int8,
    scale_count,
)
from ..mesh._mesh import Mesh
from ._api import Axis, _resolve_mesh
from ._ops import chunk_sizes
from ._ragged import ragged_all_to_all

__all__ = ["quantized_psum_scatter", "wire_bytes"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def wire_bytes(m: int, bits: int = 4) -> int:
    """The bytes a piece of ``m`` elements travels as: its packed values
    (``bits`` each) and one fp32 scale per 256 elements; nothing for an
    empty piece.

    >>> wire_bytes(1024), wire_bytes(1024, bits=8), wire_bytes(5), wire_bytes(0)
    (528, 1040, 7, 0)
    """
    if m == 0:
        return 0
    return (int4_bytes(m) if bits == 4 else m) + 4 * scale_count(m)


def _encode(piece: torch.Tensor, into: torch.Tensor, bits: int) -> None:
    """``piece`` quantized into the ``uint8`` bytes ``into``: values, then scales."""
    m = piece.numel()
    if m == 0:
        return
    values = into[: wire_bytes(m, bits) - 4 * scale_count(m)]
    scales = torch.empty(scale_count(m), dtype=torch.float32, device=piece.device)
    if bits == 4:
        quantize_int4(piece, q=values, scales=scales)
    else:
        quantize_int8(piece, q=values.view(torch.int8), scales=scales)
    into[values.numel() :].copy_(scales.view(torch.uint8))


def _decode(data: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """``out`` (fp32) ← the piece :func:`_encode` wrote into ``data``."""
    m = out.numel()
    if m == 0:
        return
    cut = wire_bytes(m, bits) - 4 * scale_count(m)
    scales = data[cut:].clone().view(torch.float32)  # aligned for fp32
    if bits == 4:
        dequantize_int4(data[:cut], scales, out=out)
    else:
        dequantize_int8(data[:cut].view(torch.int8), scales, out=out)


def _exchange(
    pieces: Sequence[Sequence[torch.Tensor]],
    sizes: Sequence[Sequence[int]],
    me: int,
    axis: tuple[str, ...],
    mesh: Mesh,
    bits: int,
) -> torch.Tensor:
    """One quantized all-to-all and sum over ``axis``: ``pieces[j]`` (fp32
    or x's dtype) go to member ``j`` (none to this one, which keeps its
    own); every member sends this one pieces of ``sizes[me]``. Returns
    them, concatenated, summed over the members in member order (fp32)."""
    mine = sizes[me]
    payload = [sum(wire_bytes(m, bits) for m in s) for s in sizes]
    send_sizes = [0 if j == me else payload[j] for j in range(len(sizes))]
    recv_sizes = [0 if j == me else payload[me] for j in range(len(sizes))]
    send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=pieces[me][0].device)
    at = 0
    for j, group in enumerate(pieces):
        if j == me:
            continue
        for piece in group:
            n = wire_bytes(piece.numel(), bits)
            _encode(piece, send[at : at + n], bits)
            at += n
    got = ragged_all_to_all(send, axis, send_sizes, recv_sizes, mesh=mesh)
    total = torch.empty(sum(mine), dtype=torch.float32, device=send.device)
    part = torch.empty_like(total)
    at = 0
    for j in range(len(sizes)):
        if j == me:
            torch.cat([p.float() for p in pieces[me]], out=part)
        else:
            lo = 0
            for m in mine:
                n = wire_bytes(m, bits)
                _decode(got[at : at + n], part[lo : lo + m], bits)
                at, lo = at + n, lo + m
        if j == 0:
            total.copy_(part)
        else:
            total.add_(part)
    return total


def quantized_psum_scatter(
    x: torch.Tensor, outer: Axis, inner: Axis, *, bits: int = 4, mesh: Mesh | None = None
) -> torch.Tensor:
    """Sum ``x`` over the ranks along ``outer`` and ``inner`` and keep this
    rank's piece, as ``psum_scatter(x, (*outer, *inner), 0)`` does, moving
    blockwise int4 (``bits=8``: int8) in two all-to-alls: within each node
    (``inner``), then between nodes (``outer``) — ZeRO++'s qgZ (Wang et
    al., 2023; the module docstring gives the steps and the bytes).

    ``x`` is this rank's whole gradient contribution: a flat fp32, bf16 or
    fp16 tensor of the same length on every rank; the result is this rank's
    piece (torch.chunk sizes over the ``N·L`` ranks, piece ``n·L + l`` for
    the rank at ``outer`` index ``n`` and ``inner`` index ``l``), in
    ``x``'s dtype. Each contribution is off by at most half a quantization
    step, ``absmax / 14`` of its 256-element block for int4 (``/ 254`` for
    int8), at each of the two exchanges. Not differentiable: it reduces
    gradients.

    A rank whose length differs from the others' makes them expect other
    byte counts than it sends: :class:`~shardax.errors.CollectiveMismatchError`
    on every rank where the group checks its collectives (on CPU by
    default) — unless the counts happen to agree (int4 packs lengths ``2k - 1``
    and ``2k`` alike), so keep the lengths equal.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"node": 1, "local": 1})  # one rank: nothing moves
    >>> quantized_psum_scatter(torch.arange(6.0), "node", "local", mesh=mesh)
    tensor([0., 1., 2., 3., 4., 5.])
    """
    what = "quantized_psum_scatter"
    mesh = _resolve_mesh(mesh, what)
    outer_axes = mesh.check_axes(outer, what=f"{what}'s outer axes")
    inner_axes = mesh.check_axes(inner, what=f"{what}'s inner axes")
    if set(outer_axes) & set(inner_axes):
        raise CollectiveError(
            f"{what}: outer axes {outer_axes} and inner axes {inner_axes} share "
            f"{sorted(set(outer_axes) & set(inner_axes))}; name each axis of mesh {mesh!r} "
            "once: the axis across nodes as outer, the one within a node as inner"
        )
    if bits not in (4, 8):
        raise CollectiveError(f"{what}: bits={bits!r}; it quantizes to 4 or 8 bits")
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise CollectiveError(
            f"{what} over {(*outer_axes, *inner_axes)}: x is {got}; it reduces fp32, bf16 or "
            "fp16 gradients (cast with x.float())"
        )
    if x.dim() != 1:
        raise CollectiveError(
            f"{what} over {(*outer_axes, *inner_axes)}: x has shape {tuple(x.shape)}; it takes "
            "a flat tensor (pass x.reshape(-1), and reshape the piece it returns)"
        )
    if x.requires_grad and torch.is_grad_enabled():
        raise CollectiveError(
            f"{what}: x requires grad, and the quantized reduction is not differentiable; "
            "pass x.detach() (or call it under torch.no_grad())"
        )
    x = x.detach().contiguous()
    nodes, local = mesh.size(outer_axes), mesh.size(inner_axes)
    node, me = mesh.axis_index(outer_axes), mesh.axis_index(inner_axes)
    sizes = chunk_sizes(x.numel(), nodes * local)
    pieces = list(torch.split(x, sizes))  # piece k·L + j ends at node k, local index j
    # the pieces that end at local index j, one per node
    by_local = [[pieces[k * local + j] for k in range(nodes)] for j in range(local)]
    sizes_by_local = [[sizes[k * local + j] for k in range(nodes)] for j in range(local)]
    if local > 1:
        partial = _exchange(by_local, sizes_by_local, me, inner_axes, mesh, bits)
    else:
        partial = torch.cat([p.float() for p in by_local[0]])
    if nodes > 1:
        mine = list(torch.split(partial, sizes_by_local[me]))  # one per node
        sizes_by_node = [[m] for m in sizes_by_local[me]]
        total = _exchange([[p] for p in mine], sizes_by_node, node, outer_axes, mesh, bits)
    else:
        total = partial
    return total.to(x.dtype)
