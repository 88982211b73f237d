"""The shared-memory backend on real ranks: the conformance suite on it at
world sizes 2 and 4 with every dtype it reduces natively (and on torch's
gloo, which stays the path across nodes); chunking through rings smaller
than the messages; unsupported dtypes routed to gloo, never unreduced; a
rank killed mid-collective is a timeout naming it, and so is a peer that
stops between chunks; collectives in flight together on several groups,
issued without blocking; errors of queued work surfacing at ``wait()``;
no /dev/shm file left."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from _dist import RankFailed, run_ranks

import shardax as sx
from shardax import collectives as C
from shardax.collectives import _shm_backend
from shardax.collectives._backend import comm_of, get_backend, start
from shardax.collectives.conformance import ALL_DTYPES, CHECKS, run_check

pytestmark = pytest.mark.skipif(
    not _shm_backend.shm_available()[0], reason="no /dev/shm or no C++ compiler here"
)

# Distinct timeouts give each backend its own cached process groups.
TIMEOUT = {"shm": 601.0, "torch": 602.0}


def on(backend: str, check: str, shape: dict[str, int], dtypes=ALL_DTYPES) -> tuple[int, str]:
    os.environ["SHARDAX_BACKEND"] = backend
    try:
        cases = run_check(check, shape, dtypes, timeout=TIMEOUT[backend])
        return cases, sx.collectives.get_backend().name
    finally:
        del os.environ["SHARDAX_BACKEND"]


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("world_size", "shape"),
    [(2, {"x": 2}), (4, {"x": 4}), (4, {"x": 2, "y": 2})],
    ids=["ws2", "ws4", "ws4-2x2"],
)
@pytest.mark.parametrize("check", list(CHECKS))
def test_conformance_on_shm(check, world_size, shape):
    results = run_ranks(on, "shm", check, shape, world_size=world_size)
    assert {r for r in results} == {(results[0][0], "shm")} and results[0][0] > 0


@pytest.mark.world_size(4)
@pytest.mark.parametrize("check", list(CHECKS))
def test_conformance_on_gloo_stays_green(check):
    results = run_ranks(on, "torch", check, {"x": 2, "y": 2}, (torch.float32,), world_size=4)
    assert {r[1] for r in results} == {"torch"}


def done(pending) -> None:
    """Finish a backend call (works, then its fix-up)."""
    pending.wait()


def tiny_backend(slot_bytes: int, timeout: float) -> tuple:
    """A fresh backend whose slots hold ``slot_bytes`` (a ring of two chunks
    when tiny), attached to the whole world's group: ``(backend, group)``."""
    import torch.distributed as dist

    from shardax.collectives._torch_backend import TORCH_BACKEND

    mesh = sx.Mesh({"x": -1}, timeout=timeout)
    group = sx.collectives._api._group("x", mesh, "test")
    shm = _shm_backend.ShmBackend(TORCH_BACKEND, slot_mib=slot_bytes / 2**20)
    shm.slot_bytes = slot_bytes
    shm.attach(group.state, dist.distributed_c10d._get_default_store())
    # The tests drive this backend directly (one side of a collective often
    # outside ``start``), so the group's own signature check stays out of it.
    comm_of(group).check = False
    return shm, group


def chunked(slot_bytes: int) -> dict:
    """A backend with tiny slots, driven directly on this group's buffers:
    every collective goes through many chunks; compared with gloo."""
    from shardax.collectives._torch_backend import TORCH_BACKEND

    shm, group = tiny_backend(slot_bytes, 603.0)
    n, me = group.size, group.index
    g = torch.Generator().manual_seed(7 + me)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = torch.randint(-3, 4, (1000 * n + 3,), generator=g).to(dtype)
        mine, ref = x.clone(), x.clone()
        done(shm.all_reduce(mine, "sum", group))
        done(TORCH_BACKEND.all_reduce(ref, "sum", group))
        out[f"all_reduce {dtype}"] = torch.equal(mine, ref)
        rows = x[: 1000 * n].view(n, 1000)
        piece, ref_piece = torch.empty(1000, dtype=dtype), torch.empty(1000, dtype=dtype)
        done(shm.reduce_scatter(piece, rows.contiguous(), group))
        done(TORCH_BACKEND.reduce_scatter(ref_piece, rows.contiguous(), group))
        out[f"reduce_scatter {dtype}"] = torch.equal(piece, ref_piece.to(dtype))
        gathered = torch.empty(n * x.numel(), dtype=dtype)
        done(shm.all_gather(gathered, x, group))
        expected = torch.empty_like(gathered)
        done(TORCH_BACKEND.all_gather(expected, x, group))
        out[f"all_gather {dtype}"] = torch.equal(gathered, expected)
        splits = [100 * (i + 1) + me for i in range(n)]  # uneven, and different per rank
        src = torch.arange(sum(splits), dtype=torch.float64).to(dtype) + 1000 * me
        recv_splits = [100 * (me + 1) + i for i in range(n)]
        got = torch.empty(sum(recv_splits), dtype=dtype)
        done(shm.all_to_all(got, src, recv_splits, splits, group))
        want = torch.empty_like(got)
        done(TORCH_BACKEND.all_to_all(want, src, recv_splits, splits, group))
        out[f"all_to_all {dtype}"] = torch.equal(got, want)
    return out


