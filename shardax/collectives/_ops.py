"""Collective ops as values, and their autograd transposes as one table.

Each op is a frozen description of one collective over a :class:`Group` with
every size it needs (uneven pieces included). ``op.start(x)`` issues it and
returns a :class:`Handle`; ``transpose(op)`` is the op that backward runs.

The gradient convention: a rank's backward computes contributions whose sum
over the ranks is the gradient of the global objective. Under it each op's
backward is the linear transpose of its forward on the local tensors:

================  ==================================================
forward           transpose
================  ==================================================
psum              psum
pmean             pmean
all_gather        psum_scatter (same pieces)
psum_scatter      all_gather (same pieces)
all_to_all        all_to_all with split and concat dims swapped
ragged_all_to_all ragged_all_to_all with send and receive sizes swapped
ppermute          ppermute with the inverse permutation
broadcast(root)   reduce(root): psum, kept on ``root`` only
reduce(root)      broadcast(root)
slice (my piece)  pad (my piece in zeros)
pad               slice
mask (index 0)    mask
redistribute      the redistribution back, adding (``shard/``)
================  ==================================================

``pmax``/``pmin`` are not linear: their backward (to the ranks holding the
extremum, ties split) is written out in ``_api``; ``count_once`` (identity
forward, mask backward) is the one op that changes how a cotangent is
represented rather than transposing a map.

In layout terms the cotangent of a replicated value is partial and the
cotangent of a partial value is replicated, so a transfer's backward is the
transfer between the dual layouts — which is why a replicated loss must be
seeded on one rank (or scaled), never summed over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch

from ..errors import CollectiveError
from ..mesh._groups import Group
from ._backend import Handle, comm_of, start

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Broadcast",
    "Mask",
    "Op",
    "Pad",
    "Permute",
    "Reduce",
    "ReduceScatter",
    "Slice",
    "chunk_sizes",
    "transpose",
]


def chunk_sizes(length: int, n: int) -> tuple[int, ...]:
    """torch.chunk semantics, always ``n`` pieces: ceil-sized, later ones may be
    smaller or empty.

    >>> chunk_sizes(10, 4), chunk_sizes(5, 4), chunk_sizes(2, 4), chunk_sizes(0, 2)
    ((3, 3, 3, 1), (2, 2, 1, 0), (1, 1, 0, 0), (0, 0))
    """
    c = -(-length // n) if length else 0
    return tuple(max(0, min(c, length - i * c)) for i in range(n))


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _check_len(op: str, group: Group, x: torch.Tensor, dim: int, expected: int) -> None:
    if x.size(dim) != expected:
        raise CollectiveError(
            f"{op} over {group.label}: rank {group.rank} has length {x.size(dim)} along dim {dim} "
            f"of its input {tuple(x.shape)}, expected {expected}"
        )


@attrs.frozen
class Op:
    """A collective over ``group``; subclasses say what it does."""

    group: Group = attrs.field(eq=False)
    name: ClassVar[str] = "op"

    def start(self, x: torch.Tensor) -> Handle:
        raise NotImplementedError

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.start(x).wait()


@attrs.frozen
class AllReduce(Op):
    reduce: str = "sum"  # sum | mean | max | min
    out: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    name: ClassVar[str] = "psum"

    def start(self, x: torch.Tensor) -> Handle:
        name = {"sum": "psum", "mean": "pmean", "max": "pmax", "min": "pmin"}[self.reduce]
        if self.reduce == "mean" and not (x.is_floating_point() or x.is_complex()):
            raise CollectiveError(
                f"pmean over {self.group.label} needs a floating dtype, got {x.dtype}"
            )
        if self.out is not None:
            _check_out(name, self.group, x, self.out)
        if self.group.size == 1:
            if self.out is None or self.out is x:
                return Handle.ready(x)
            return Handle.ready(self.out.copy_(x))
        src = x.detach()
        src = src if src.is_contiguous() else src.contiguous()
        buf = torch.empty_like(src) if self.out is None else self.out
        op = "sum" if self.reduce == "mean" else self.reduce
        n = self.group.size

        def finish() -> torch.Tensor:
            return buf.div_(n) if self.reduce == "mean" else buf

        return start(self.group, name, lambda b: b.all_reduce_out(buf, src, op, self.group), finish)


def _check_out(
    what: str,
    group: Group,
    x: torch.Tensor,
    out: torch.Tensor,
    shape: Sequence[int] | None = None,
) -> None:
    """``out`` can take ``what``'s result of ``x`` in place of a new tensor,
    else a :class:`CollectiveError` naming the op, the axes and the shape,
    dtype and device the result needs.

    ``shape``: the result's; None for an op whose result is shaped like
    ``x`` and that reads ``x`` before it writes — then ``out=x`` works in
    place. Otherwise ``out`` may share no memory with ``x``, which the op
    still reads while it writes ``out``.
    """
    want = tuple(x.shape) if shape is None else tuple(shape)
    in_place = shape is None
    problem = None
    if tuple(out.shape) != want or out.dtype != x.dtype or out.device != x.device:
        problem = (
            f"out is {out.dtype} {tuple(out.shape)} on {out.device}, the result is {x.dtype} "
            f"{want} on {x.device}; they must match (x.new_empty({want}) makes one)"
        )
    elif not out.is_contiguous():
        problem = (
            f"out ({tuple(out.shape)}, strides {out.stride()}) is not contiguous; pass a "
            f"contiguous tensor of the result's shape {want} (x.new_empty({want}) makes one)"
        )
    elif torch.is_grad_enabled() and (x.requires_grad or out.requires_grad):
        problem = "out= is not differentiable: x (or out) requires grad; drop out= under autograd"
    elif _shares_memory(out, x) and not (in_place and out is x):
        problem = (
            "out shares memory with x without being x; pass out=x for in place"
            if in_place
            else f"out shares memory with x, which {what} reads while it writes out; pass a "
            "separate buffer"
        )
    if problem is not None:
        raise CollectiveError(f"{what}(out=) over {group.label}: {problem}")


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (empty tensors never are)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _flat_prefix(x: torch.Tensor, dim: int) -> bool:
    """Whether the dims before ``dim`` are all 1: a contiguous tensor is then
    laid out as its ``movedim(dim, 0)`` is, so a backend's dim-0 buffer can be
    a view of it."""
    return math.prod(x.shape[:dim]) == 1


def _out_shape(x: torch.Tensor, dim: int, length: int) -> tuple[int, ...]:
    shape = list(x.shape)
    shape[dim] = length
    return tuple(shape)


@attrs.frozen
class AllGather(Op):
    """Concatenate every member's piece along ``dim``; ``sizes[i]`` is member
    ``i``'s length along ``dim``. With ``out``, into ``out``: straight from
    the backend when the pieces are even and the dims before ``dim`` are 1
    (dim 0 of a flat buffer), else through a buffer of the backend's layout."""

    dim: int
    sizes: tuple[int, ...]
    out: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    name: ClassVar[str] = "all_gather"

    def start(self, x: torch.Tensor) -> Handle:
        g, n, dest = self.group, self.group.size, self.out
        _check_len("all_gather", g, x, self.dim, self.sizes[g.index])
        if dest is not None:
            _check_out("all_gather", g, x, dest, _out_shape(x, self.dim, sum(self.sizes)))
        if n == 1:
            return Handle.ready(x if dest is None else dest.copy_(x))
        m = max(self.sizes)
        xt = x.detach().movedim(self.dim, 0)
        if xt.size(0) < m:
            xt = torch.cat([xt, xt.new_zeros((m - xt.size(0), *xt.shape[1:]))])
        buf = xt.contiguous()
        even = all(s == m for s in self.sizes)
        direct = dest is not None and even and _flat_prefix(x, self.dim)
        shape = (n * m, *buf.shape[1:])
        out = dest.view(shape) if direct else buf.new_empty(shape)

        def finish() -> torch.Tensor:
            if direct:
                return dest
            rows = out.view(n, m, *buf.shape[1:])
            if dest is not None:
                for i, (o, s) in enumerate(zip(_offsets(self.sizes), self.sizes, strict=True)):
                    dest.narrow(self.dim, o, s).copy_(rows[i, :s].movedim(0, self.dim))
                return dest
            full = out if even else torch.cat([rows[i, : self.sizes[i]] for i in range(n)])
            return full.movedim(0, self.dim)

        return start(g, "all_gather", lambda b: b.all_gather(out, buf, g), finish)


