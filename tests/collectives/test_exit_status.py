"""A rank that raised exits with status 1 and its typed error, on every CPU
backend — never an abort in teardown (issue 35.3).

The ranks are real processes started here (not the worker pool, and not
the launcher, which would stop the second rank as soon as the first one
exits): each must end on its own. On the torch backend the script makes
the race behind the old abort (``terminate called without an active
exception``, SIGABRT, after the CollectiveMismatchError of a signature
exchange) happen every time — see ``scripts/mismatch_rank.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import collectives as C
from shardax.collectives import _shm_backend
from shardax.collectives._lent import LOANS, Loans
from shardax.launch import free_port

SCRIPT = Path(__file__).parent / "scripts" / "mismatch_rank.py"
BACKENDS = ["torch"] + (["shm"] if _shm_backend.shm_available()[0] else [])
CASES = ["psum-shape", "gather-vs-psum"]  # the two that aborted on gloo
TIMEOUT_S = 120.0  # the last resort: no test can hang the suite

LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the ranks' race is staged with Linux scheduling"
)


def _run_ranks(case: str, backend: str) -> list[tuple[int, str]]:
    """Start both ranks of ``case``; each one's exit status and stderr."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "SHARDAX_BACKEND": backend,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), case],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        errs = [proc.communicate(timeout=TIMEOUT_S)[1] for proc in procs]
        return [(proc.returncode, err) for proc, err in zip(procs, errs, strict=True)]
    finally:
        for proc in procs:  # leave nothing behind, even on a timeout
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@LINUX_ONLY
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_a_rank_that_raised_a_mismatch_exits_1_with_the_error(case: str, backend: str) -> None:
    for rank, (code, err) in enumerate(_run_ranks(case, backend)):
        assert code == 1, (rank, code, err[-2000:])  # not -6 (SIGABRT), not a hang
        assert "terminate called" not in err, (rank, err[-2000:])
        assert "shardax.errors.CollectiveMismatchError" in err, (rank, err[-2000:])
        assert "does not match across its ranks" in err and "no data was moved" in err


def test_lent_buffers_stay_anchored_while_the_transport_holds_them() -> None:
    """The mechanism, in one process: an alias something else still
    references (as gloo's worker does a finished work) keeps its anchor;
    once let go, the anchor goes too."""
    loans = Loans()
    x = torch.ones(4)
    (alias,) = loans.lend(x)
    assert alias.data_ptr() == x.data_ptr() and alias._use_count() == 1
    held = alias.view(2, 2)  # a C++ reference from elsewhere: the transport's
    loans.hold((alias,))
    assert alias._use_count() == 3  # its Python object, its anchor, the transport
    loans.prune()
    assert loans.outstanding() == 1
    del held
    loans.prune()
    assert loans.outstanding() == 0 and alias._use_count() == 1


def _every_op_then_anchors_left() -> int:
    """Every kind of gloo call the torch backend makes, waited for; then how
    many buffers are still anchored once gloo's threads have let go."""
    import time

    os.environ["SHARDAX_BACKEND"] = "torch"
    try:
        mesh = sx.Mesh({"x": -1}, timeout=614.0)  # its own groups, on the torch backend
    finally:
        del os.environ["SHARDAX_BACKEND"]
    x = torch.arange(6.0) + mesh.rank
    C.psum(x, "x", mesh=mesh)
    C.psum(x, "x", mesh=mesh, async_op=True).wait()
    C.all_gather(x, "x", mesh=mesh)
    C.psum_scatter(x, "x", mesh=mesh)
    C.all_to_all(x.reshape(2, 3), "x", 0, 1, mesh=mesh)
    C.broadcast(x, "x", src=1, mesh=mesh)
    C.ppermute(x, "x", [(0, 1), (1, 0)], mesh=mesh)
    if mesh.rank == 0:
        C.send(x, "x", 1, mesh=mesh)
    else:
        C.recv(torch.empty(6), "x", 0, mesh=mesh)
    deadline = time.monotonic() + 30.0  # gloo's thread lets go of the last work at its pace
    while LOANS.outstanding() and time.monotonic() < deadline:
        time.sleep(0.01)
        LOANS.prune()
    return LOANS.outstanding()


@pytest.mark.world_size(2)
def test_anchors_do_not_outlive_gloos_use_of_the_buffers() -> None:
    """Anchoring must not keep buffers alive: once gloo has let go of every
    finished work, nothing is anchored any more (a doubly anchored send, as
    point to point once made, would stay forever)."""
    assert run_ranks(_every_op_then_anchors_left, world_size=2) == [0, 0]


def _anchored_after_waiting_a_ppermute() -> list[int]:
    """How many buffers are anchored right after each wait of an async
    ``ppermute`` (point to point: the works are the caller's alone)."""
    os.environ["SHARDAX_BACKEND"] = "torch"
    try:
        mesh = sx.Mesh({"x": -1}, timeout=615.0)
    finally:
        del os.environ["SHARDAX_BACKEND"]
    x, into = torch.arange(2.0**16) + mesh.rank, torch.empty(2**16)
    left = []
    for _ in range(3):
        C.ppermute(x, "x", [(0, 1), (1, 0)], mesh=mesh, out=into, async_op=True).wait()
        left.append(LOANS.outstanding())
    return left


@pytest.mark.world_size(2)
def test_a_waited_ppermute_leaves_nothing_anchored() -> None:
    """Once ``wait()`` returns, nothing of a point-to-point collective stays
    anchored: its buffers are freed as soon as the caller drops them, not
    one collective later (a ring's last received block once outlived the
    ring, held by the wait loop's last work)."""
    assert run_ranks(_anchored_after_waiting_a_ppermute, world_size=2) == [[0, 0, 0]] * 2
