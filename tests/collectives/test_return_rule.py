"""One return rule for every collective that returns a tensor, on real ranks:
``out=`` (written and returned), ``async_op=True`` (a Handle whose ``wait()``
returns the result) and both give the plain call's result, bit for bit, on
gloo and on shared memory (the conformance check ``out_and_async``, every op,
dtype and axis set); and an ``out`` that does not fit is a typed error that
names the op, the axis and the result's shape — raised before anything moves,
on every rank alike."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import collectives as C
from shardax.collectives import _shm_backend
from shardax.collectives._backend import comm_of
from shardax.collectives.conformance import ALL_DTYPES, DTYPES, run_check

# Distinct timeouts give each backend its own process groups (the backend is
# fixed when a group is made).
TIMEOUT = {"torch": 651.0, "shm": 652.0}


def _by_the_rule(backend: str) -> tuple[int, str]:
    os.environ["SHARDAX_BACKEND"] = backend
    try:
        dtypes = ALL_DTYPES if backend == "shm" else DTYPES
        cases = run_check("out_and_async", {"x": -1}, dtypes, timeout=TIMEOUT[backend])
        mesh = sx.Mesh({"x": -1}, timeout=TIMEOUT[backend])
        return cases, comm_of(mesh.group("x")).backend.name
    finally:
        del os.environ["SHARDAX_BACKEND"]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "shm",
            marks=pytest.mark.skipif(
                not _shm_backend.shm_available()[0], reason="no /dev/shm or no C++ compiler here"
            ),
        ),
    ],
)
def test_every_op_by_the_return_rule(backend):
    results = run_ranks(_by_the_rule, backend, world_size=2)
    assert results[0][0] > 0 and set(results) == {(results[0][0], backend)}, results


def test_every_op_by_the_return_rule_on_one_rank():
    assert run_check("out_and_async", {"x": 1}) == len(DTYPES)


# -- an out that does not fit ------------------------------------------------------------


def _ops(n: int, rank: int) -> list[tuple[str, torch.Tensor, tuple[int, ...], object]]:
    """``(op, x, this rank's result shape, call(x, **kw))`` for every op."""
    piece = C.chunk_sizes(2 * n + 1, n)[rank]
    ring = [(i, (i + 1) % n) for i in range(n)]
    return [
        ("psum", torch.ones(4, 3), (4, 3), lambda x, **k: C.psum(x, "x", **k)),
        ("pmean", torch.ones(4, 3), (4, 3), lambda x, **k: C.pmean(x, "x", **k)),
        ("pmax", torch.ones(4, 3), (4, 3), lambda x, **k: C.pmax(x, "x", **k)),
        ("pmin", torch.ones(4, 3), (4, 3), lambda x, **k: C.pmin(x, "x", **k)),
        ("all_gather", torch.ones(2, 3), (2 * n, 3), lambda x, **k: C.all_gather(x, "x", **k)),
        ("psum_scatter", torch.ones(2 * n + 1, 3), (piece, 3),
         lambda x, **k: C.psum_scatter(x, "x", **k)),
        ("all_to_all", torch.ones(n, 3), (1, 3 * n), lambda x, **k: C.all_to_all(x, "x", 0, 1, **k)),
        ("ppermute", torch.ones(2, 3), (2, 3), lambda x, **k: C.ppermute(x, "x", ring, **k)),
        ("broadcast", torch.ones(2, 3), (2, 3), lambda x, **k: C.broadcast(x, "x", **k)),
    ]  # fmt: skip


def _error(call) -> str:
    try:
        call()
    except sx.CollectiveError as err:
        return str(err)
    return "no error"


def _misfits() -> list[tuple[str, str, str]]:
    """``(op, what was wrong, the error's text)`` for each op and misfit."""
    mesh = sx.Mesh({"x": -1}, timeout=653.0)
    n = mesh.size()
    got = []
    with mesh:
        for name, x, shape, fn in _ops(n, mesh.rank):
            strided = torch.empty(*shape, 2)[..., 0]  # the right shape, not contiguous
            bad = {
                "shape": torch.empty(5, 7),
                "dtype": torch.empty(shape, dtype=torch.float64),
                "device": torch.empty(shape, device="meta"),
                "strides": strided,
            }
            for what, out in bad.items():
                got.append((name, what, _error(lambda fn=fn, x=x, out=out: fn(x, out=out))))
            later = _error(lambda fn=fn, x=x: fn(x, out=torch.empty(5, 7), async_op=True))
            got.append((name, "shape, async", later))  # raised by the call, not by wait()
            w = x.clone().requires_grad_()
            got.append(
                (name, "grad", _error(lambda fn=fn, w=w, s=shape: fn(w, out=torch.empty(s))))
            )
        y = torch.ones(2, 3)
        got.append(("ppermute", "out=x", _error(lambda: C.ppermute(y, "x", [(0, 0)], out=y))))
        whole = torch.ones(2 * n, 3)  # the result's shape, x a view of it
        gather = _error(lambda: C.all_gather(whole[:2], "x", out=whole))
        got.append(("all_gather", "out=x", gather))
        total = C.psum(y, "x", out=y)  # the reductions and broadcast: in place
        got.append(("psum", "out=x in place", "ok" if total is y and y[0, 0] == n else "wrong"))
    return got


@pytest.mark.world_size(2)
def test_an_out_that_does_not_fit_names_the_op_the_axis_and_the_shape():
    for rank, texts in enumerate(run_ranks(_misfits, world_size=2)):
        results = {name: dict() for name, _, _ in texts}
        for name, what, text in texts:
            results[name][what] = text
        for name, x, shape, _ in _ops(2, rank):
            where = f"{name}(out=) over axis 'x' of Mesh({{'x': 2}})"
            result = f"the result is {x.dtype} {shape} on cpu; they must match"
            for what in ("shape", "dtype", "device", "shape, async"):
                text = results[name][what]
                assert where in text and result in text, (rank, name, what, text)
            assert f"x.new_empty({shape})" in results[name]["shape"]
            assert where in results[name]["strides"], results[name]["strides"]
            assert (
                f"not contiguous; pass a contiguous tensor of the result's shape {shape}"
                in (results[name]["strides"])
            )
            assert "out= is not differentiable" in results[name]["grad"], results[name]["grad"]
        assert "ppermute(out=) over axis 'x'" in results["ppermute"]["out=x"]
        assert "shares memory with x" in results["ppermute"]["out=x"]
        assert "shares memory with x" in results["all_gather"]["out=x"]
        assert results["psum"]["out=x in place"] == "ok"
