"""Collectives agree before they move data.

Every rank of an SPMD program issues the same collectives on a group, in the
same order, with buffers that fit each other. When one does not — a psum
meeting a pmax, a float32 meeting an int32 of the same bytes, a shape that
differs, a rank that skipped a collective and is one ahead — a backend
either returns wrong numbers, hangs, or aborts the process (gloo). So before
a collective's data moves, its *signature* is compared across the group:
each member contributes a small fixed-size vector of int64 (:data:`WIDTH`)
through the group's own backend, and every member checks every row. On
gloo, NCCL and CuPy that is one tiny all-gather (always the same size, so
it is safe whatever the members were about to do); on shared memory each
member writes its vector into its control block of the segment and reads
the others' there (``sx_agree`` in ``kernels/csrc/shm.cpp``: no extra
collective). A mismatch raises :class:`~shardax.errors.CollectiveMismatchError`
on **every** member, naming each member's op, dtype, shape, axes and, where
known, the key path being moved; the data never moves.

A signature is taken from the very call the backend is about to receive
(:func:`describe` runs the collective's launch against a recorder), so it
covers every caller — ``transfer``, ``apply``'s gathers, gradient buckets,
a user's ``psum`` — with no per-caller code:

======  ======================================================================
field   what must agree across the group
======  ======================================================================
seq     the collective's number on the group (a skipped one shows here)
op      the user-facing op (``psum``, ``pmax``, ``all_gather``, ...)
call    the backend call (all_reduce, all_gather, reduce_scatter, ...)
reduce  the reduction (sum, max, min)
dtype   the buffer's dtype
axes    the mesh axes named
count   the buffer's element count (all-to-all: checked pairwise instead)
root    a broadcast's root
======  ======================================================================

An all-to-all's pieces may be uneven: after the signatures agree, members
exchange what they send to each (``n`` int64 each) and check it against
what each expects to receive.

The check is on by default where the group's transport is a CPU one (gloo,
shared memory) and off on GPU transports until measured there;
``SHARDAX_CHECK_COLLECTIVES=0`` / ``1`` turns it off / on everywhere
(docs/failure_modes.md gives its measured cost).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from ..errors import CollectiveError, CollectiveMismatchError
from ..mesh._groups import Group

__all__ = [
    "AGREED", "WIDTH", "Call", "agree", "checks_enabled", "describe", "moving", "moving_now",
    "settle", "settle_splits", "signature", "splits_row", "verify", "verify_splits",
]  # fmt: skip

WIDTH = 16  # int64 per member
_MAGIC = 0x5358_0001  # "SX", version 1
_OPS = ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all",
        "ppermute", "broadcast", "reduce", "redistribute", "barrier",
        "ragged_all_to_all")  # fmt: skip
_CALLS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
          "send_recv")  # fmt: skip
_REDUCES = ("", "sum", "max", "min")
_DTYPE_ORDER = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
                torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)  # fmt: skip
_DTYPES = {d: i for i, d in enumerate(_DTYPE_ORDER)}
_MAX_DIMS = 5
# Fields compared across the group (indices into the vector); the rest describe.
_SEQ, _OP, _CALL, _REDUCE, _DTYPE, _AXES, _COUNT, _ROOT = 1, 2, 3, 4, 5, 6, 7, 8
_WHAT, _NDIM, _DIMS = 9, 10, 11
_AGREED = (0, _SEQ, _OP, _CALL, _REDUCE, _DTYPE, _AXES, _COUNT, _ROOT)
AGREED = len(_AGREED)  # the compared fields lead the vector: a backend compares a prefix
assert tuple(range(AGREED)) == _AGREED
_FIELDS = (("version", 0), ("collective number", _SEQ), ("op", _OP), ("backend call", _CALL),
           ("reduction", _REDUCE), ("dtype", _DTYPE), ("axes", _AXES), ("element count", _COUNT),
           ("root", _ROOT))  # fmt: skip

_MOVING: contextvars.ContextVar[str] = contextvars.ContextVar("shardax_moving", default="")


@contextlib.contextmanager
def moving(what: str) -> Iterator[None]:
    """Name what the collectives inside the block move (a key path, a bucket),
    so that a mismatch or a timeout names it.

    >>> with moving("blocks.0.attn.qkv.weight"):
    ...     pass
    """
    token = _MOVING.set(what)
    try:
        yield
    finally:
        _MOVING.reset(token)


def moving_now() -> str:
    """What the collectives issued here move (:func:`moving`), or ""."""
    return _MOVING.get()


def checks_enabled(transport: str) -> bool:
    """Whether collectives on a group of ``transport`` (``"gloo"``,
    ``"shm"``, ``"nccl"``, ``"cupy"``, ...) check their signatures:
    ``SHARDAX_CHECK_COLLECTIVES`` (``1``/``0``) where set, else on for CPU
    transports.

    >>> checks_enabled("gloo")
    True
    """
    forced = os.environ.get("SHARDAX_CHECK_COLLECTIVES", "").strip().lower()
    if forced in ("1", "true", "on", "yes"):
        return True
    if forced in ("0", "false", "off", "no"):
        return False
    if forced not in ("", "auto"):
        raise CollectiveError(
            f"SHARDAX_CHECK_COLLECTIVES={forced!r} is not understood; use 1 (check every "
            "collective's signature across the group), 0 (do not) or auto (check on CPU transports)"
        )
    return transport in ("gloo", "shm")


@attrs.frozen
class Call:
    """The one backend call a collective's launch makes, as data."""

    call: str
    dtype: torch.dtype
    device: torch.device
    count: int
    reduce: str = ""
    root: int = -1
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()


