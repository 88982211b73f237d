"""The shared-memory backend for CPU ranks on one node.

Each group whose members share a node maps one segment of ``/dev/shm``: a
control block of counters per member (one cache line each: barrier, chunks
published, pieces reduced, chunks read), two all-to-all size tables and one
*slot* per member holding a ring of :data:`RING` chunks of :data:`CHUNK_BYTES`
(2 MiB, which stays in cache; ``SHARDAX_SHM_SLOT_MIB`` only caps it). Every
collective runs whole inside one call into the native core
(``kernels/csrc/shm.cpp``), pipelined chunk by chunk: a member writes into
its ring only what its peers need of chunk ``t`` (a reduce-scatter the
``n - 1`` pieces the others reduce, an all-gather its input, an all-to-all
the pieces for the others), publishes it by bumping a counter, and reads
chunk ``t - 1`` of the others straight into its output — reducing as it
goes, in member order, with its own input read directly rather than
through its ring — then says it has read it, which frees that ring
position. An all-reduce is a reduce-scatter and an all-gather of each
chunk: every member reduces its piece of the chunk into its output and
into its ring, and copies the others' pieces from theirs. A chunk is read
while it is still in cache; there is no barrier between chunks or
collectives (counters only grow, and every member issues the same
collectives in the same order) and no result area. Only an all-to-all
meets the others at a barrier first, to check what each member sends.
Where the group checks its collectives (:mod:`._agree`), each is preceded,
in the same work, by ``sx_agree``: every member writes its signature into
its control block and compares the others' there, so a mismatch raises on
every member before any data moves.

The native calls run on one worker thread per backend, in issue order, with
the GIL released: a collective returns at once, its
:class:`~shardax.collectives._backend.Pending` holding a :class:`_Work`
whose ``wait()`` joins it and re-raises its error, so ZeRO-3's prefetches
overlap compute. One thread for every group keeps collectives on different
groups, issued in the same order on every rank, from deadlocking; a caller
that waits for work not yet started while the thread is idle runs it
itself (no thread switch for a collective waited for at once); the work
holds its tensors until it has run.

The segment's file is unlinked as soon as every member has mapped it, so no
``/dev/shm`` file outlives the collective setup, even if ranks crash later.
Every wait — the barrier and each chunk's — that lasts longer than the
group's timeout raises :class:`~shardax.errors.CollectiveTimeoutError`
naming the ranks that did not arrive; one whose peer died (its process
gone, checked every 20 ms while waiting) fails at once, as a closed
connection does on gloo. Groups that span nodes, dtypes or ops the core
does not know (anything but fp32/fp64/fp16/bf16/int32/int64 sum/max/min)
and point-to-point sends go to the torch backend (gloo) — never unreduced
data — whose calls return gloo's own handles.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..mesh._groups import Group, PGState
from . import _hierarchical
from ._agree import AGREED, WIDTH, moving_now, settle_splits, verify
from ._backend import Pending

__all__ = ["ShmBackend", "node_id", "shm_available"]

_LINE = 64
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
           torch.int32: 4, torch.int64: 5}  # fmt: skip
_OPS = {"sum": 0, "max": 1, "min": 2}
DEFAULT_SLOT_MIB = 16
CHUNK_BYTES = 256 * 1024  # one ring position: a peer reads it while it is in cache
RING = 8  # positions per ring: 2 MiB per member, which stays in cache
_ATTACHES: dict[tuple[int, ...], int] = {}  # attaches per rank set: fresh store keys each time

_I64 = ctypes.c_int64
_P64 = ctypes.POINTER(ctypes.c_int64)


class _Control(ctypes.Structure):
    """What the native core knows of a segment (``struct Seg`` in shm.cpp)."""

    _fields_ = [
        ("base", ctypes.c_void_p), ("n", _I64), ("me", _I64), ("slot_off", _I64),
        ("slot_bytes", _I64), ("chunk_bytes", _I64), ("ring", _I64), ("table_off", _I64),
        ("timeout_us", _I64), ("pids", _P64), ("missing", ctypes.POINTER(ctypes.c_int32)),
        ("chunks", ctypes.c_uint64), ("barriers", ctypes.c_uint64), ("signs", ctypes.c_uint64)
    ]  # fmt: skip


def _lib() -> Any:
    from ..kernels import SHM

    lib = SHM.load()
    if lib is not None and not getattr(lib, "_shardax_typed", False):
        seg, ptr, i64, i32 = ctypes.POINTER(_Control), ctypes.c_void_p, _I64, ctypes.c_int
        signatures = {
            "sx_barrier": [seg],
            "sx_all_reduce": [seg, ptr, ptr, i64, i32, i32],
            "sx_all_gather": [seg, ptr, ptr, i64, _P64],
            "sx_reduce_scatter": [seg, ptr, ptr, i64, _P64, i32, i32],
            "sx_broadcast": [seg, ptr, i64, i64],
            "sx_all_to_all": [seg, ptr, ptr, _P64, _P64, _P64, _P64, i64, _P64],
            "sx_agree": [seg, _P64, i64, i64, _P64],
        }
        for name, args in signatures.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        lib.sx_control_bytes.argtypes, lib.sx_control_bytes.restype = [], _I64
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
    share segments, and the namespace to check each other's liveness).
    ``SHARDAX_NODE_ID``, where set, is taken instead: ranks with different
    values never share memory (tests split one host into "nodes" so)."""
    forced = os.environ.get("SHARDAX_NODE_ID")
    if forced:
        return f"forced/{forced}"
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


