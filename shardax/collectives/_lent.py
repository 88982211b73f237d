"""Buffers lent to a transport's own threads, anchored so that those threads
never need the GIL for them.

gloo runs each collective on a worker thread of its process group, and
that thread, not the caller, often drops the last reference to a finished
work — and with it the work's tensors. In torch 2.13 a tensor that has a
Python object takes the GIL when its count of C++ references falls from
two to one (``TensorImpl::decref_pyobject``: the C++ side lets go of the
Python object). If the interpreter has begun to finalize by then — a rank
that raised right after a collective, such as the
:class:`~shardax.errors.CollectiveMismatchError` of a signature exchange —
Python ends that thread (``pthread_exit``) inside a C++ destructor, which
may not unwind: ``terminate called without an active exception``,
SIGABRT, exit status 134 instead of 1. (The worker's stack in a core dump:
``ProcessGroupGloo::runLoop`` → ``~AsyncAllgatherWork`` →
``decref_pyobject`` → ``take_gil`` → ``pthread_exit`` → ``std::terminate``.)

So the torch backend hands gloo fresh aliases of its buffers
(:meth:`Loans.lend`: same storage, a C++ tensor of their own), and while
gloo may hold one, an *anchor* — a view of it, which references it from
C++ — is kept here (:meth:`Loans.hold`). gloo's thread then never brings
an alias's count down to one: the anchor is dropped, on the caller's
thread, only once gloo holds nothing of it (its count is back to two: its
Python object and the anchor; :meth:`Loans.prune`). What gloo still holds
when the interpreter exits — a work whose handle was never waited for, a
finished one its thread has not let go of yet — stays anchored: the list
of anchors is never freed, so exit needs no wait and gloo's threads no GIL.

>>> import torch
>>> x = torch.ones(3)
>>> (alias,) = LOANS.lend(x)
>>> alias.data_ptr() == x.data_ptr(), alias is x
(True, False)
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import torch

__all__ = ["LOANS", "Loans"]


def _lent_out(alias: torch.Tensor) -> bool:
    """Whether something besides its Python object and its anchor (two C++
    references) references ``alias``: the transport, a work."""
    return alias._use_count() > 2


class Loans:
    """The aliases a transport may hold, each with its anchor. One per
    process (:data:`LOANS`): gloo's threads and the interpreter's exit are.

    >>> import torch
    >>> loans = Loans()
    >>> (alias,) = loans.lend(torch.ones(3))
    >>> gloo = alias.view(3)  # stands for a work that holds the alias
    >>> loans.hold((alias,)); loans.prune(); loans.outstanding()
    1
    >>> del gloo; loans.prune(); loans.outstanding()
    0
    """

    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (alias, anchor)
        self._lock = threading.Lock()
        # Never freed, not even while the interpreter finalizes: an anchor
        # still here then outlives gloo's last use of its alias.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._held))

    @staticmethod
    def lend(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Aliases of ``tensors`` to hand to the transport in their place:
        the same storage, no autograd history, and no C++ reference from
        anything else (a view's anchor is its own)."""
        return tuple(t.detach() for t in tensors)

    def hold(self, aliases: Sequence[torch.Tensor]) -> None:
        """Anchor ``aliases``, just handed to the transport (before the
        caller can drop its handle on the work), until it lets go."""
        self._update([(a, a.view(a.shape)) for a in aliases])

    def prune(self) -> None:
        """Drop the anchors (and aliases) the transport no longer holds."""
        self._update([])

    def _update(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with self._lock:
            done = [p for p in self._held if not _lent_out(p[0])]
            self._held[:] = [p for p in self._held if _lent_out(p[0])] + pairs
        del done  # freed outside the lock

    def outstanding(self) -> int:
        """How many aliases are anchored here."""
        with self._lock:
            return len(self._held)


LOANS = Loans()
