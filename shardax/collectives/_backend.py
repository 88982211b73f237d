"""The backend interface: a handful of flat-buffer collectives in member order.

A backend moves bytes; shapes, uneven sizes, padding and autograd live in
``_ops``. Every backend passes the same conformance suite
(:mod:`shardax.collectives.conformance`).

Each process group a mesh makes gets its :class:`Comm` here — the backend
chosen for it, whether its collectives check their signatures, how many
have been issued on it — through :func:`setup_group`, which the mesh calls
as it makes the group (:class:`~shardax.mesh._groups.GroupSetup`): the
mesh below knows nothing of backends.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..mesh._groups import Group, PGState, set_group_setup
from ._agree import Call, checks_enabled, describe, moving_now, signature
from ._failures import translate_error
from ._lent import LOANS
from ._traffic import counting, timed

__all__ = [
    "Backend", "Comm", "Handle", "Pending", "backend_names", "comm_of", "get_backend",
    "setup_group", "start",
]  # fmt: skip


class Pending:
    """Backend work in flight: objects with ``wait()``, then an optional
    fix-up. ``lent``: aliases of its buffers that the transport's own
    threads hold and may be the last to drop (gloo's workers), anchored
    meanwhile (:mod:`._lent`)."""

    __slots__ = ("after", "lent", "works")

    def __init__(
        self,
        works: Sequence[Any] = (),
        after: Callable[[], None] | None = None,
        lent: Sequence[torch.Tensor] = (),
    ) -> None:
        self.works = list(works)
        self.after = after
        self.lent = tuple(lent)
        if self.lent:
            LOANS.hold(self.lent)

    def wait(self) -> None:
        """Finish it: every work, then the fix-up (errors raised as they come;
        :class:`Handle` translates them)."""
        try:
            _wait_each(self.works)  # in a frame of its own: no loop variable keeps a work
        finally:
            self.settle()
        if self.after is not None:
            self.after()

    def settle(self) -> None:
        """Once every work is finished (done or failed), drop them and what
        they were lent, and the anchors the transport no longer needs."""
        if self.lent and all(_finished(work) for work in self.works):
            self.works = []
            self.lent = ()
            LOANS.prune()


def _wait_each(
    works: Sequence[Any], translate: Callable[[Exception], Exception] | None = None
) -> None:
    """``wait()`` on each of ``works``, a failure other than a
    :class:`~shardax.errors.CollectiveError` raised as ``translate(err)``
    where given. A function of its own so that, once it returns, no frame
    still settling the work references its last one: a loop variable left
    bound to it would keep the buffers it was lent anchored until the next
    collective (:meth:`Pending.settle` drops only what no work holds)."""
    for work in works:
        try:
            work.wait()
        except CollectiveError:
            raise
        except Exception as err:
            if translate is None:
                raise
            raise translate(err) from err


def _finished(work: Any) -> bool:
    is_completed = getattr(work, "is_completed", None)
    return True if is_completed is None else bool(is_completed())


class Backend(Protocol):
    """What a collective backend implements. Buffers are contiguous; member
    ``i`` of ``group`` is ``group.members[i]``; every call returns at once with
    a :class:`Pending`."""

    name: str

    def attach(self, state: PGState, store: Any) -> None:
        """Set up this backend's side of a process group the mesh has just
        made (the shm backend maps the group's segment). Called on every
        member, in step (:func:`setup_group`), so it may be collective
        among the group's members through the torch.distributed ``store``."""
        ...

    def describe(self, group: Group) -> str:
        """How collectives on ``group`` run here, in words."""
        ...

    def all_reduce(self, x: torch.Tensor, op: str, group: Group) -> Pending:
        """In place: ``x`` ← reduction (``"sum"``, ``"max"``, ``"min"``) over members."""
        ...

    def all_reduce_out(self, out: torch.Tensor, x: torch.Tensor, op: str, group: Group) -> Pending:
        """``out`` ← reduction over members of their ``x`` (``x`` only read;
        ``out`` may be ``x``): a functional ``psum`` needs no copy first when
        the backend can read its input directly."""
        ...

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        """``out`` (shape ``[n * x.shape[0], *x.shape[1:]]``) ← every member's ``x``
        concatenated on dim 0, in member order."""
        ...

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, group: Group) -> Pending:
        """``out`` ← sum over members of their ``x[index]`` (``x``: ``[n, *out.shape]``,
        one row per member)."""
        ...

    def all_to_all(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
    ) -> Pending:
        """1-D buffers: chunk ``j`` of ``x`` goes to member ``j``; chunk ``j`` of
        ``out`` comes from member ``j`` (sizes in elements)."""
        ...

    def broadcast(self, x: torch.Tensor, root: int, group: Group) -> Pending:
        """In place: ``x`` ← member ``root``'s ``x``."""
        ...

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        group: Group,
        tag: int = 0,
    ) -> Pending:
        """Point to point, all at once: ``(member, tensor)`` pairs. Messages
        between two members match in order per ``tag`` (backends without
        tags, NCCL, match them in order)."""
        ...

    def barrier(self, group: Group) -> Pending:
        """Every member arrives before any leaves."""
        ...

    def agreed(
        self, sig: Sequence[int], call: Call, group: Group, issue: Callable[[], Pending]
    ) -> Pending:
        """``issue()`` (the collective ``call``), once every member's
        signature ``sig`` agrees with this one's (:mod:`._agree`); a mismatch
        raises :class:`~shardax.errors.CollectiveMismatchError` on every
        member — here or from the returned work's ``wait()`` — and ``issue``
        never moves data."""
        ...