@pytest.mark.world_size(2)
def test_messages_larger_than_a_slot_go_in_chunks():
    for result in run_ranks(chunked, 256, world_size=2):
        assert all(result.values()), result


def unsupported() -> list:
    mesh = sx.Mesh({"x": -1}, timeout=TIMEOUT["shm"])
    os.environ["SHARDAX_BACKEND"] = "shm"
    try:
        mesh = sx.Mesh({"x": -1}, timeout=604.0)
        x = torch.tensor([1, 2, 3], dtype=torch.uint8) + mesh.rank
        total = sx.collectives.psum(x, "x", mesh=mesh)
        flags = sx.collectives.pmax(torch.tensor([mesh.rank == 1]), "x", mesh=mesh)
        return [total.tolist(), flags.tolist(), get_backend().name]
    finally:
        del os.environ["SHARDAX_BACKEND"]


@pytest.mark.world_size(2)
def test_dtypes_the_core_lacks_go_to_gloo():
    for total, flags, name in run_ranks(unsupported, world_size=2):
        assert total == [3, 5, 7] and flags == [True] and name == "shm"


def hang_on_rank_1(tmp: str) -> str:
    os.environ["SHARDAX_BACKEND"] = "shm"
    try:
        mesh = sx.Mesh({"x": -1}, timeout=3.0)
        sx.collectives.psum(torch.ones(4), "x", mesh=mesh)  # segments work
        if mesh.rank == 1:
            Path(tmp, "dying").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        sx.collectives.psum(torch.ones(4), "x", mesh=mesh)
        return "no error"
    finally:
        del os.environ["SHARDAX_BACKEND"]


@pytest.mark.world_size(2)
def test_a_dead_rank_is_a_timeout_naming_it(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_ranks(hang_on_rank_1, str(tmp_path), world_size=2, reset=True)
    text = str(info.value)
    assert "CollectiveTimeoutError" in text and "Ranks that did not arrive: [1]" in text
    assert "a rank died or was stopped" in text  # noticed at once, not at the timeout


def test_no_shared_memory_file_is_left():
    """Segments are unlinked once mapped: after all the jobs above (and a
    killed rank), /dev/shm holds no shardax file."""
    run_ranks(on, "shm", "psum", {"x": 2}, (torch.float32,), world_size=2)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("shardax-")]


def no_room() -> list:
    """/dev/shm too small for a segment (as in a default Docker container):
    the group falls back to gloo instead of dying of SIGBUS later."""
    import errno

    from shardax.collectives._backend import _SHM

    backend = _SHM[0] if _SHM else get_backend("shm")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    real = os.posix_fallocate
    os.posix_fallocate = full
    os.environ["SHARDAX_BACKEND"] = "shm"
    try:
        mesh = sx.Mesh({"x": -1}, timeout=605.0)
        group = sx.collectives._api._group("x", mesh, "test")
        total = sx.collectives.psum(torch.ones(3) * (mesh.rank + 1), "x", mesh=mesh)
        return [backend._segment(group) is None, total.tolist()]
    finally:
        os.posix_fallocate = real
        del os.environ["SHARDAX_BACKEND"]


@pytest.mark.world_size(2)
def test_a_full_dev_shm_falls_back_to_gloo():
    for fell_back, total in run_ranks(no_room, world_size=2):
        assert fell_back and total == [3.0, 3.0, 3.0]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("shardax-")]


