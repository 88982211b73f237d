"""Collectives agree before they move data: every mismatch between the ranks
of a group — op, reduction, dtype (of the same bytes too), element count, a
skipped collective — raises CollectiveMismatchError on every rank, naming
each rank's side, on both CPU backends; never a wrong number, a hang or an
abort."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import CollectiveMismatchError
from shardax import collectives as C
from shardax.collectives import _agree, _shm_backend

BACKENDS = ["torch"] + (["shm"] if _shm_backend.shm_available()[0] else [])
# Distinct timeouts give each backend its own cached process groups.
TIMEOUT = {"shm": 611.0, "torch": 612.0}


def _mesh(backend: str) -> sx.Mesh:
    os.environ["SHARDAX_BACKEND"] = backend
    try:
        return sx.Mesh({"x": -1}, timeout=TIMEOUT[backend])
    finally:
        del os.environ["SHARDAX_BACKEND"]


def _one_side(mesh: sx.Mesh, case: str) -> torch.Tensor:
    """What rank ``mesh.rank`` issues in ``case``; rank 0 always a float32 psum
    of 8 elements (or its stand-in), rank 1 the odd one out."""
    odd = mesh.rank == 1
    x = torch.ones(8)
    if case == "psum-vs-pmax":
        return C.pmax(x, "x", mesh=mesh) if odd else C.psum(x, "x", mesh=mesh)
    if case == "float32-vs-int32":  # the same bytes: a silent wrong sum without the check
        return C.psum(x.to(torch.int32) if odd else x, "x", mesh=mesh)
    if case == "float32-vs-bool":  # the shm backend takes one, gloo the other
        return C.psum(x.bool() if odd else x, "x", mesh=mesh)
    if case == "shape":
        return C.psum(torch.ones(9) if odd else x, "x", mesh=mesh)
    if case == "gather-vs-psum":
        return C.all_gather(x, "x", mesh=mesh) if odd else C.psum(x, "x", mesh=mesh)
    if case == "scatter-dtype":
        return C.psum_scatter(x.double() if odd else x, "x", mesh=mesh)
    if case == "broadcast-root":
        return C.broadcast(x, "x", src=1 if odd else 0, mesh=mesh)
    raise AssertionError(case)


def _mismatch(backend: str, case: str) -> tuple[str, str, list[float]]:
    mesh = _mesh(backend)
    try:
        _one_side(mesh, case)
    except sx.CollectiveError as err:
        outcome = (type(err).__name__, str(err))
    else:
        outcome = ("no error", "")
    # The group is still usable afterwards, in step on every rank.
    after = C.psum(torch.full((3,), float(mesh.rank + 1)), "x", mesh=mesh)
    return (*outcome, after.tolist())


CASES = {
    "psum-vs-pmax": ["op", "psum (collective", "pmax (collective", "reduction"],
    "float32-vs-int32": ["dtype", "of float32 (8,)", "of int32 (8,)"],
    "float32-vs-bool": ["dtype", "of float32 (8,)", "of bool (8,)"],
    "shape": ["element count", "float32 (8,)", "float32 (9,)"],
    "gather-vs-psum": ["op", "all_gather (collective", "psum (collective"],
    "scatter-dtype": ["dtype", "float64", "float32"],
    "broadcast-root": ["root", "root 0", "root 1"],
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_mismatch_raises_on_every_rank_and_moves_nothing(backend, case):
    results = run_ranks(_mismatch, backend, case, world_size=2)
    for rank, (kind, text, after) in enumerate(results):
        assert kind == "CollectiveMismatchError", (rank, kind, text)
        assert "does not match across its ranks" in text and "no data was moved" in text
        assert "rank 0" in text and "rank 1" in text and f"rank {rank} (this rank)" in text
        assert "over axis 'x'" in text
        for needle in CASES[case]:
            assert needle in text, (rank, needle, text)
        assert after == [3.0, 3.0, 3.0], "the group must stay usable and in step"


def _uneven_all_to_all(backend: str) -> tuple[str, str]:
    """The backend call itself with pieces that do not fit (as a buggy caller
    of the backend would make): rank 0 sends 2 elements to rank 1, which
    expects 3."""
    from shardax.collectives._backend import start

    mesh = _mesh(backend)
    group = mesh.group("x")
    send = torch.ones(4)
    recv = torch.empty(5 if mesh.rank else 4)
    out_splits = [3, 2] if mesh.rank else [2, 2]
    in_splits = [2, 2]
    try:
        start(
            group, "all_to_all",
            lambda b: b.all_to_all(recv, send, out_splits, in_splits, group), lambda: recv,
        ).wait()  # fmt: skip
    except sx.CollectiveError as err:
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.world_size(2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_to_all_pieces_that_do_not_fit_are_named(backend):
    for kind, text in run_ranks(_uneven_all_to_all, backend, world_size=2):
        assert kind == "CollectiveMismatchError", text
        assert "the pieces do not fit" in text
    kind, text = run_ranks(_uneven_all_to_all, backend, world_size=2)[1]
    assert "rank 0 sends 2 elements to rank 1, which expects 3" in text


def _named(backend: str) -> str:
    mesh = _mesh(backend)
    with _agree.moving("blocks.3.attn.qkv.weight"):
        try:
            _one_side(mesh, "float32-vs-int32")
        except CollectiveMismatchError as err:
            return str(err)
    return "no error"


@pytest.mark.world_size(2)
def test_a_mismatch_names_the_key_path_being_moved():
    for text in run_ranks(_named, BACKENDS[-1], world_size=2):
        assert "moving blocks.3.attn.qkv.weight" in text, text


def test_the_switch_reads_its_variable(monkeypatch):
    monkeypatch.setenv("SHARDAX_CHECK_COLLECTIVES", "0")
    assert not _agree.checks_enabled("gloo")
    monkeypatch.setenv("SHARDAX_CHECK_COLLECTIVES", "1")
    assert _agree.checks_enabled("nccl")
    monkeypatch.setenv("SHARDAX_CHECK_COLLECTIVES", "auto")
    assert _agree.checks_enabled("shm") and not _agree.checks_enabled("nccl")
    monkeypatch.setenv("SHARDAX_CHECK_COLLECTIVES", "maybe")
    with pytest.raises(sx.CollectiveError, match=r"SHARDAX_CHECK_COLLECTIVES='maybe'.*use 1"):
        _agree.checks_enabled("gloo")


@pytest.mark.skipif("shm" not in BACKENDS, reason="no /dev/shm or no C++ compiler here")
def test_shared_memory_signatures_meet_in_the_segment_and_stay_in_step(tmp_path):
    """``sx_agree`` itself, two members as two threads of this process over
    one segment: rounds that agree return 0 with every row; a round that
    differs returns -5 to both with both rows (so both raise, and neither
    moves data); the rounds after it agree again (the two signature buffers
    alternate without one member overwriting what the other still reads)."""
    import ctypes
    import threading
    import uuid

    path = f"/dev/shm/shardax-test-{uuid.uuid4().hex}"
    segs = [_shm_backend._Segment(path, 2, 0, 4096, create=True)]
    try:
        segs.append(_shm_backend._Segment(path, 2, 1, 4096, create=False))
    finally:
        os.unlink(path)
    lib = _shm_backend._lib()
    for seg in segs:
        seg.control.timeout_us = 60_000_000
        seg.pids[0] = seg.pids[1] = os.getpid()
    rounds = [(7, 7), (8, 8), (9, 9), (10, 11), (12, 12), (13, 13)]  # member 1 differs once
    got: list[list[tuple[int, list[int]]]] = [[], []]

    def member(me: int) -> None:
        for values in rounds:
            sig = [values[me]] * _agree.WIDTH
            mine = (ctypes.c_int64 * _agree.WIDTH)(*sig)
            table = (ctypes.c_int64 * (2 * _agree.WIDTH))()
            code = lib.sx_agree(segs[me].ref, mine, _agree.WIDTH, _agree.AGREED, table)
            got[me].append((code, [table[0], table[_agree.WIDTH]]))

    threads = [threading.Thread(target=member, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = [(-5 if a != b else 0, [a, b]) for a, b in rounds]
    assert got == [expected, expected]
