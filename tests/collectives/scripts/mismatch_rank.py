"""One rank of a job whose collective does not match across its ranks
(``python mismatch_rank.py CASE``, started by ``shardax launch`` or by hand
with its environment): rank 0 issues its side of CASE, rank 1 the other,
and the CollectiveMismatchError is left uncaught. The rank must exit with
status 1 and the error on stderr — never abort in teardown.

On the torch backend (gloo) the race behind that abort
(shardax/collectives/_lent.py) is made to happen every time, where Linux
lets this process use SCHED_FIFO:

1. The main thread runs at SCHED_FIFO and every thread shares its CPU, so
   gloo's worker runs only while the main thread waits: it still holds the
   finished signature exchange when the main thread drops its handle and
   raises.
2. An exit hook waits *holding* the GIL: the worker runs, drops that work,
   and (its tensors having Python objects) waits for the GIL.
3. No switch interval ends that wait, and while the interpreter finalizes
   ``_Finalizing`` releases the GIL: without the fix, the worker takes it
   then, is ended by Python inside a C++ destructor, and the process aborts.

With the fix, shardax's own exit hook has waited for the worker before.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time

import torch

import shardax as sx
from shardax import collectives as C


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _main_thread_first(rank: int) -> None:
    """Every thread of this process on one CPU (the rank's own), where the
    main thread preempts the others and keeps the CPU until it waits:
    SCHED_FIFO for it where permitted, else SCHED_IDLE for the others
    (which then still get a sliver of the CPU)."""
    me = threading.get_native_id()
    cpus = sorted(os.sched_getaffinity(0))
    cpu = {cpus[rank % len(cpus)]}
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        fifo = True
    except OSError:  # not permitted here
        fifo = False
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpu)
            if tid != me and not fifo:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # a thread that ended meanwhile
            pass


def _hold_the_gil_while_others_run() -> None:
    """An exit hook: the main thread waits 50 ms *holding* the GIL (a C call
    made through ``ctypes.PyDLL`` keeps it), so that gloo's worker runs now
    and, to drop the work it finished, asks for the GIL and waits for it."""
    ctypes.PyDLL(None).usleep(50_000)


class _Finalizing:
    """Dropped when the interpreter clears this module, while it finalizes:
    then the main thread sleeps, releasing the GIL to whoever waits for it."""

    def __init__(self) -> None:
        self._sleep = time.sleep  # bound now: the module's globals are gone by then

    def __del__(self) -> None:
        self._sleep(0.05)


def main(case: str) -> None:
    sx.init()
    mesh = sx.Mesh({"x": -1})
    if sys.platform.startswith("linux") and os.environ.get("SHARDAX_BACKEND") == "torch":
        _main_thread_first(mesh.rank)
        sys.setswitchinterval(1000.0)  # a thread waiting for the GIL never forces a switch
        atexit.register(_hold_the_gil_while_others_run)
        global _FINALIZING
        _FINALIZING = _Finalizing()
    odd = mesh.rank == 1
    x = torch.ones(4)
    print(f"rank {mesh.rank} issues its side of {case}", flush=True)
    if case == "psum-shape":  # psum of 4 elements meets psum of 6
        C.psum(torch.ones(6) if odd else x, "x", mesh=mesh)
    elif case == "gather-vs-psum":  # all_gather meets psum
        C.all_gather(x, "x", mesh=mesh) if odd else C.psum(x, "x", mesh=mesh)
    else:
        raise SystemExit(f"unknown case {case!r}")
    print("no error", flush=True)


_FINALIZING: _Finalizing | None = None

if __name__ == "__main__":
    main(sys.argv[1])