@attrs.frozen
class ReduceScatter(Op):
    """Sum over members, then keep piece ``index`` of ``dim`` (pieces
    ``sizes``). With ``out``, into ``out``: straight from the backend when
    this member's piece is a longest one and the dims before ``dim`` are 1,
    else through a buffer of the backend's layout."""

    dim: int
    sizes: tuple[int, ...]
    out: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    name: ClassVar[str] = "psum_scatter"

    def start(self, x: torch.Tensor) -> Handle:
        g, n, dest = self.group, self.group.size, self.out
        _check_len("psum_scatter", g, x, self.dim, sum(self.sizes))
        mine = self.sizes[g.index]
        if dest is not None:
            _check_out("psum_scatter", g, x, dest, _out_shape(x, self.dim, mine))
        if n == 1:
            return Handle.ready(x if dest is None else dest.copy_(x))
        m = max(self.sizes)
        xt = x.detach().movedim(self.dim, 0)
        if all(s == m for s in self.sizes):
            buf = xt.contiguous().view(n, m, *xt.shape[1:])
        else:
            buf = xt.new_zeros((n, m, *xt.shape[1:]))
            for i, (o, s) in enumerate(zip(_offsets(self.sizes), self.sizes, strict=True)):
                buf[i, :s] = xt[o : o + s]
        # Every member's backend output has m rows; this one's piece may have fewer.
        direct = dest is not None and mine == m and _flat_prefix(x, self.dim)
        out = dest.view(buf.shape[1:]) if direct else buf.new_empty(buf.shape[1:])

        def finish() -> torch.Tensor:
            if direct:
                return dest
            piece = out[:mine].movedim(0, self.dim)
            return piece if dest is None else dest.copy_(piece)

        return start(g, "psum_scatter", lambda b: b.reduce_scatter(out, buf, g), finish)