def test_queued_work_runs_in_issue_order_and_errors_surface_at_wait():
    """The worker runs work in issue order (on its thread, or on a caller
    waiting for work not yet started), holds each work's tensors until it
    has run, and hands an error to ``wait()`` without stopping the work
    queued behind it."""
    import weakref

    worker = _shm_backend._Worker()
    ran: list[int] = []
    gate = threading.Event()

    def fail() -> None:
        ran.append(1)
        raise ValueError("boom")

    held = torch.ones(3)
    alive = weakref.ref(held)
    first = worker.submit(lambda: (gate.wait(), ran.append(0)), ())
    second = worker.submit(fail, ())  # issuing never raises
    third = worker.submit(lambda: ran.append(2), (held,))
    del held
    assert ran == [] and alive() is not None  # all queued behind the gate, tensor kept
    gate.set()
    third.works[0].wait()
    assert ran == [0, 1, 2] and alive() is None
    first.works[0].wait()
    with pytest.raises(ValueError, match="boom"):
        second.works[0].wait()


def in_flight(tmp: str) -> list:
    """Collectives on two groups and on both axes, all issued by rank 0
    before any other rank issues one (so issuing cannot block), waited in
    reverse order; each compared with its synchronous self."""
    os.environ["SHARDAX_BACKEND"] = "shm"
    try:
        mesh = sx.Mesh({"x": 2, "y": 2}, timeout=606.0)
        x = torch.arange(300_000, dtype=torch.float32) * (mesh.rank + 1)  # several chunks
        ops = [
            lambda a: C.psum(x, "x", mesh=mesh, async_op=a),
            lambda a: C.psum(x, "y", mesh=mesh, async_op=a),
            lambda a: C.all_gather(x, "y", 0, sizes=(x.numel(),) * 2, mesh=mesh, async_op=a),
            lambda a: C.psum_scatter(x, ("x", "y"), 0, mesh=mesh, async_op=a),
            lambda a: C.all_to_all(x.view(4, -1), "x", 0, 1, concat_sizes=(75_000,) * 2,
                                   mesh=mesh, async_op=a),
        ]  # fmt: skip
        refs = [op(False) for op in ops]  # also makes the groups (a collective step)
        gate = Path(tmp, "issued")
        if mesh.rank != 0:
            deadline = time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if not gate.exists():  # rank 0 blocked issuing: the others must not hide it
                raise AssertionError("rank 0 did not issue its collectives without waiting")
        issue = []
        handles = []
        for op in ops:
            t0 = time.monotonic()
            handles.append(op(True))
            issue.append(time.monotonic() - t0)
        if mesh.rank == 0:
            gate.write_text(repr(issue))
        outs = [h.wait() for h in reversed(handles)][::-1]
        return [torch.equal(o, r) for o, r in zip(outs, refs, strict=True)]
    finally:
        del os.environ["SHARDAX_BACKEND"]


@pytest.mark.world_size(4)
def test_collectives_in_flight_together_on_several_groups(tmp_path):
    for result in run_ranks(in_flight, str(tmp_path), world_size=4):
        assert all(result), result


def dies_between_chunks() -> None:
    shm, group = tiny_backend(4096, 2.5)  # rings of two 2 KiB chunks
    if group.index == 1:  # four chunks, then gone
        done(shm.all_reduce(torch.ones(2_000), "sum", group))
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(20_000)  # forty chunks
    start(group, "psum", lambda _: shm.all_reduce(x, "sum", group), lambda: x).wait()


@pytest.mark.world_size(2)
def test_a_peer_dying_between_chunks_is_noticed_naming_it():
    with pytest.raises(RankFailed) as info:
        run_ranks(dies_between_chunks, world_size=2, reset=True)
    text = str(info.value)
    assert "CollectiveTimeoutError" in text and "Ranks that did not arrive: [1]" in text
    assert "a rank died or was stopped" in text  # noticed at once, not at the timeout


def stalls_between_chunks(tmp: str) -> str:
    shm, group = tiny_backend(4096, 2.0)
    failed = Path(tmp, "rank0-failed")
    if group.index == 1:  # four chunks, then waits (alive) until rank 0 gave up
        done(shm.all_reduce(torch.ones(2_000), "sum", group))
        deadline = time.monotonic() + 120
        while not failed.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return "waited"
    x = torch.ones(20_000)
    handle = start(group, "psum", lambda _: shm.all_reduce(x, "sum", group), lambda: x)
    try:
        handle.wait()
    except sx.CollectiveTimeoutError as err:
        return str(err)
    finally:
        failed.write_text("")
    return "no error"


@pytest.mark.world_size(2)
def test_a_peer_stalled_between_chunks_times_out_naming_it(tmp_path):
    text, waited = run_ranks(stalls_between_chunks, str(tmp_path), world_size=2, reset=True)
    assert waited == "waited"
    assert "did not complete within 2 s" in text and "Ranks that did not arrive: [1]" in text
