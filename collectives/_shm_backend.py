"""The shared-memory backend for CPU ranks on one node.

Each group whose members share a node maps one segment of ``/dev/shm``:
a row of per-member barrier counters (one cache line each), a table of
all-to-all sizes, one *slot* per member and a result area. A collective
copies this rank's data into its slot, meets the others at a barrier, reads
what it needs straight from their slots — an all-reduce reduces only this
rank's share of the buffer and everyone copies the result, a reduce-scatter
reduces only this rank's piece (a real one, not an all-reduce) — and meets
them again before the slots are reused. Messages larger than a slot go in
chunks. The native core (``kernels/csrc/shm.cpp``) does the barrier with
atomics and the reductions with OpenMP; copies are torch's.

The segment's file is unlinked as soon as every member has mapped it, so no
``/dev/shm`` file outlives the collective setup, even if ranks crash later.
A barrier that waits longer than the group's timeout raises
:class:`~shardax.errors.CollectiveTimeoutError` naming the ranks that did
not arrive; one whose peer died (its process gone, checked every 20 ms while
waiting) fails at once, as a closed connection does on gloo. Groups that span nodes, dtypes or ops the core does not know
(anything but fp32/fp64/fp16/bf16/int32/int64 sum/max/min) and
point-to-point sends go to the torch backend (gloo) — never unreduced data.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from ._backend import Pending
from ._group import Group

__all__ = ["ShmBackend", "node_id", "shm_available"]

_LINE = 64  # bytes per barrier counter: one cache line each
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
           torch.int32: 4, torch.int64: 5}  # fmt: skip
_OPS = {"sum": 0, "max": 1, "min": 2}
DEFAULT_SLOT_MIB = 16
_ATTACHES: dict[tuple[int, ...], int] = {}  # attaches per rank set: fresh store keys each time


def _lib() -> Any:
    from ..kernels import SHM

    lib = SHM.load()
    if lib is not None and not getattr(lib, "_shardax_typed", False):
        lib.sx_barrier.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_uint64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int),
                                   ctypes.POINTER(ctypes.c_int64)]  # fmt: skip
        lib.sx_barrier.restype = ctypes.c_int
        lib.sx_reduce.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                  ctypes.c_int64, ctypes.c_int, ctypes.c_int]  # fmt: skip
        lib.sx_reduce.restype = ctypes.c_int
        lib.sx_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.sx_copy.restype = None
        lib._shardax_typed = True
    return lib


def shm_available() -> tuple[bool, str]:
    """Whether this process can use the backend, and why not."""
    if not os.path.isdir("/dev/shm"):
        return False, "no /dev/shm"
    if _lib() is None:
        from ..kernels import SHM

        return False, f"the native core is unavailable: {SHM.status().get('reason')}"
    return True, ""


def node_id() -> str:
    """This machine as the backend sees it: host name, boot id, the
    /dev/shm mount and the pid namespace (members must share the mount to
    share segments, and the namespace to check each other's liveness)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        shm = os.stat("/dev/shm").st_dev
        pids = os.stat("/proc/self/ns/pid").st_ino  # liveness checks read /proc
    except OSError:
        shm = pids = 0
    return f"{socket.gethostname()}/{boot}/{shm}/{pids}"


class _Segment:
    """One group's mapping: counters, the all-to-all size table, slots, result."""

    def __init__(self, path: str, n: int, me: int, slot_bytes: int, create: bool) -> None:
        self.n, self.me, self.slot_bytes = n, me, slot_bytes
        self.table_off = n * _LINE
        self.data_off = self.table_off + ((n * n * 8 + _LINE - 1) // _LINE) * _LINE
        self.result_off = self.data_off + n * slot_bytes
        size = self.result_off + slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                # Reserve the pages now: on a small /dev/shm (Docker's 64 MiB) a
                # sparse file would map fine and then kill the process with
                # SIGBUS at first touch; this fails cleanly instead (→ gloo).
                os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size)
        except OSError:
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        self.seq = 0
        self.pids = (ctypes.c_int64 * n)()  # members' pids, for liveness

    def slot(self, j: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        off = self.data_off + j * self.slot_bytes
        return self.bytes[off : off + numel * _itemsize(dtype)].view(dtype)

    def result(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.bytes[self.result_off : self.result_off + numel * _itemsize(dtype)].view(dtype)

    def table(self) -> torch.Tensor:
        return self.bytes[self.table_off : self.table_off + self.n * self.n * 8].view(torch.int64)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ShmBackend:
    """Collectives through shared memory on one node; the rest through
    ``fallback`` (the torch backend)."""

    name = "shm"

    def __init__(self, fallback: Any, slot_mib: float | None = None) -> None:
        self.fallback = fallback
        mib = slot_mib or float(os.environ.get("SHARDAX_SHM_SLOT_MIB", DEFAULT_SLOT_MIB))
        self.slot_bytes = max(4096, int(mib * 2**20) // _LINE * _LINE)
        self.segments: dict[tuple[int, ...], _Segment | None] = {}

    # -- setup (collective among the group's members) --------------------------

    def attach(self, state: Any, store: Any) -> None:
        """Map the segment of the group ``state`` (every member calls this
        when the group is made); members on different nodes, or a segment
        that cannot be made, leave the group to the fallback."""
        ranks = tuple(state.ranks)
        if ranks in self.segments:
            return
        import torch.distributed as dist

        me_global = dist.get_rank()
        me = ranks.index(me_global)
        generation = _ATTACHES[ranks] = _ATTACHES.get(ranks, 0) + 1  # same on every member
        key = "shardax/shm/" + "-".join(map(str, ranks)) + f"/{generation}"
        store.set(f"{key}/node/{me}", node_id())
        store.set(f"{key}/pid/{me}", str(os.getpid()))
        nodes = {store.get(f"{key}/node/{i}").decode() for i in range(len(ranks))}
        segment: _Segment | None = None
        ok = len(nodes) == 1
        path = ""
        if ok and me == 0:
            path = f"/dev/shm/shardax-{uuid.uuid4().hex}"
            try:
                segment = _Segment(path, len(ranks), me, self.slot_bytes, create=True)
            except OSError as err:
                store.set(f"{key}/path", f"!{err}")
                ok = False
            else:
                store.set(f"{key}/path", path)
        elif ok:
            path = store.get(f"{key}/path").decode()
            if path.startswith("!"):
                ok = False
            else:
                try:
                    segment = _Segment(path, len(ranks), me, self.slot_bytes, create=False)
                except OSError:
                    segment = None
        # Everyone says whether it mapped; the creator unlinks once all tried.
        store.set(f"{key}/mapped/{me}", "1" if segment is not None else "0")
        mapped = [store.get(f"{key}/mapped/{i}").decode() == "1" for i in range(len(ranks))]
        if me == 0 and path and not path.startswith("!"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not all(mapped):
            segment = None
        if segment is not None:
            for i in range(len(ranks)):
                segment.pids[i] = int(store.get(f"{key}/pid/{i}"))
        self.segments[ranks] = segment

    def _segment(self, group: Group) -> _Segment | None:
        state = group.state
        return None if state is None else self.segments.get(tuple(state.ranks))

    # -- the barrier and the helpers ----------------------------------------------

    def _barrier(self, seg: _Segment, group: Group) -> None:
        """Meet every member, or raise what the torch backend's failures look
        like, so that the collective layer reports it the same way: a
        timeout (it then names who did not arrive and where they wait), or a
        peer gone (a dead member: its process exited)."""
        seg.seq += 1
        missing = (ctypes.c_int * seg.n)()
        timeout_us = int((group.state.timeout if group.state else 600.0) * 1e6)
        code = _lib().sx_barrier(
            seg.base, _LINE, seg.n, seg.me, seg.seq, timeout_us, missing, seg.pids
        )
        if code == -1:
            raise RuntimeError("shared-memory barrier timed out")
        if code == -2:
            dead = [group.state.ranks[i] for i in range(seg.n) if missing[i]]
            raise RuntimeError(f"shared memory: connection closed by peer: rank(s) {dead} exited")

    def _member(self, group: Group, i: int) -> int:
        """Segment index of member ``i`` (segments are in torch group order)."""
        return group.torch_rank(i)

    def _reduce(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor], op: str) -> None:
        ptrs = (ctypes.c_void_p * len(srcs))(*[s.data_ptr() for s in srcs])
        code = _lib().sx_reduce(dst.data_ptr(), ptrs, len(srcs), dst.numel(),
                                _DTYPES[dst.dtype], _OPS[op])  # fmt: skip
        if code != 0:  # the dtype table and the core disagree: never return unreduced data
            raise RuntimeError(f"shm reduce of {dst.dtype} {op} failed")

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = src.numel() * src.element_size()
        if nbytes >= 1 << 22:
            _lib().sx_copy(dst.data_ptr(), src.data_ptr(), nbytes)
        else:
            dst.copy_(src)

    def _usable(self, group: Group, *tensors: torch.Tensor, op: str = "sum") -> _Segment | None:
        seg = self._segment(group)
        if seg is None or op not in _OPS:
            return None
        for t in tensors:
            if t.dtype not in _DTYPES or t.device.type != "cpu" or not t.is_contiguous():
                return None
        return seg

    # -- the collectives ------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: str, group: Group) -> Pending:
        return self.all_reduce_out(x, x, op, group)

    def all_reduce_out(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> Pending:
        seg = self._usable(group, out, x, op=op)
        if seg is None:
            return self.fallback.all_reduce_out(out, x, op, group)
        src, dst, n = x.view(-1), out.view(-1), seg.n
        per = seg.slot_bytes // x.element_size()
        for lo in range(0, max(src.numel(), 1), per):
            k = min(per, src.numel() - lo)
            self._copy(seg.slot(seg.me, x.dtype, k), src[lo : lo + k])
            self._barrier(seg, group)
            a, b = k * seg.me // n, k * (seg.me + 1) // n  # this rank's share
            if b > a:
                srcs = [seg.slot(j, x.dtype, k)[a:b] for j in range(n)]
                self._reduce(seg.result(x.dtype, k)[a:b], srcs, op)
            self._barrier(seg, group)
            self._copy(dst[lo : lo + k], seg.result(x.dtype, k))
        return Pending()

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        seg = self._usable(group, out, x)
        if seg is None:
            return self.fallback.all_gather(out, x, group)
        flat, rows = x.view(-1), out.view(group.size, -1)
        per = seg.slot_bytes // x.element_size()
        for lo in range(0, max(flat.numel(), 1), per):
            k = min(per, flat.numel() - lo)
            self._copy(seg.slot(seg.me, x.dtype, k), flat[lo : lo + k])
            self._barrier(seg, group)
            for i in range(group.size):
                self._copy(rows[i, lo : lo + k], seg.slot(self._member(group, i), x.dtype, k))
            self._barrier(seg, group)
        return Pending()

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        seg = self._usable(group, out, x)
        if seg is None:
            return self.fallback.reduce_scatter(out, x, group)
        n, rows, dst = group.size, x.view(group.size, -1), out.view(-1)
        m = rows.shape[1]
        per = max(1, seg.slot_bytes // x.element_size() // n)  # columns per chunk
        mine = self._member(group, group.index)
        for lo in range(0, max(m, 1), per):
            w = min(per, m - lo)
            # my rows, in segment order: piece i of my slot is for segment member i
            slot = seg.slot(seg.me, x.dtype, n * w).view(n, w)
            for i in range(n):
                self._copy(slot[self._member(group, i)], rows[i, lo : lo + w])
            self._barrier(seg, group)
            srcs = [seg.slot(j, x.dtype, n * w).view(n, w)[mine] for j in range(n)]
            if w:
                self._reduce(dst[lo : lo + w], srcs, "sum")
            self._barrier(seg, group)
        return Pending()

    def all_to_all(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
    ) -> Pending:
        seg = self._usable(group, out, x)
        if seg is None:
            return self.fallback.all_to_all(out, x, out_splits, in_splits, group)
        n = group.size
        order = [self._member(group, i) for i in range(n)]  # member → segment index
        member_of = {d: i for i, d in enumerate(order)}
        # Publish how much I send to each segment index; everyone learns the rounds.
        row = torch.tensor([int(in_splits[member_of[d]]) for d in range(n)], dtype=torch.int64)
        seg.table()[seg.me * n : (seg.me + 1) * n].copy_(row)
        self._barrier(seg, group)
        table = seg.table().view(n, n).clone()  # [sender, receiver], segment indices
        per = max(1, seg.slot_bytes // x.element_size() // n)  # elements per piece per round
        rounds = -(-int(table.max()) // per) if table.numel() else 0
        in_starts = [sum(in_splits[:i]) for i in range(n)]
        out_starts = [sum(out_splits[:i]) for i in range(n)]
        for i in range(n):
            if int(table[order[i], seg.me]) != int(out_splits[i]):
                raise RuntimeError(
                    f"all_to_all on {group.label}: member {i} sends {int(table[order[i], seg.me])} "
                    f"elements, this rank expects {int(out_splits[i])}"
                )
        me = group.index
        own = int(in_splits[me])  # my piece for myself: copied directly, once
        self._copy(
            out[out_starts[me] : out_starts[me] + own], x[in_starts[me] : in_starts[me] + own]
        )
        for r in range(rounds):
            lo = r * per
            slot = seg.slot(seg.me, x.dtype, n * per).view(n, per)
            for i in range(n):  # my piece for member i goes to column block order[i]
                k = max(0, min(per, int(in_splits[i]) - lo))
                if k and i != me:
                    start = in_starts[i] + lo
                    self._copy(slot[order[i], :k], x[start : start + k])
            self._barrier(seg, group)
            for i in range(n):  # member i's piece for me
                k = max(0, min(per, int(out_splits[i]) - lo))
                if k and i != me:
                    src = seg.slot(order[i], x.dtype, n * per).view(n, per)[seg.me, :k]
                    start = out_starts[i] + lo
                    self._copy(out[start : start + k], src)
            self._barrier(seg, group)
        if rounds == 0:
            self._barrier(seg, group)  # the table is read before anyone rewrites it
        return Pending()

    def broadcast(self, x: torch.Tensor, root: int, group: Group) -> Pending:
        seg = self._usable(group, x)
        if seg is None:
            return self.fallback.broadcast(x, root, group)
        flat, r = x.view(-1), self._member(group, root)
        per = seg.slot_bytes // x.element_size()
        for lo in range(0, max(flat.numel(), 1), per):
            k = min(per, flat.numel() - lo)
            if seg.me == r:
                self._copy(seg.slot(r, x.dtype, k), flat[lo : lo + k])
            self._barrier(seg, group)
            if seg.me != r:
                self._copy(flat[lo : lo + k], seg.slot(r, x.dtype, k))
            self._barrier(seg, group)
        return Pending()

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        group: Group,
    ) -> Pending:
        return self.fallback.send_recv(sends, recvs, group)

    def barrier(self, group: Group) -> Pending:
        seg = self._segment(group)
        if seg is None:
            return self.fallback.barrier(group)
        self._barrier(seg, group)
        return Pending()