@attrs.frozen
class AllToAll(Op):
    """Split ``split_dim`` into pieces ``split_sizes`` and send piece ``j`` to
    member ``j``; concatenate what arrives along ``concat_dim``, where member
    ``j``'s piece has length ``concat_sizes[j]``."""

    split_dim: int
    concat_dim: int
    split_sizes: tuple[int, ...]
    concat_sizes: tuple[int, ...]
    out: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    name: ClassVar[str] = "all_to_all"

    def start(self, x: torch.Tensor) -> Handle:
        g, n, dest = self.group, self.group.size, self.out
        if self.split_dim == self.concat_dim:
            raise CollectiveError(
                f"all_to_all over {g.label}: split_dim and concat_dim must differ (both {self.split_dim})"
            )
        _check_len("all_to_all", g, x, self.split_dim, sum(self.split_sizes))
        _check_len("all_to_all", g, x, self.concat_dim, self.concat_sizes[g.index])
        if dest is not None:
            shape = list(x.shape)
            shape[self.split_dim] = self.split_sizes[g.index]
            shape[self.concat_dim] = sum(self.concat_sizes)
            _check_out("all_to_all", g, x, dest, shape)
        if n == 1:
            return Handle.ready(x if dest is None else dest.copy_(x))
        # Split dim first: the pieces are contiguous runs of one buffer (no copy
        # at all when split_dim is 0 and x is contiguous).
        xs = x.detach().movedim(self.split_dim, 0)
        send = xs.contiguous().view(-1)
        rest = list(xs.shape[1:])
        cd = self.concat_dim - (self.concat_dim > self.split_dim)  # concat dim within rest
        row = math.prod(rest[:cd] + rest[cd + 1 :])  # elements per unit of concat dim
        in_splits = [s * math.prod(rest) for s in self.split_sizes]
        mine = self.split_sizes[g.index]
        shapes = [[mine, *rest[:cd], c, *rest[cd + 1 :]] for c in self.concat_sizes]
        out_splits = [mine * row * c for c in self.concat_sizes]
        in_order = math.prod([mine, *rest[:cd]]) == 1  # the pieces already lie in concat order
        # received straight into ``out=`` where its memory is that order (and
        # it is not the buffer being sent)
        direct = (
            dest is not None
            and in_order
            and dest.is_contiguous()
            and dest.untyped_storage().data_ptr() != send.untyped_storage().data_ptr()
        )
        out = dest.view(-1) if direct else send.new_empty(sum(out_splits))

        def finish() -> torch.Tensor:
            if direct:
                return dest  # type: ignore[return-value]
            if in_order:
                whole = [mine, *rest[:cd], sum(self.concat_sizes), *rest[cd + 1 :]]
                result = out.view(whole).movedim(0, self.split_dim)
                return result if dest is None else dest.copy_(result)
            parts = torch.split(out, out_splits)
            blocks = [p.view(s) for p, s in zip(parts, shapes, strict=True)]
            if dest is not None:  # concatenated straight into it
                torch.cat(blocks, dim=1 + cd, out=dest.movedim(self.split_dim, 0))
                return dest
            return torch.cat(blocks, dim=1 + cd).movedim(0, self.split_dim)

        return start(
            g, "all_to_all", lambda b: b.all_to_all(out, send, out_splits, in_splits, g), finish
        )


