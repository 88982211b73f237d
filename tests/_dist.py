"""Persistent worker pools for multi-process tests, one per world size.

``run_ranks(fn, *args, world_size=2)`` runs ``fn(*args)`` on every rank of a
gloo job and returns the ranks' results (rank order). ``fn`` is a
module-level function; results are picklable (CPU tensors, numbers, text).
World size 1 runs in this process, with no process group.

Workers start once (spawn), join gloo through a fresh FileStore (no ports),
use one thread, and register faulthandler on SIGUSR1. A job past its deadline
gets its stacks dumped and the pool killed; a job where any rank raised kills
the pool too (its process group is suspect). Either way the next job starts a
fresh pool.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

GLOO_TIMEOUT = 30.0
JOB_TIMEOUT = 180.0


class RankFailed(Exception):
    """One or more ranks raised; ``errors[rank]`` is each rank's exception."""

    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]) -> None:
        self.errors = errors
        self.tracebacks = tracebacks
        text = "\n".join(f"--- rank {r} ---\n{tb.rstrip()}" for r, tb in sorted(tracebacks.items()))
        super().__init__(f"{len(errors)} rank(s) failed: {sorted(errors)}\n{text}")


def _resolve(module: str, path: str | None, qualname: str) -> Any:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if path is None:
                raise
            spec = importlib.util.spec_from_file_location(module, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, world: int, store: str, conn: Any, log: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    out = open(log, "w", buffering=1)  # noqa: SIM115
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=GLOO_TIMEOUT),
    )
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        module, path, qualname, args, kwargs = msg
        try:
            result = _resolve(module, path, qualname)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as err:
            tb = traceback.format_exc()
            try:
                conn.send(("err", err, tb))
            except Exception:  # unpicklable exception: send its text
                conn.send(("err", RuntimeError(f"{type(err).__name__}: {err}"), tb))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world: int) -> None:
        self.world = world
        self.dir = tempfile.mkdtemp(prefix=f"shardax-pool{world}-")
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.logs = [], [], []
        store = os.path.join(self.dir, "store")
        for rank in range(world):
            parent, child = ctx.Pipe()
            log = os.path.join(self.dir, f"rank{rank}.log")
            proc = ctx.Process(
                target=_worker_main, args=(rank, world, store, child, log), daemon=True
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.logs.append(log)
        self._collect("start-up", JOB_TIMEOUT)

    def log_tail(self, rank: int, lines: int = 60) -> str:
        try:
            with open(self.logs[rank]) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _collect(self, what: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        tbs: dict[int, str] = {}
        pending = dict(enumerate(self.conns))
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                self._dump_stacks()
                stacks = "\n".join(
                    f"--- rank {r} (stacks, log tail) ---\n{self.log_tail(r)}" for r in pending
                )
                self.kill()
                raise TimeoutError(
                    f"{what}: ranks {sorted(pending)} did not finish within {timeout:.0f} s\n{stacks}"
                )
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = ("err", RuntimeError(f"rank {rank} died"), self.log_tail(rank))
                del pending[rank]
                if msg[0] == "err":
                    errors[rank], tbs[rank] = msg[1], msg[2]
                else:
                    results[rank] = msg[1]
        if errors:
            self.kill()
            raise RankFailed(errors, tbs)
        return [results[r] for r in range(self.world)]

    def run(
        self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> list[Any]:
        path = getattr(sys.modules.get(fn.__module__), "__file__", None)
        msg = (fn.__module__, path, fn.__qualname__, args, kwargs)
        for conn in self.conns:
            conn.send(msg)
        return self._collect(f"{fn.__qualname__} on {self.world} ranks", timeout)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _dump_stacks(self) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)  # let faulthandler write

    def kill(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        for p in self.procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.procs = []


_POOLS: dict[int, _Pool] = {}


def run_ranks(
    fn: Any,
    *args: Any,
    world_size: int = 2,
    timeout: float = JOB_TIMEOUT,
    reset: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; their results.

    ``reset=True`` retires the pool afterwards (for jobs that leave process
    groups broken on purpose, e.g. timeouts).
    """
    if world_size == 1:
        return [fn(*args, **kwargs)]
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        for other in list(_POOLS):  # keep one pool alive at a time: memory
            _POOLS.pop(other).kill()
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        results = pool.run(fn, args, kwargs, timeout)
    except BaseException:
        reset = True
        raise
    finally:
        if reset:
            _POOLS.pop(world_size, None)
            if pool.procs:
                pool.kill()
    return results


def shutdown_pools() -> None:
    for ws in list(_POOLS):
        _POOLS.pop(ws).kill()