class _Recorder:
    """A backend that records the call it receives and issues nothing."""

    name = "recorder"

    def __init__(self) -> None:
        self.call: Call | None = None

    def _set(self, name: str, x: torch.Tensor, **kw: Any) -> None:
        self.call = Call(name, x.dtype, x.device, x.numel(), **kw)

    def all_reduce(self, x: torch.Tensor, op: str, group: Group) -> None:
        self._set("all_reduce", x, reduce=op)

    def all_reduce_out(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> None:
        self._set("all_reduce", x, reduce=op)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
        self._set("all_gather", x)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
        self._set("reduce_scatter", x, reduce="sum")

    def all_to_all(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
    ) -> None:
        self._set(
            "all_to_all", x,
            in_splits=tuple(int(s) for s in in_splits),
            out_splits=tuple(int(s) for s in out_splits),
        )  # fmt: skip

    def broadcast(self, x: torch.Tensor, root: int, group: Group) -> None:
        self._set("broadcast", x, root=root)

    def send_recv(self, sends: Any, recvs: Any, group: Group, tag: int = 0) -> None:
        tensors = [t for _, t in sends] + [t for _, t in recvs]
        x = tensors[0] if tensors else torch.empty(0)
        self._set("send_recv", x)

    def barrier(self, group: Group) -> None:
        self.call = Call("barrier", torch.int64, torch.device("cpu"), 0)


def describe(launch: Callable[[Any], Any]) -> Call:
    """The backend call ``launch`` makes, recorded without issuing it."""
    recorder = _Recorder()
    launch(recorder)
    if recorder.call is None:
        raise CollectiveError("internal: a collective's launch made no backend call")
    return recorder.call


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _code(table: Sequence[str], name: str) -> int:
    return table.index(name) if name in table else 1000 + _crc(name) % 1_000_000


def signature(
    group: Group, op: str, seq: int, call: Call, shape: Sequence[int] | None = None
) -> tuple[int, ...]:
    """This member's signature of collective ``seq`` on ``group``: :data:`WIDTH`
    int64, the :data:`AGREED` compared fields first. ``shape``: the user's
    tensor shape, for messages (the buffer's length otherwise)."""
    dims = list(shape) if shape is not None else [call.count]
    what = _MOVING.get()
    row = [
        _MAGIC, seq, _code(_OPS, op), _code(_CALLS, call.call), _code(_REDUCES, call.reduce),
        _DTYPES.get(call.dtype, 1000 + _crc(str(call.dtype)) % 1_000_000),
        _crc(",".join(group.axes)),
        -1 if call.call == "all_to_all" else call.count,
        call.root,
        _crc(what) if what else 0,
        len(dims),
        *[int(d) for d in dims[:_MAX_DIMS]],
    ]  # fmt: skip
    row += [-1] * (WIDTH - len(row))
    return tuple(row)


def _name(table: Sequence[str], code: int) -> str:
    return table[code] if 0 <= code < len(table) else f"<unknown {code}>"


def _dtype_name(code: int) -> str:
    for dtype, c in _DTYPES.items():
        if c == code:
            return str(dtype).removeprefix("torch.")
    return f"<dtype {code}>"


def _render(row: Sequence[int], axes: dict[int, str], whats: dict[int, str]) -> str:
    """One member's signature in words."""
    if row[0] != _MAGIC:
        return f"not a shardax collective signature ({list(row[:4])}...)"
    ndim = row[_NDIM]
    dims = list(row[_DIMS : _DIMS + min(ndim, _MAX_DIMS)]) + (["..."] if ndim > _MAX_DIMS else [])
    op, call = _name(_OPS, row[_OP]), _name(_CALLS, row[_CALL])
    reduce = _name(_REDUCES, row[_REDUCE])
    text = f"{op} (collective #{row[_SEQ]}: {call}"
    text += f" {reduce}" if reduce else ""
    text += f" root {row[_ROOT]}" if row[_ROOT] >= 0 else ""
    text += f") of {_dtype_name(row[_DTYPE])} {tuple(dims)}"
    text += f" over {axes.get(row[_AXES], '<other axes>')}"
    if row[_WHAT]:
        text += f" moving {whats.get(row[_WHAT], '<a key path named on that rank>')}"
    return text


def verify(rows: Sequence[Sequence[int]], group: Group, what: str = "") -> None:
    """Raise :class:`CollectiveMismatchError` unless every member's row
    (member order) agrees with this one's. ``what``: what this member's
    collective moves (:func:`moving`, taken when it was issued: this may run
    on a backend's worker thread)."""
    me = rows[group.index]
    if all(all(r[i] == me[i] for i in _AGREED) for r in rows):
        return
    axes = {_crc(",".join(group.axes)): "/".join(group.axes) or "()"}
    whats = {_crc(what): what} if what else {}
    lines = [
        f"  rank {rank}{' (this rank)' if i == group.index else ''}: {_render(r, axes, whats)}"
        for i, (rank, r) in enumerate(zip(group.members, rows, strict=True))
    ]
    fields = sorted({name for name, i in _FIELDS if any(r[i] != me[i] for r in rows)})
    raise CollectiveMismatchError(
        f"collective #{me[_SEQ]} over {group.label} does not match across its ranks "
        f"(they differ in: {', '.join(fields)}); no data was moved:\n"
        + "\n".join(lines)
        + "\nEvery rank must issue the same collectives, in the same order, with the same op, "
        "dtype and shape: look for rank-dependent control flow or data (a branch on the rank, "
        "an unseeded random shape, a list of tensors in a different order)."
    )


def verify_splits(table: torch.Tensor, group: Group, what: str = "") -> None:
    """``table[j]``: what member ``j`` sends to each member, then what it
    expects from each (``2n`` int64); every member checks every pair, so all
    of them raise on a misfit anywhere."""
    rows = table.cpu().tolist()
    n = group.size
    bad = [
        (i, j, rows[i][j], rows[j][n + i])
        for i in range(n)
        for j in range(n)
        if rows[i][j] != rows[j][n + i]
    ]
    if bad:
        detail = "; ".join(
            f"rank {group.members[i]} sends {s} elements to rank {group.members[j]}, "
            f"which expects {e}"
            for i, j, s, e in bad
        )
        raise CollectiveMismatchError(
            f"all_to_all over {group.label}"
            + (f" moving {what}" if what else "")
            + f": the pieces do not fit ({detail}); no data was moved. Every rank's split "
            "sizes must match what the receiving rank expects (all_to_all's split_sizes and "
            "concat_sizes are global: the same tuple on every rank)."
        )


def splits_row(call: Call, n: int, device: torch.device) -> torch.Tensor:
    """What this member sends to each member, then what it expects from each."""
    sent = list(call.in_splits or [0] * n) + list(call.out_splits or [0] * n)
    return torch.tensor(sent, dtype=torch.int64, device=device)


def settle(
    sig: Sequence[int],
    call: Call,
    group: Group,
    what: str,
    gather: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Agree on ``sig`` across ``group`` through ``gather(out, x)`` (every
    member's ``x`` into ``out``, member order, on the call's device): one
    all-gather of the rows, each checked (:func:`verify` raises); an
    all-to-all's splits are then gathered and checked pairwise
    (:func:`settle_splits`).

    One all-gather of 16 int64 it is: on gloo an all-reduce of the rows'
    extremes (``max`` of ``[sig, -sig]``) measured slower (gloo's
    all-reduce of 32 elements costs twice its all-gather of 16 here)."""
    mine = torch.tensor(sig, dtype=torch.int64, device=call.device)
    table = mine.new_empty((group.size, WIDTH))
    gather(table.view(-1), mine)
    verify(table.tolist(), group, what)
    settle_splits(call, group, what, gather)


def settle_splits(
    call: Call, group: Group, what: str, gather: Callable[[torch.Tensor, torch.Tensor], None]
) -> None:
    """An all-to-all's pieces, checked pairwise on every member (nothing for
    other calls): what each member sends to each, then what it expects from
    each, gathered through ``gather`` (:func:`verify_splits` raises)."""
    if call.call != "all_to_all":
        return
    sent = splits_row(call, group.size, call.device)
    splits = sent.new_empty((group.size, sent.numel()))
    gather(splits.view(-1), sent)
    verify_splits(splits, group, what)


def agree(backend: Any, sig: Sequence[int], call: Call, group: Group) -> None:
    """Agree on ``sig`` through ``backend``, blocking (:func:`settle`)."""
    settle(
        sig, call, group, _MOVING.get(),
        lambda out, x: backend.all_gather(out, x, group).wait(),
    )  # fmt: skip