@attrs.frozen
class Permute(Op):
    """Member ``src`` sends to member ``dst`` for each ``(src, dst)`` pair;
    members that receive nothing get zeros. With ``out``, received into
    ``out``."""

    perm: tuple[tuple[int, int], ...]
    out: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    name: ClassVar[str] = "ppermute"

    def __attrs_post_init__(self) -> None:
        n = self.group.size
        srcs = [s for s, _ in self.perm]
        dsts = [d for _, d in self.perm]
        bad = [p for p in self.perm if not (0 <= p[0] < n and 0 <= p[1] < n)]
        if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
            raise CollectiveError(
                f"ppermute over {self.group.label}: perm {list(self.perm)} must be (src, dst) pairs "
                f"of member indices in 0..{n - 1}, each source and each destination at most once"
            )

    def start(self, x: torch.Tensor) -> Handle:
        g, dest = self.group, self.out
        me = g.index
        if dest is not None:  # it receives while x is sent: not x, even at one member
            _check_out("ppermute", g, x, dest, tuple(x.shape))
        if dest is None:
            out = torch.empty_like(x.detach(), memory_format=torch.contiguous_format)
        else:
            out = dest
        source = next((s for s, d in self.perm if d == me), None)  # the whole of out, or none
        if source is None:
            out.zero_()
        elif source == me:
            out.copy_(x.detach())
        sends = [(d, x.detach().contiguous()) for s, d in self.perm if s == me and d != me]
        recvs = [(s, out) for s, d in self.perm if d == me and s != me]
        if not sends and not recvs:
            if g.state is not None:
                comm_of(g).seq += 1  # keep collective numbers in step across the group
            return Handle.ready(out)
        return start(g, "ppermute", lambda b: b.send_recv(sends, recvs, g), lambda: out)


@attrs.frozen
class Broadcast(Op):
    """Every member gets member ``root``'s tensor."""

    root: int = 0
    out: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    name: ClassVar[str] = "broadcast"

    def start(self, x: torch.Tensor) -> Handle:
        g, dest = self.group, self.out
        if dest is not None:
            _check_out("broadcast", g, x, dest)  # out=x: in place
        if g.size == 1:
            return Handle.ready(x if dest is None or dest is x else dest.copy_(x))
        if dest is None:
            buf = torch.empty_like(x.detach(), memory_format=torch.contiguous_format)
        else:
            buf = dest
        if g.index == self.root and buf is not x:  # the others' buffers are only written
            buf.copy_(x.detach())
        return start(g, "broadcast", lambda b: b.broadcast(buf, self.root, g), lambda: buf)


