"""The CuPy NCCL backend, for GPU ranks: one ``cupy.cuda.nccl.NcclCommunicator``
per group (its members in member order are the communicator's ranks, so no
reordering), made on first use and cached, its unique id passed from member
0 to the others through the torch.distributed store. Torch CUDA tensors go
to NCCL by ``data_ptr()`` on torch's current stream: no copies, and no CuPy
arrays or memory pool. All-reduce, all-gather, reduce-scatter and broadcast
are NCCL's own; all-to-all and point-to-point are grouped sends and
receives. A call returns at once; its handle's ``wait()`` makes the caller's
current stream wait for the call's CUDA event (the host never blocks).

Everything else — CPU tensors, dtypes NCCL lacks — goes to the fallback
(the torch backend). CuPy is imported only here, when the backend is first
asked for: ``import shardax`` never needs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import CollectiveError
from ..mesh._groups import Group, PGState
from ._agree import Call, agree
from ._backend import Pending

__all__ = ["CupyBackend", "cupy_available", "exchange_unique_id", "id_bytes", "id_tuple"]

NCCL_UNIQUE_ID_BYTES = 128
# ncclDataType_t and ncclRedOp_t as nccl.h numbers them (a stable ABI): the
# tables can be checked without CuPy or a GPU.
NCCL_DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
NCCL_OPS = {"sum": 0, "max": 2, "min": 3}


def cupy_available() -> tuple[bool, str]:
    """Whether this process can run the CuPy backend, and if not, why."""
    try:
        from cupy.cuda import nccl
    except Exception as err:  # not installed, or its CUDA libraries do not load
        return False, f"cannot import cupy.cuda.nccl ({type(err).__name__}: {err})"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    try:
        nccl.get_version()
    except Exception as err:
        return False, f"libnccl does not load ({type(err).__name__}: {err})"
    return True, ""


def id_bytes(uid: Sequence[int]) -> bytes:
    """CuPy's unique id (128 C ``char`` values, -128..127) as bytes."""
    if len(uid) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes; got {len(uid)}")
    return bytes(x & 0xFF for x in uid)


def id_tuple(data: bytes) -> tuple[int, ...]:
    """The inverse of :func:`id_bytes`: what ``NcclCommunicator`` takes."""
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes; got {len(data)}")
    return tuple(b - 256 if b > 127 else b for b in data)


def exchange_unique_id(store: Any, key: str, root: bool, make_id: Callable[[], bytes]) -> bytes:
    """The unique id of one communicator, on every member: member 0
    (``root``) makes it with ``make_id()`` and sets it under ``key`` in the
    torch.distributed ``store``; the others wait for it there (as long as the
    store's timeout)."""
    if root:
        data = make_id()
        if len(data) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes; got {len(data)}")
        store.set(key, data)
        return data
    return bytes(store.get(key))


class _Recorded:
    """A call's CUDA event: ``wait()`` orders the caller's current stream
    after it (``host``: blocks the host until it has happened too)."""

    __slots__ = ("event", "host")

    def __init__(self, host: bool = False) -> None:
        self.event = torch.cuda.Event()
        self.event.record()
        self.host = host

    def wait(self) -> None:
        if self.host:
            self.event.synchronize()
        else:
            torch.cuda.current_stream().wait_event(self.event)


