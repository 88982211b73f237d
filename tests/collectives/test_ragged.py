"""``ragged_all_to_all``: each member sends each other member its own number
of rows (zero included), on every backend; the sizes are exchanged first;
backward is the exchange back; sizes that do not fit are a typed error on
every rank, before any row moves."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import collectives as C


def _sizes(src: int, n: int) -> list[int]:
    """What member ``src`` sends each member: 0, 1 or 2 rows, some none."""
    return [(src + 2 * dst) % 3 for dst in range(n)]


def _rows(src: int, n: int) -> torch.Tensor:
    """Member ``src``'s rows: row k for member ``dst`` holds 100·src + 10·dst + k."""
    rows = [
        [100.0 * src + 10 * dst + k, -1.0]
        for dst, count in enumerate(_sizes(src, n))
        for k in range(count)
    ]
    return torch.tensor(rows).view(-1, 2)


def _exchange(backend: str) -> dict:
    import os

    os.environ["SHARDAX_BACKEND"] = backend
    mesh = sx.Mesh({"ep": -1}, timeout=615.0 if backend == "torch" else 616.0)
    del os.environ["SHARDAX_BACKEND"]
    n, me = mesh.size("ep"), mesh.axis_index("ep")
    x = _rows(me, n).requires_grad_()
    recv = C.exchange_sizes(_sizes(me, n), "ep", mesh=mesh)
    y = C.ragged_all_to_all(x, "ep", _sizes(me, n), mesh=mesh)
    (y.square().sum() / 2).backward()  # dL/dy = y: the gradient sent back is x itself
    into = torch.full((sum(recv), 2), 7.0)
    C.ragged_all_to_all(x.detach(), "ep", _sizes(me, n), recv, mesh=mesh, out=into)
    return {"recv": recv, "y": y.tolist(), "grad": x.grad.tolist(), "x": x.tolist(), "out": into}


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_uneven_rows_reach_their_members_and_gradients_come_back(backend):
    n = 3
    for me, got in enumerate(run_ranks(_exchange, backend, world_size=n)):
        want_recv = tuple(_sizes(src, n)[me] for src in range(n))
        want = [
            [100.0 * src + 10 * me + k, -1.0] for src in range(n) for k in range(want_recv[src])
        ]
        assert got["recv"] == want_recv
        assert got["y"] == want
        assert got["grad"] == got["x"]  # backward: the exchange back, sizes swapped
        assert got["out"].tolist() == want  # out=: received into the buffer


def _misfit() -> str:
    mesh = sx.Mesh({"ep": 2})
    me = mesh.axis_index("ep")
    x = torch.zeros(3, 4)
    wrong = [1, 2] if me == 0 else [2, 2]  # rank 1 sends itself one row and expects two
    try:
        C.ragged_all_to_all(x, "ep", [1, 2] if me == 0 else [2, 1], wrong, mesh=mesh)
    except sx.CollectiveMismatchError as err:
        return str(err)
    return "no error"


def test_receive_sizes_that_do_not_fit_are_an_error_on_every_rank():
    for message in run_ranks(_misfit):
        assert "the pieces do not fit" in message, message
        assert "no data was moved" in message


def test_bad_sizes_name_the_op_and_the_counts():
    mesh = sx.Mesh({"ep": 1})
    with pytest.raises(sx.CollectiveError, match=r"send_sizes \[1, 2\] must be 1 row counts"):
        C.ragged_all_to_all(torch.zeros(3, 2), "ep", [1, 2], mesh=mesh)
    with pytest.raises(sx.CollectiveError, match=r"rank 0 has length 3 along dim 0 .* expected 2"):
        C.ragged_all_to_all(torch.zeros(3, 2), "ep", [2], mesh=mesh)
    with pytest.raises(sx.CollectiveError, match=r"sends itself 3 rows but expects 2"):
        C.ragged_all_to_all(torch.zeros(3, 2), "ep", [3], [2], mesh=mesh)
    with pytest.raises(sx.CollectiveError, match=r"needs a dim 0 of rows"):
        C.ragged_all_to_all(torch.zeros(()), "ep", [0], mesh=mesh)


def test_the_transpose_is_in_the_one_table():
    from shardax.collectives._ragged import RaggedAllToAll

    group = sx.Mesh({"ep": 1}).group("ep")
    op = RaggedAllToAll(group, (3,), (2,))
    assert C.transpose(op) == RaggedAllToAll(group, (2,), (3,))  # send and receive swapped