@attrs.frozen
class Reduce(Op):
    """Sum over members onto member ``root``; zeros elsewhere."""

    root: int = 0
    name: ClassVar[str] = "reduce"

    def start(self, x: torch.Tensor) -> Handle:
        g = self.group
        if g.size == 1:
            return Handle.ready(x)
        buf = x.detach().clone(memory_format=torch.contiguous_format)

        def finish() -> torch.Tensor:
            return buf if g.index == self.root else buf.zero_()

        return start(g, "reduce", lambda b: b.all_reduce(buf, "sum", g), finish)


@attrs.frozen
class Slice(Op):
    """Keep this member's piece of ``dim`` (pieces ``sizes``). Local; the piece
    is a copy, so the whole input can be freed."""

    dim: int
    sizes: tuple[int, ...]
    name: ClassVar[str] = "slice"

    def start(self, x: torch.Tensor) -> Handle:
        g = self.group
        _check_len("slice", g, x, self.dim, sum(self.sizes))
        if self.sizes[g.index] == x.size(self.dim):
            return Handle.ready(x)
        off = _offsets(self.sizes)[g.index]
        piece = x.narrow(self.dim, off, self.sizes[g.index])
        return Handle.ready(piece.clone(memory_format=torch.contiguous_format))


@attrs.frozen
class Pad(Op):
    """Place this member's piece of ``dim`` into zeros of the full length. Local."""

    dim: int
    sizes: tuple[int, ...]
    name: ClassVar[str] = "pad"

    def start(self, x: torch.Tensor) -> Handle:
        g = self.group
        _check_len("pad", g, x, self.dim, self.sizes[g.index])
        shape = list(x.shape)
        shape[self.dim] = sum(self.sizes)
        out = x.new_zeros(shape)
        out.narrow(self.dim, _offsets(self.sizes)[g.index], x.size(self.dim)).copy_(x)
        return Handle.ready(out)


@attrs.frozen
class Mask(Op):
    """Keep the tensor on member 0, zeros elsewhere (replicated → partial). Local."""

    name: ClassVar[str] = "mask"

    def start(self, x: torch.Tensor) -> Handle:
        return Handle.ready(x if self.group.index == 0 else torch.zeros_like(x))


def _inverse(perm: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    return tuple((d, s) for s, d in perm)


_TRANSPOSE: dict[type, Callable[[Any], Op | None]] = {
    AllReduce: lambda op: attrs.evolve(op, out=None) if op.reduce in ("sum", "mean") else None,
    AllGather: lambda op: ReduceScatter(op.group, op.dim, op.sizes),
    ReduceScatter: lambda op: AllGather(op.group, op.dim, op.sizes),
    AllToAll: lambda op: AllToAll(
        op.group, op.concat_dim, op.split_dim, op.concat_sizes, op.split_sizes
    ),
    Permute: lambda op: Permute(op.group, _inverse(op.perm)),
    Broadcast: lambda op: Reduce(op.group, op.root),
    Reduce: lambda op: Broadcast(op.group, op.root),
    Slice: lambda op: Pad(op.group, op.dim, op.sizes),
    Pad: lambda op: Slice(op.group, op.dim, op.sizes),
    Mask: lambda op: op,
}


def register_transpose(cls: type[Op], rule: Callable[[Op], Op | None]) -> None:
    """Add an op defined outside this module (e.g. ``Redistribute``) to the table."""
    _TRANSPOSE[cls] = rule


def transpose(op: Op) -> Op:
    """The op whose forward is the linear transpose of ``op``'s (the table above).

    Raises:
        CollectiveError: for ops that are not linear (pmax, pmin).

    >>> import shardax as sx
    >>> group = sx.Mesh({"dp": 1}).group("dp")
    >>> type(transpose(AllGather(group, 0, (4,)))).__name__
    'ReduceScatter'
    """
    rule = _TRANSPOSE.get(type(op))
    result = rule(op) if rule is not None else None
    if result is None:
        raise CollectiveError(f"{op.name} is not linear and has no transpose")
    return result
