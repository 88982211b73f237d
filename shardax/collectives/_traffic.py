"""Counting what collectives move: ``traffic()`` records every collective
issued while its ``with`` block runs — by op and mesh axes, calls and bytes —
whoever issues it (``transfer``, ``apply``'s gathers, gradient buckets, a
user's ``psum``)."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..mesh._groups import Group

__all__ = ["Traffic", "counting", "timed", "traffic"]

_ACTIVE: contextvars.ContextVar[Traffic | None] = contextvars.ContextVar(
    "shardax_traffic", default=None
)


class Traffic:
    """Collectives counted by ``(op, axes)``: ``calls``, ``bytes`` and
    ``wire``. A collective's bytes are its full-size buffer, as nccl-tests
    count ``size``: an all-reduce's tensor, an all-gather's output, a
    reduce-scatter's input, an all-to-all's input, the bytes a rank sends in
    a ``ppermute``. ``wire`` is what each rank sends in the ring algorithms,
    nccl-tests' bus bytes: ``2(n-1)/n`` of the size for an all-reduce,
    ``(n-1)/n`` for an all-gather, reduce-scatter or all-to-all — so an
    all-gather plus a reduce-scatter move the bytes of one all-reduce; for
    a ``ragged_all_to_all``, exactly the rows it sends the other members
    (those it keeps cost nothing).

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> with sx.collectives.traffic() as t:
    ...     _ = sx.collectives.psum(torch.ones(4), "dp", mesh=mesh)
    >>> t.calls, t.bytes       # one rank: nothing moves
    ({}, {})
    """

    def __init__(self) -> None:
        self.calls: dict[tuple[str, tuple[str, ...]], int] = {}
        self.bytes: dict[tuple[str, tuple[str, ...]], int] = {}
        self.wire: dict[tuple[str, tuple[str, ...]], float] = {}
        self.sizes: dict[tuple[str, tuple[str, ...], int], int] = {}  # calls by buffer size
        self.seconds: dict[tuple[str, tuple[str, ...]], float] = {}  # issue → completion

    def add(self, op: str, axes: tuple[str, ...], nbytes: int, wire: float) -> None:
        key = (op, axes)
        sized = (op, axes, int(nbytes))
        self.sizes[sized] = self.sizes.get(sized, 0) + 1
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + int(nbytes)
        self.wire[key] = self.wire.get(key, 0.0) + float(wire)

    def add_time(self, op: str, axes: tuple[str, ...], seconds: float) -> None:
        key = (op, axes)
        self.seconds[key] = self.seconds.get(key, 0.0) + float(seconds)

    def total(self, op: str | None = None, axes: Sequence[str] | None = None) -> int:
        """Bytes of the collectives matching ``op`` and ``axes`` (None: any)."""
        want = tuple(axes) if axes is not None else None
        return sum(
            b
            for (o, a), b in self.bytes.items()
            if (op is None or o == op) and (want is None or a == want)
        )

    def count(self, op: str, axes: Sequence[str], nbytes: int) -> int:
        """How many ``op`` over ``axes`` moved a buffer of exactly ``nbytes``."""
        return self.sizes.get((op, tuple(axes), int(nbytes)), 0)

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"psum over tp": {"calls": n, "bytes": b, "wire": w, "seconds": s}, …}``
        (JSON-ready); ``seconds`` runs from each collective's issue to its
        completion (for one overlapped with compute, that compute too)."""
        return {
            f"{op} over {','.join(axes)}": {
                "calls": self.calls[(op, axes)],
                "bytes": b,
                "wire": self.wire[(op, axes)],
                "seconds": self.seconds.get((op, axes), 0.0),
            }
            for (op, axes), b in sorted(self.bytes.items())
        }

    def __repr__(self) -> str:
        return f"Traffic({self.summary()!r})"


@contextlib.contextmanager
def traffic() -> Iterator[Traffic]:
    """Count the collectives this thread issues inside the ``with`` block
    (see :class:`Traffic`); blocks nest, each counting what runs inside it.

    >>> import torch, shardax as sx
    >>> with sx.collectives.traffic() as t:
    ...     pass
    >>> t.summary()
    {}
    """
    t = Traffic()
    outer = _ACTIVE.get()
    token = _ACTIVE.set(t)
    try:
        yield t
    finally:
        _ACTIVE.reset(token)
        if outer is not None:
            for key, n in t.calls.items():
                outer.calls[key] = outer.calls.get(key, 0) + n
            for key, b in t.bytes.items():
                outer.bytes[key] = outer.bytes.get(key, 0) + b
            for key, w in t.wire.items():
                outer.wire[key] = outer.wire.get(key, 0.0) + w
            for sized, n in t.sizes.items():
                outer.sizes[sized] = outer.sizes.get(sized, 0) + n
            for key, sec in t.seconds.items():
                outer.seconds[key] = outer.seconds.get(key, 0.0) + sec


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Counting:
    """A backend that records each call into the active :class:`Traffic`."""

    def __init__(self, backend: Any, record: Traffic, group: Group, op: str) -> None:
        self._backend, self._record, self._group, self._op = backend, record, group, op
        self.name = backend.name

    def _add(self, nbytes: int, ring: float = 1.0) -> None:
        """``ring``: the bus factor's multiple of ``(n-1)/n``."""
        n = len(self._group.members)
        wire = nbytes * ring * (n - 1) / n
        self._record.add(self._op, tuple(self._group.axes), nbytes, wire)

    def all_reduce(self, x: torch.Tensor, op: str, group: Group) -> Any:
        self._add(_nbytes(x), ring=2.0)
        return self._backend.all_reduce(x, op, group)

    def all_reduce_out(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> Any:
        self._add(_nbytes(x), ring=2.0)
        return self._backend.all_reduce_out(out, x, op, group)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Any:
        self._add(_nbytes(out))
        return self._backend.all_gather(out, x, group)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Any:
        self._add(_nbytes(x))
        return self._backend.reduce_scatter(out, x, group)

    def all_to_all(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
    ) -> Any:
        # the wire: what goes to the other members ((n-1)/n of an even one's input)
        others = (sum(in_splits) - in_splits[self._group.index]) * x.element_size()
        self._record.add(self._op, tuple(self._group.axes), _nbytes(x), others)
        return self._backend.all_to_all(out, x, out_splits, in_splits, group)

    def broadcast(self, x: torch.Tensor, root: int, group: Group) -> Any:
        self._add(_nbytes(x))
        return self._backend.broadcast(x, root, group)

    def send_recv(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Any, group: Group, tag: int = 0
    ) -> Any:
        n = len(self._group.members)
        self._add(sum(_nbytes(t) for _, t in sends), ring=n / max(n - 1, 1))  # sent as is
        return self._backend.send_recv(sends, recvs, group, tag)

    def barrier(self, group: Group) -> Any:
        return self._backend.barrier(group)


def timed(finish: Any, group: Group, op: str) -> Any:
    """``finish``, recording the time since now into the active
    :class:`Traffic` when it runs (the collective completed)."""
    record = _ACTIVE.get()
    if record is None:
        return finish
    started = time.perf_counter()
    axes = tuple(group.axes)

    def done() -> Any:
        result = finish()
        record.add_time(op, axes, time.perf_counter() - started)
        return result

    return done


def counting(backend: Any, group: Group, op: str) -> Any:
    """``backend``, counted into the active :class:`Traffic` if any."""
    record = _ACTIVE.get()
    return backend if record is None else _Counting(backend, record, group, op)
