"""Collectives fail clearly: bad arguments, a missing mesh, and a collective
some rank never reaches — a timeout that names the ranks that did not arrive
(and what they are waiting in), never a silent hang."""

from __future__ import annotations

import math
import re

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import CollectiveError, CollectiveTimeoutError
from shardax import collectives as C
from shardax.mesh._groups import arrival_grace


def test_collectives_need_a_mesh():
    with pytest.raises(
        CollectiveError, match=r"psum needs a mesh: pass mesh=\.\.\. or call it inside `with mesh:`"
    ):
        C.psum(torch.ones(2), "dp")


def test_bad_arguments_raise_collective_error():
    mesh = sx.Mesh({"dp": 1})
    with mesh:
        with pytest.raises(CollectiveError, match="needs a floating dtype"):
            C.pmean(torch.ones(2, dtype=torch.int64), "dp")
        with pytest.raises(CollectiveError, match="perm"):
            C.ppermute(torch.ones(2), "dp", [(0, 1)])
        with pytest.raises(CollectiveError, match="2 sizes for 1 members"):
            C.all_gather(torch.ones(2), "dp", sizes=(1, 1))
        with pytest.raises(CollectiveError, match="has length 2 along dim 0"):
            C.all_gather(torch.ones(2), "dp", sizes=(3,))
        with pytest.raises(CollectiveError, match="must have one entry per rank"):
            C.psum_scatter(torch.ones(3), "dp", tiled=False)
        with pytest.raises(CollectiveError, match="dim 2 is out of range"):
            C.all_gather(torch.ones(2, 2), "dp", 2)
        with pytest.raises(CollectiveError, match="split_dim and concat_dim must differ"):
            C.all_to_all(torch.ones(2, 2), "dp", 0, 0)
        with pytest.raises(CollectiveError, match=r"src 2 is not in 0\.\.0"):
            C.broadcast(torch.ones(2), "dp", src=2)
        with pytest.raises(sx.MeshError, match="unknown mesh axis 'tp'"):
            C.psum(torch.ones(2), "tp")


def test_psum_out_must_fit_and_not_need_gradients():
    mesh = sx.Mesh({"dp": 1})
    x = torch.ones(4)
    with pytest.raises(CollectiveError, match=r"psum\(out=\).*out is torch.float32 \(3,\).*match"):
        C.psum(x, "dp", mesh=mesh, out=torch.empty(3))
    with pytest.raises(CollectiveError, match=r"pmean\(out=\).*not contiguous"):
        C.pmean(x, "dp", mesh=mesh, out=torch.empty(4, 2)[:, 0])
    with pytest.raises(CollectiveError, match="not differentiable"):
        C.psum(torch.ones(4, requires_grad=True), "dp", mesh=mesh, out=torch.empty(4))
    y = torch.ones(8)
    with pytest.raises(CollectiveError, match="pass out=x for in place"):
        C.psum(y[:4], "dp", mesh=mesh, out=y[4:])


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter"])
@pytest.mark.parametrize("tiled", [True, False])
def test_gather_and_scatter_out_must_fit_and_not_need_gradients(op, tiled):
    """Each misfit ``out`` is named with what the result needs; ``out`` may
    never share memory with ``x``, not even at a size-1 axis."""
    mesh = sx.Mesh({"dp": 1})
    x = torch.ones(1, 4)
    want = {True: (1, 4), False: (1, 1, 4) if op == "all_gather" else (4,)}[tiled]

    def call(out, arg=x):
        return getattr(C, op)(arg, "dp", mesh=mesh, tiled=tiled, out=out)

    result = rf"the result is torch.float32 {re.escape(str(want))} on cpu; they must match"
    with pytest.raises(
        CollectiveError, match=rf"{op}\(out=\).*out is torch.float32 \(3,\).*{result}"
    ):
        call(torch.empty(3))
    with pytest.raises(CollectiveError, match=r"out is torch.float64 .*x.new_empty"):
        call(torch.empty(want, dtype=torch.float64))
    with pytest.raises(CollectiveError, match=rf"{op}\(out=\).*not contiguous"):
        call(torch.empty(*want, 2)[..., 0])
    with pytest.raises(CollectiveError, match="not differentiable"):
        call(torch.empty(want), torch.ones(1, 4, requires_grad=True))
    with pytest.raises(CollectiveError, match="not differentiable"):
        call(torch.empty(want, requires_grad=True))
    shared = torch.ones(16)
    with pytest.raises(CollectiveError, match=rf"shares memory with x, which {op} reads.*separate"):
        call(shared[8 : 8 + math.prod(want)].view(want), shared[:4].view(1, 4))
    if want == (1, 4):
        with pytest.raises(CollectiveError, match="shares memory with x"):
            call(x)  # even where the shapes allow it


def _misfit_outs() -> list[str]:
    mesh = sx.Mesh({"x": -1})
    texts = []
    for call in (
        lambda: C.all_gather(torch.ones(3), "x", sizes=(3, 3), mesh=mesh, out=torch.empty(3)),
        lambda: C.psum_scatter(torch.ones(3, 2), "x", mesh=mesh, out=torch.empty(3, 2)),
    ):
        try:
            call()
            texts.append("no error")
        except CollectiveError as err:
            texts.append(str(err))
    return texts


@pytest.mark.world_size(2)
def test_a_misfit_out_names_this_ranks_result_shape():
    """all_gather's result is every piece; psum_scatter's this rank's
    (torch.chunk pieces of 3: 2, then 1). Raised before anything is sent."""
    for rank, (gather, scatter) in enumerate(run_ranks(_misfit_outs, world_size=2)):
        assert "all_gather(out=) over axis 'x'" in gather and "the result is" in gather
        assert "torch.float32 (6,) on cpu; they must match" in gather, gather
        assert f"the result is torch.float32 {((2, 2), (1, 2))[rank]} on cpu" in scatter, scatter