class CupyBackend:
    """Collectives through NCCL communicators made by CuPy; the rest through
    ``fallback``. ``store``: returns the torch.distributed store that carries
    the communicators' unique ids."""

    name = "cupy"

    def __init__(self, fallback: Any, store: Callable[[], Any]) -> None:
        self.fallback = fallback
        self.store = store
        self.comms: dict[tuple[int, ...], Any] = {}
        self.made = itertools.count()  # every member makes its communicators in one order

    def attach(self, state: PGState, store: Any) -> None:
        """Nothing yet: a group's communicator is made on its first collective."""

    def describe(self, group: Group) -> str:
        return f"NCCL (CuPy) over ranks {group.members}"

    # -- communicators ---------------------------------------------------------

    def _comm(self, group: Group) -> Any:
        members = tuple(group.members)
        comm = self.comms.get(members)
        if comm is None:
            from cupy.cuda import Device, nccl

            store = self.store()
            if store is None:
                raise CollectiveError(
                    f"the cupy backend over {group.label} needs torch.distributed's store to "
                    "pass the NCCL unique id: initialize the process group first "
                    "(shardax.init or shardax launch)"
                )
            key = f"shardax/nccl-id/{'-'.join(map(str, members))}/{next(self.made)}"
            uid = exchange_unique_id(
                store, key, group.index == 0, lambda: id_bytes(nccl.get_unique_id())
            )
            with Device(torch.cuda.current_device()):
                comm = nccl.NcclCommunicator(group.size, id_tuple(uid), group.index)
            self.comms[members] = comm
        return comm

    def close(self) -> None:
        """Destroy the communicators (the process group is going away)."""
        for comm in self.comms.values():
            comm.destroy()
        self.comms.clear()

    # -- what goes where ---------------------------------------------------------

    @staticmethod
    def covers(*tensors: torch.Tensor) -> bool:
        """Every tensor is a CUDA tensor of a dtype NCCL reduces."""
        return all(t.is_cuda and t.dtype in NCCL_DTYPES for t in tensors)

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    # -- the backend protocol ----------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: str, group: Group) -> Pending:
        return self.all_reduce_out(x, x, op, group)

    def all_reduce_out(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> Pending:
        if not self.covers(out, x):
            return self.fallback.all_reduce_out(out, x, op, group)
        self._all_reduce(out, x, op, group)
        return Pending([_Recorded()])

    def _all_reduce(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> None:
        self._comm(group).allReduce(
            x.data_ptr(), out.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], NCCL_OPS[op],
            self._stream(),
        )  # fmt: skip

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        if not self.covers(out, x):
            return self.fallback.all_gather(out, x, group)
        self._comm(group).allGather(
            x.data_ptr(), out.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], self._stream()
        )
        return Pending([_Recorded()])

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        if not self.covers(out, x):
            return self.fallback.reduce_scatter(out, x, group)
        self._comm(group).reduceScatter(
            x.data_ptr(), out.data_ptr(), out.numel(), NCCL_DTYPES[x.dtype], NCCL_OPS["sum"],
            self._stream(),
        )  # fmt: skip
        return Pending([_Recorded()])

    def broadcast(self, x: torch.Tensor, root: int, group: Group) -> Pending:
        if not self.covers(x):
            return self.fallback.broadcast(x, root, group)
        self._comm(group).broadcast(
            x.data_ptr(), x.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], root, self._stream()
        )
        return Pending([_Recorded()])

    def all_to_all(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
    ) -> Pending:
        if not self.covers(out, x):
            return self.fallback.all_to_all(out, x, out_splits, in_splits, group)
        sends, recvs, at_in, at_out = [], [], 0, 0
        for j, (n_in, n_out) in enumerate(zip(in_splits, out_splits, strict=True)):
            sends.append((j, x.narrow(0, at_in, n_in)))
            recvs.append((j, out.narrow(0, at_out, n_out)))
            at_in, at_out = at_in + n_in, at_out + n_out
        return self.send_recv(sends, recvs, group)

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        group: Group,
        tag: int = 0,
    ) -> Pending:
        tensors = [t for _, t in sends] + [t for _, t in recvs]
        if not self.covers(*tensors):
            return self.fallback.send_recv(sends, recvs, group, tag)
        from cupy.cuda import nccl  # NCCL has no tags: messages match in order

        comm, stream = self._comm(group), self._stream()
        nccl.groupStart()
        try:
            for peer, t in sends:
                if t.numel():
                    comm.send(t.data_ptr(), t.numel(), NCCL_DTYPES[t.dtype], peer, stream)
            for peer, t in recvs:
                if t.numel():
                    comm.recv(t.data_ptr(), t.numel(), NCCL_DTYPES[t.dtype], peer, stream)
        finally:
            nccl.groupEnd()
        return Pending([_Recorded()])

    def barrier(self, group: Group) -> Pending:
        """A one-element all-reduce, waited for by the host too."""
        if not torch.cuda.is_available():
            return self.fallback.barrier(group)
        one = torch.zeros(1, device=torch.cuda.current_device())
        self._all_reduce(one, one, "sum", group)
        return Pending([_Recorded(host=True)])

    def agreed(
        self, sig: Sequence[int], call: Call, group: Group, issue: Callable[[], Pending]
    ) -> Pending:
        """Off by default on GPU transports (``SHARDAX_CHECK_COLLECTIVES=1``
        turns it on): the exchange waits for the host."""
        agree(self, sig, call, group)
        return issue()