class Handle:
    """A collective in flight. ``wait()`` finishes it and returns its result
    (once; later calls return the same). What every collective returns with
    ``async_op=True`` (the return rule: :mod:`shardax.collectives._api`),
    and what an op's ``start`` returns.

    Errors (including timeouts) surface from ``wait()`` as
    :class:`~shardax.errors.CollectiveError` naming the op, the axes and the
    ranks.
    """

    __slots__ = ("_done", "_finish", "_group", "_op", "_pending", "_result", "_seq")

    def __init__(
        self,
        group: Group | None,
        op: str,
        seq: int,
        pending: Pending | None,
        finish: Callable[[], Any],
    ) -> None:
        self._group, self._op, self._seq = group, op, seq
        self._pending, self._finish = pending, finish
        self._done = False
        self._result: Any = None

    @classmethod
    def ready(cls, value: Any) -> Handle:
        """A handle whose result is already known (local work, size-1 groups)."""
        return cls(None, "", 0, None, lambda: value)

    @classmethod
    def later(cls, finish: Callable[[], Any]) -> Handle:
        """A handle whose ``wait()`` returns ``finish()`` (which waits for
        the work it depends on: another handle's ``wait()``)."""
        return cls(None, "", 0, None, finish)

    def wait(self) -> Any:
        if not self._done:
            if self._pending is not None:
                try:
                    _wait_each(self._pending.works, self._translate)
                finally:
                    self._pending.settle()
                if self._pending.after is not None:
                    self._pending.after()
            self._result = self._finish()
            self._done = True
            self._pending = self._finish = None  # type: ignore[assignment]
        return self._result

    def _translate(self, err: Exception) -> CollectiveError:
        assert self._group is not None  # a handle with work in flight has its group
        return translate_error(self._group, self._op, self._seq, err)


def start(
    group: Group,
    op: str,
    launch: Callable[[Backend], Pending],
    finish: Callable[[], Any],
    shape: Sequence[int] | None = None,
) -> Handle:
    """Issue one backend collective on ``group`` and return its handle.

    ``launch`` makes exactly one call, on the backend it is given (it runs
    twice: once against a recorder, which issues nothing). Where the group checks its
    collectives (:mod:`._agree`), the call is first recorded and its
    signature agreed across the group; ``shape`` (the user's tensor shape)
    only serves the messages."""
    comm = comm_of(group)
    seq = comm.seq
    comm.seq += 1
    try:
        if comm.check:
            call = describe(launch)
            if call.call != "send_recv":  # point to point: not every member takes part
                sig = signature(group, op, seq, call, shape)
                backend = counting(comm.backend, group, op)
                pending = comm.backend.agreed(sig, call, group, lambda: launch(backend))
                return Handle(group, _label(op), seq, pending, timed(finish, group, op))
        pending = launch(counting(comm.backend, group, op))
    except CollectiveError:
        raise
    except Exception as err:
        raise translate_error(group, _label(op), seq, err) from err
    return Handle(group, _label(op), seq, pending, timed(finish, group, op))