def _native(tensors: Sequence[torch.Tensor], op: str) -> bool:
    """Whether the native core reduces/moves ``tensors`` with ``op``."""
    return op in _OPS and all(
        t.dtype in _DTYPES and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def _ring(slot_bytes: int) -> tuple[int, int]:
    """``(chunk_bytes, positions)`` of a slot's ring: :data:`RING` positions of
    :data:`CHUNK_BYTES`, fewer or smaller in a small slot (at least two)."""
    ring = max(2, min(RING, slot_bytes // CHUNK_BYTES))
    return min(CHUNK_BYTES, slot_bytes // ring) // _LINE * _LINE, ring


class _Segment:
    """One group's mapping: control blocks, all-to-all tables, slots."""

    def __init__(self, path: str, n: int, me: int, slot_bytes: int, create: bool) -> None:
        self.n, self.me = n, me
        chunk, ring = _ring(slot_bytes)  # a slot holds only its ring
        table_off = n * int(_lib().sx_control_bytes())
        slot_off = table_off + -(-2 * n * n * 8 // _LINE) * _LINE
        size = slot_off + n * chunk * ring
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
        self.pids = (ctypes.c_int64 * n)()  # members' pids, for liveness
        self.missing = (ctypes.c_int32 * n)()
        self.control = _Control(
            self.bytes.data_ptr(), n, me, slot_off, chunk * ring, chunk, ring, table_off, 0,
            self.pids, self.missing, 0, 0, 0,
        )  # fmt: skip
        self.ref = ctypes.byref(self.control)


class _Work:
    """One collective queued on a :class:`_Worker`: ``wait()`` finishes it
    and re-raises what it raised. It holds its tensors until it has run."""

    __slots__ = ("_done", "_worker", "error", "keep", "run")

    def __init__(self, worker: _Worker, run: Callable[[], None], keep: tuple[Any, ...]) -> None:
        self._worker, self.run, self.keep = worker, run, keep
        self.error: BaseException | None = None
        self._done = threading.Event()

    def wait(self) -> None:
        if not self._done.is_set():
            self._worker.finish(self)
        if self.error is not None:
            raise self.error

    def execute(self) -> None:
        try:
            self.run()
        except BaseException as err:  # handed to the waiter
            self.error = err
        finally:
            self.run = self.keep = None  # type: ignore[assignment]
            self._done.set()


class _Worker:
    """Runs queued work in issue order on one daemon thread (restarted after
    a fork). A caller waiting for work that has not started, with the
    thread idle, runs the queue's head itself up to its own work, so that
    a collective waited for at once costs no thread switch."""

    def __init__(self) -> None:
        self._queue: collections.deque[_Work] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False  # someone runs the queue's head
        self._thread: threading.Thread | None = None

    def submit(self, run: Callable[[], None], keep: tuple[Any, ...]) -> Pending:
        work = _Work(self, run, keep)
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="shardax-shm", daemon=True)
                self._thread.start()
            self._queue.append(work)
            self._cond.notify_all()
        return Pending(works=[work])

    def _next(self, work: _Work | None) -> _Work | None:
        """Claim the queue's head (for the thread: ``work`` None, wait for
        one), or None when ``work`` is done or someone else runs the head."""
        with self._cond:
            while work is None and (self._busy or not self._queue):
                self._cond.wait()
            if (work is not None and work._done.is_set()) or self._busy or not self._queue:
                return None
            self._busy = True
            return self._queue.popleft()

    def _ran(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def finish(self, work: _Work) -> None:
        while not work._done.is_set():
            head = self._next(work)
            if head is None:
                work._done.wait()
                return
            try:
                head.execute()
            finally:
                self._ran()

    def _loop(self) -> None:
        while True:
            head = self._next(None)
            assert head is not None  # the loop waits until there is one
            try:
                head.execute()
            finally:
                self._ran()


def _check(code: int, seg: _Segment, group: Group, what: str) -> None:
    """Raise what the torch backend's failures look like, so that the
    collective layer reports them the same way: a timeout (it then names who
    did not arrive and where they wait), or a peer gone (a dead member)."""
    if code == -1:
        raise RuntimeError("shared-memory wait timed out")
    if code == -2:
        ranks = group.state.ranks if group.state is not None else group.members
        dead = [ranks[i] for i in range(seg.n) if seg.missing[i]]
        raise RuntimeError(f"shared memory: connection closed by peer: rank(s) {dead} exited")
    if code != 0:  # the tables of dtypes and the core disagree: never return unreduced data
        raise RuntimeError(f"shared-memory {what} failed in the native core (code {code})")


def _array(values: Sequence[int]) -> Any:
    return (ctypes.c_int64 * len(values))(*values)


class ShmBackend:
    """Collectives through shared memory on one node, run by one worker
    thread in issue order; the rest through ``fallback`` (the torch backend)."""

    name = "shm"

    def __init__(self, fallback: Any, slot_mib: float | None = None) -> None:
        self.fallback = fallback
        mib = slot_mib or float(os.environ.get("SHARDAX_SHM_SLOT_MIB", DEFAULT_SLOT_MIB))
        self.slot_bytes = max(4096, int(mib * 2**20) // _LINE * _LINE)
        self.segments: dict[tuple[int, ...], _Segment | None] = {}
        self.hierarchies: dict[tuple[int, ...], _hierarchical.Hierarchy] = {}
        self._worker = _Worker()
        self._gates = threading.local()  # a signature check waiting for its collective

    # -- setup (collective among the group's members) --------------------------

    def attach(self, state: PGState, store: Any) -> None:
        """Map the segment of the group ``state`` (every member calls this
        when the mesh makes the group, in step: :func:`._backend.setup_group`).
        A group spanning nodes reduces
        hierarchically (:mod:`._hierarchical`: a segment among the members
        on each node, the fallback between one leader per node) and sends
        everything else through the fallback; a segment that cannot be made
        leaves the group to the fallback."""
        ranks = tuple(state.ranks)
        import torch.distributed as dist

        me_global = dist.get_rank()
        me = ranks.index(me_global)
        generation = _ATTACHES[ranks] = _ATTACHES.get(ranks, 0) + 1  # same on every member
        key = "shardax/shm/" + "-".join(map(str, ranks)) + f"/{generation}"
        store.set(f"{key}/node/{me}", node_id())
        nodes = [store.get(f"{key}/node/{i}").decode() for i in range(len(ranks))]
        # Segments are kept per rank set (groups of the same ranks share one);
        # the latest attach decides where they live (SHARDAX_NODE_ID can move
        # ranks between "nodes" within a process).
        if len(set(nodes)) > 1:
            hier = _hierarchical.hierarchy(ranks, nodes, me_global, state)
            if hier.local is not None:  # the members on this node map their own segment
                self._map(tuple(hier.local.state.ranks), store)  # type: ignore[union-attr]
            self.hierarchies[ranks] = hier
            self.segments.pop(ranks, None)
            return
        self.hierarchies.pop(ranks, None)
        self._map(ranks, store, key)

    def _map(self, ranks: tuple[int, ...], store: Any, key: str | None = None) -> None:
        """Make (member 0) or map (the others) the segment of ``ranks``, all
        on this node, and unlink it once every member has tried."""
        if ranks in self.segments:
            return
        import torch.distributed as dist

        me = ranks.index(dist.get_rank())
        if key is None:
            generation = _ATTACHES[ranks] = _ATTACHES.get(ranks, 0) + 1
            key = "shardax/shm/" + "-".join(map(str, ranks)) + f"/{generation}"
        store.set(f"{key}/pid/{me}", str(os.getpid()))
        segment: _Segment | None = None
        if me == 0:
            path = f"/dev/shm/shardax-{uuid.uuid4().hex}"
            try:
                segment = _Segment(path, len(ranks), me, self.slot_bytes, create=True)
            except OSError as err:
                path = f"!{err}"
            store.set(f"{key}/path", path)
        else:
            path = store.get(f"{key}/path").decode()
            if not path.startswith("!"):  # else the creator could not make it
                with contextlib.suppress(OSError):
                    segment = _Segment(path, len(ranks), me, self.slot_bytes, create=False)
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

    # -- helpers ------------------------------------------------------------------------

    def _usable(self, group: Group, *tensors: torch.Tensor, op: str = "sum") -> _Segment | None:
        seg = self._segment(group)
        return seg if seg is not None and _native(tensors, op) else None

    def _hierarchy(
        self, group: Group, *tensors: torch.Tensor, op: str
    ) -> _hierarchical.Hierarchy | None:
        state = group.state
        hier = None if state is None else self.hierarchies.get(tuple(state.ranks))
        if hier is None or not _native(tensors, op):
            return None
        local = hier.local
        return hier if local is None or self._segment(local) is not None else None

    def describe(self, group: Group) -> str:
        """How collectives on ``group`` run here, in words.

        >>> backend = ShmBackend(fallback=None)
        >>> import shardax as sx
        >>> backend.describe(sx.Mesh({"x": 1}).group("x"))
        'local (one member)'
        """
        state = group.state
        if state is None:
            return "local (one member)"
        hier = self.hierarchies.get(tuple(state.ranks))
        if hier is not None:
            if hier.local is not None and self._segment(hier.local) is None:
                return "the torch backend (no shared-memory segment on this node)"
            return hier.describe()
        if self._segment(group) is None:
            return "the torch backend (no shared-memory segment)"
        return f"shm ({group.size} members on one node)"

    def _submit(
        self, seg: _Segment, group: Group, what: str, call: Callable[[], int], *keep: Any
    ) -> Pending:
        """Queue ``call`` (a native collective on ``seg``) for the worker,
        after the signature check :meth:`agreed` left for it, if any."""
        timeout_us = int((group.state.wait if group.state else 600.0) * 1e6)
        gate = self._take_gate()

        def run() -> None:
            seg.control.timeout_us = timeout_us
            if gate is not None:
                gate()
            _check(call(), seg, group, what)

        return self._worker.submit(run, keep)

    # -- agreement (``_agree``): signatures through the segment, on the worker ---------

    def agreed(
        self, sig: Sequence[int], call: Any, group: Group, issue: Callable[[], Pending]
    ) -> Pending:
        """The signatures meet in the segment's control blocks
        (``sx_agree``), on the worker, in issue order and without blocking
        the caller; the collective runs after them in the same work, or not
        at all. A collective that the core does not take (another dtype, a
        group spanning nodes) waits for the check here before going to the
        fallback."""
        seg = self._segment(group)
        if seg is None:
            return self.fallback.agreed(sig, call, group, issue)
        lib, rows, what, n = _lib(), self._rows(group), moving_now(), group.size
        mine, table = _array(sig), _array([0] * (n * WIDTH))

        def gather(out: torch.Tensor, x: torch.Tensor) -> None:  # an all-to-all's splits
            code = lib.sx_all_gather(seg.ref, out.data_ptr(), x.data_ptr(), x.numel() * 8, rows)
            _check(code, seg, group, "signature check")

        def gate() -> None:
            code = lib.sx_agree(seg.ref, mine, WIDTH, AGREED, table)
            if code == -5:  # every member sees every row: all of them raise here
                at = [group.torch_rank(i) * WIDTH for i in range(n)]  # member order
                verify([table[a : a + WIDTH] for a in at], group, what)
            _check(code, seg, group, "signature check")
            settle_splits(call, group, what, gather)

        self._gates.gate = (gate, seg, group, (mine, table, rows))
        try:
            return issue()
        finally:
            self._gates.gate = None

    def _take_gate(self) -> Callable[[], None] | None:
        held = getattr(self._gates, "gate", None)
        self._gates.gate = None
        return None if held is None else held[0]

    def _fallback(self) -> Any:
        """The fallback, once a pending signature check (if any) has passed:
        its calls must not start before the check, which they would outrun."""
        held = getattr(self._gates, "gate", None)
        if held is not None:
            _, seg, group, keep = held
            self._submit(seg, group, "signature check", lambda: 0, *keep).wait()  # takes the gate
        return self.fallback

    @staticmethod
    def _rows(group: Group) -> Any:
        """Member index of each segment index (segments are in torch group order)."""
        rows = [0] * group.size
        for i in range(group.size):
            rows[group.torch_rank(i)] = i
        return _array(rows)

    # -- the collectives ------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: str, group: Group) -> Pending:
        return self.all_reduce_out(x, x, op, group)

    def all_reduce_out(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> Pending:
        seg = self._usable(group, out, x, op=op)
        if seg is None:
            hier = self._hierarchy(group, out, x, op=op)
            if hier is not None:
                return _hierarchical.all_reduce(self, hier, out, x, op, group)
            return self._fallback().all_reduce_out(out, x, op, group)
        lib, count, dtype = _lib(), x.numel(), _DTYPES[x.dtype]
        return self._submit(
            seg, group, "all_reduce",
            lambda: lib.sx_all_reduce(seg.ref, out.data_ptr(), x.data_ptr(), count, dtype, _OPS[op]),
            out, x,
        )  # fmt: skip

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        seg = self._usable(group, out, x)
        if seg is None:
            return self._fallback().all_gather(out, x, group)
        lib, rows, nbytes = _lib(), self._rows(group), x.numel() * x.element_size()
        return self._submit(
            seg, group, "all_gather",
            lambda: lib.sx_all_gather(seg.ref, out.data_ptr(), x.data_ptr(), nbytes, rows),
            out, x, rows,
        )  # fmt: skip

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        seg = self._usable(group, out, x)
        if seg is None:
            return self._fallback().reduce_scatter(out, x, group)
        lib, rows, count, dtype = _lib(), self._rows(group), out.numel(), _DTYPES[x.dtype]
        return self._submit(
            seg, group, "reduce_scatter",
            lambda: lib.sx_reduce_scatter(seg.ref, out.data_ptr(), x.data_ptr(), count, rows,
                                          dtype, _OPS["sum"]),
            out, x, rows,
        )  # fmt: skip

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
            return self._fallback().all_to_all(out, x, out_splits, in_splits, group)
        n, size = group.size, x.element_size()
        arrays = [[0] * n for _ in range(4)]  # send_off, send_len, recv_off, recv_len by segment
        sent = received = 0
        for i in range(n):
            s = group.torch_rank(i)
            arrays[0][s], arrays[1][s] = sent * size, int(in_splits[i]) * size
            arrays[2][s], arrays[3][s] = received * size, int(out_splits[i]) * size
            sent, received = sent + int(in_splits[i]), received + int(out_splits[i])
        send_off, send_len, recv_off, recv_len = map(_array, arrays)
        got, lib = _array([0] * n), _lib()

        def call() -> int:
            code = lib.sx_all_to_all(seg.ref, out.data_ptr(), x.data_ptr(), send_off, send_len,
                                     recv_off, recv_len, size, got)  # fmt: skip
            if code == -4:
                i = next(
                    i for i in range(n) if got[group.torch_rank(i)] != recv_len[group.torch_rank(i)]
                )
                raise RuntimeError(
                    f"all_to_all on {group.label}: member {i} sends "
                    f"{got[group.torch_rank(i)] // size} elements, this rank expects "
                    f"{int(out_splits[i])}"
                )
            return code

        keep = (out, x, send_off, send_len, recv_off, recv_len, got)
        return self._submit(seg, group, "all_to_all", call, *keep)

    def broadcast(self, x: torch.Tensor, root: int, group: Group) -> Pending:
        seg = self._usable(group, x)
        if seg is None:
            return self._fallback().broadcast(x, root, group)
        lib, nbytes, r = _lib(), x.numel() * x.element_size(), group.torch_rank(root)
        return self._submit(
            seg, group, "broadcast", lambda: lib.sx_broadcast(seg.ref, x.data_ptr(), nbytes, r), x
        )

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        group: Group,
        tag: int = 0,
    ) -> Pending:
        return self._fallback().send_recv(sends, recvs, group, tag)

    def barrier(self, group: Group) -> Pending:
        seg = self._segment(group)
        if seg is None:
            return self._fallback().barrier(group)
        lib = _lib()
        return self._submit(seg, group, "barrier", lambda: lib.sx_barrier(seg.ref))