def test_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv("SHARDAX_BACKEND", "mpi")
    with pytest.raises(
        CollectiveError, match=r"unknown collective backend 'mpi'.*\('torch', 'shm', 'cupy'\)"
    ):
        C.get_backend()


def _short_timeout_mesh(shape: dict[str, int]) -> sx.Mesh:
    """A mesh whose collectives time out after 2 s, built once every rank is
    here (so slow start-up on a loaded host cannot trip the short timeout)."""
    C.barrier(mesh=sx.Mesh({"all": -1}))
    return sx.Mesh(shape, timeout=2.0)


def _timeout_text(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except CollectiveTimeoutError as err:
        return str(err)
    return "no error"


def _skip_a_collective() -> str | None:
    mesh = _short_timeout_mesh({"x": -1})
    C.psum(torch.ones(1), "x", mesh=mesh)  # everyone arrives at #0
    if mesh.rank == 1:
        return None  # rank 1 skips collective #1 (rank-local control flow)
    return _timeout_text(C.psum, torch.ones(1), "x", mesh=mesh)


@pytest.mark.world_size(2)
def test_a_skipped_collective_times_out_naming_the_missing_rank():
    messages = run_ranks(_skip_a_collective, world_size=2, reset=True)
    text = messages[0]
    assert "psum over axis 'x' of Mesh({'x': 2}) (collective #1 on ranks [0, 1])" in text
    assert "did not complete within 2 s on rank 0" in text
    assert "Ranks that did not arrive: [1]" in text and "ranks that arrived: [0]" in text
    assert messages[1] is None


def _stuck_elsewhere() -> str | None:
    mesh = _short_timeout_mesh({"x": 2, "y": 2})
    if mesh.rank == 0:  # waits for rank 2 along x
        return _timeout_text(C.psum, torch.ones(1), "x", mesh=mesh)
    if mesh.rank == 2:  # waits for rank 3 along y, which never comes
        return _timeout_text(C.all_gather, torch.ones(1), "y", sizes=(1, 1), mesh=mesh)
    return None


@pytest.mark.world_size(4)
def test_a_timeout_says_where_the_missing_rank_is_waiting():
    messages = run_ranks(_stuck_elsewhere, world_size=4, reset=True)
    assert (
        "Ranks that did not arrive: [2] (rank 2 is waiting in all_gather over axis 'y'"
        in messages[0]
    )
    assert "Ranks that did not arrive: [3]" in messages[2]
    assert messages[1] is None and messages[3] is None


def test_misused_arguments_get_clear_errors():
    mesh = sx.Mesh({"dp": 1})
    with pytest.raises(sx.MeshError, match="collectives take the axis first, then the dim"):
        C.all_gather(torch.ones(2), 0, "dp", mesh=mesh)
    with pytest.raises(CollectiveError, match="runs on a live Mesh"):
        C.psum(torch.ones(2), "dp", mesh=sx.AbstractMesh({"dp": 1}))
    with pytest.raises(CollectiveError, match="dim 0 is out of range"):
        C.all_gather(torch.tensor(1.0), "dp", mesh=mesh)
    with pytest.raises(CollectiveError, match="out of range for a new dim"):
        C.all_gather(torch.ones(2), "dp", 3, tiled=False, mesh=mesh)


def _disagree(kind: str) -> str:
    mesh = sx.Mesh({"x": -1})
    try:
        if kind == "dtype":
            C.all_gather(
                torch.ones(2, dtype=torch.float32 if mesh.rank else torch.float64), "x", mesh=mesh
            )
        elif kind == "shape":
            C.all_gather(torch.ones(2, 3 + mesh.rank), "x", 0, mesh=mesh)
        else:
            C.all_to_all(torch.ones(4 + mesh.rank, 2), "x", 0, 1, mesh=mesh)
    except CollectiveError as err:
        return str(err)
    return "no error"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["dtype", "shape", "split"])
def test_ranks_that_disagree_get_an_error_not_garbage(kind):
    for text in run_ranks(_disagree, kind, world_size=2):
        assert "the ranks disagree on dtype or on dims other than dim" in text, text


def _bystander_then_timeout() -> str | None:
    mesh = _short_timeout_mesh({"x": 4})
    C.ppermute(torch.ones(1), "x", [(0, 3)], mesh=mesh)  # ranks 1 and 2 only watch
    if mesh.rank == 2:
        return None
    return _timeout_text(C.psum, torch.ones(1), "x", mesh=mesh)


@pytest.mark.world_size(4)
def test_collective_numbers_stay_in_step_after_a_ppermute_with_bystanders():
    messages = run_ranks(_bystander_then_timeout, world_size=4, reset=True)
    for rank in (0, 1, 3):
        assert "(collective #1 on ranks [0, 1, 2, 3])" in messages[rank]
        assert "Ranks that did not arrive: [2]" in messages[rank], messages[rank]


def _transport_waits(timeout: float) -> tuple[float, float, float]:
    group = sx.Mesh({"x": -1}, timeout=timeout).group("x")
    pg_wait = group.pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return group.state.timeout, group.state.wait, pg_wait


@pytest.mark.world_size(2)
def test_the_transport_gives_up_early_enough_to_report_within_the_timeout():
    """A skipped collective is reported within the timeout, not after it: the
    transport waits the timeout less the time kept for asking who arrived."""
    for configured, wait, pg_wait in run_ranks(_transport_waits, 10.0, world_size=2):
        assert configured == 10.0
        assert wait == pytest.approx(10.0 - arrival_grace(10.0)) == pg_wait == 8.0