class Comm:
    """What the collectives layer keeps for one process group (its
    ``PGState.comm``, on every member): the backend, chosen once when the
    group is made; whether its collectives check their signatures first
    (:mod:`._agree`); and how many collectives have been issued on it —
    every rank issues the same ones in the same order, so the count names a
    collective across ranks, and on a timeout tells which ranks reached it."""

    __slots__ = ("backend", "check", "seq")

    def __init__(self, backend: Backend, check: bool) -> None:
        self.backend = backend
        self.check = check
        self.seq = 0


def setup_group(state: PGState) -> Comm:
    """The collectives layer's side of a process group the mesh has just made
    (the mesh calls it, on every member, in step: :func:`set_group_setup`):
    its backend (``SHARDAX_BACKEND``, read now — fixed for the group's
    life), whether to check signatures (``SHARDAX_CHECK_COLLECTIVES``, on
    the group's transport), and the backend's own setup (:meth:`Backend.attach`)."""
    backend = get_backend()
    transport = str(dist.get_backend(state.pg)) if backend.name == "torch" else backend.name
    comm = Comm(backend, checks_enabled(transport))
    backend.attach(state, dist.distributed_c10d._get_default_store())
    return comm


set_group_setup(setup_group)


def comm_of(group: Group) -> Comm:
    """The :class:`Comm` of ``group``'s process group (groups of more than one
    member only: a size-1 group never reaches a backend)."""
    comm = None if group.state is None else group.state.comm
    if not isinstance(comm, Comm):
        raise CollectiveError(
            f"{group!r} has no collective backend: its process group was made without "
            "shardax.collectives' setup (a group of one member, or one made by hand)"
        )
    return comm


def _label(op: str) -> str:
    """``op`` as errors name it: with what it moves, where known."""
    what = moving_now()
    return f"{op} (moving {what})" if what else op


_BACKENDS: dict[str, Callable[[], Backend]] = {}


def _torch() -> Backend:
    from ._torch_backend import TORCH_BACKEND

    return TORCH_BACKEND


_BACKENDS["torch"] = _torch
_SHM: list[Backend] = []


def _shm() -> Backend:
    from ._shm_backend import ShmBackend, shm_available

    if not _SHM:
        ok, why = shm_available()
        if not ok:
            raise CollectiveError(f"the shm backend is unavailable here: {why}")
        _SHM.append(ShmBackend(_torch()))
    return _SHM[0]


_BACKENDS["shm"] = _shm
_CUPY: list[Backend] = []


def _cupy() -> Backend:
    from ..mesh._runtime import _default_store
    from ._cupy_backend import CupyBackend, cupy_available

    if not _CUPY:
        ok, why = cupy_available()
        if not ok:
            raise CollectiveError(
                f"the cupy backend is unavailable here: {why}; pip install cupy-cuda12x "
                "(or cupy-cuda11x) on a machine with NVIDIA GPUs, or use SHARDAX_BACKEND=torch"
            )
        _CUPY.append(CupyBackend(_torch(), _default_store))  # type: ignore[arg-type]
    return _CUPY[0]


_BACKENDS["cupy"] = _cupy


def backend_names() -> tuple[str, ...]:
    """The backends this build knows.

    >>> backend_names()
    ('torch', 'shm', 'cupy')
    """
    return tuple(_BACKENDS)


def _auto() -> str:
    """``cupy`` for GPU ranks when CuPy's NCCL loads, else ``torch``; ``shm``
    for CPU ranks when shared memory and the native core work (groups
    spanning nodes still go through torch), else ``torch``."""
    import torch

    if torch.cuda.is_available():
        from ._cupy_backend import cupy_available

        return "cupy" if cupy_available()[0] else "torch"
    from ._shm_backend import shm_available

    return "shm" if shm_available()[0] else "torch"


def get_backend(name: str | None = None) -> Backend:
    """The backend named ``name``; None → ``SHARDAX_BACKEND`` or automatic:
    ``shm`` (shared memory within a node, torch's gloo across nodes) for CPU
    ranks when the native core builds; ``cupy`` (NCCL communicators made by
    CuPy) for GPU ranks when CuPy and libnccl load; else ``torch`` (gloo on
    CPU, NCCL on GPU).

    >>> get_backend("torch").name
    'torch'
    """
    name = name or os.environ.get("SHARDAX_BACKEND") or "auto"
    if name == "auto":
        name = _auto()
    if name not in _BACKENDS:
        raise CollectiveError(
            f"unknown collective backend {name!r} (from SHARDAX_BACKEND or the argument); "
            f"choose one of {backend_names()!r} or 'auto'"
        )
    return _BACKENDS[name]()
