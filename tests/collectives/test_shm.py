"""The shared-memory backend on real ranks: the conformance suite on it at
world sizes 2 and 4 with every dtype it reduces natively (and on torch's
gloo, which stays the path across nodes); chunking through slots smaller
than the messages; unsupported dtypes routed to gloo, never unreduced; a
rank killed mid-collective is a timeout naming it; no /dev/shm file left."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from _dist import RankFailed, run_ranks

import shardax as sx
from shardax.collectives import _shm_backend
from shardax.collectives._backend import get_backend
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
    for work in pending.works:
        work.wait()
    if pending.after is not None:
        pending.after()


def chunked(slot_bytes: int) -> dict:
    """A backend with tiny slots, driven directly on this group's buffers:
    every collective goes through many chunks; compared with gloo."""
    from shardax.collectives._torch_backend import TORCH_BACKEND

    mesh = sx.Mesh({"x": -1}, timeout=603.0)
    group = sx.collectives._api._group("x", mesh, "test")
    shm = _shm_backend.ShmBackend(TORCH_BACKEND, slot_mib=slot_bytes / 2**20)
    shm.slot_bytes = slot_bytes
    import torch.distributed as dist

    shm.attach(group.state, dist.distributed_c10d._get_default_store())
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
