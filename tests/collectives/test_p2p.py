"""Point to point between two members of an axis, and submeshes: a
pipeline's stages talk with send/recv over ``pp`` while each stage's
parameters live on the submesh of the other axes — its ZeRO and tensor
parallel collectives stay among the ranks of its stage."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import collectives as C


def _ring_by_tags(backend: str) -> list[float]:
    """Each member sends two tagged messages to the next member, which
    receives them in the opposite order: tags, not order, match them."""
    import os

    os.environ["SHARDAX_BACKEND"] = backend
    mesh = sx.Mesh({"pp": -1}, timeout=613.0 if backend == "torch" else 614.0)
    del os.environ["SHARDAX_BACKEND"]
    n, me = mesh.size("pp"), mesh.axis_index("pp")
    first = C.send(torch.full((3,), 10.0 * me), "pp", (me + 1) % n, tag=1, mesh=mesh, async_op=True)
    second = C.send(
        torch.full((2,), 10.0 * me + 1), "pp", (me + 1) % n, tag=2, mesh=mesh, async_op=True
    )
    b = C.recv(torch.empty(2), "pp", (me - 1) % n, tag=2, mesh=mesh)
    a = C.recv(torch.empty(3), "pp", (me - 1) % n, tag=1, mesh=mesh)
    first.wait(), second.wait()
    C.barrier(mesh=mesh)  # p2p does not count as a collective: the group stays in step
    return [*a.tolist(), *b.tolist()]


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_send_and_recv_match_by_tag(backend):
    got = run_ranks(_ring_by_tags, backend, world_size=3)
    assert got == [[20.0] * 3 + [21.0] * 2, [0.0] * 3 + [1.0] * 2, [10.0] * 3 + [11.0] * 2]


def _submesh() -> list[object]:
    mesh = sx.Mesh({"dp": 2, "pp": 2})
    stage = mesh.submesh("dp")
    x = sx.shard(torch.arange(8.0).reshape(4, 2) * (1 + mesh.axis_index("pp")), stage, sx.P("dp"))
    total = C.psum(torch.tensor([float(mesh.rank)]), "dp", mesh=stage)
    return [repr(stage), stage.rank, x.local.tolist(), total.item(), sx.gather(x).sum().item()]


def test_a_submesh_runs_collectives_among_its_members():
    got = run_ranks(_submesh, world_size=4)
    # ranks (0, 2) share pp index 0, (1, 3) pp index 1
    assert [g[0] for g in got] == [
        "Mesh({'dp': 2}, members=(0, 2))",
        "Mesh({'dp': 2}, members=(1, 3))",
        "Mesh({'dp': 2}, members=(0, 2))",
        "Mesh({'dp': 2}, members=(1, 3))",
    ]
    assert [g[1] for g in got] == [0, 0, 1, 1]
    assert [g[3] for g in got] == [2.0, 4.0, 2.0, 4.0]
    assert [g[4] for g in got] == [28.0, 56.0, 28.0, 56.0]
    assert got[0][2] == [[0.0, 1.0], [2.0, 3.0]] and got[3][2] == [[8.0, 10.0], [12.0, 14.0]]


def _bad(case: str) -> str:
    mesh = sx.Mesh({"pp": -1})
    try:
        if case == "self":
            C.send(torch.ones(2), "pp", mesh.axis_index("pp"), mesh=mesh)
        elif case == "tag":
            C.send(torch.ones(2), "pp", 1 - mesh.axis_index("pp"), tag=-1, mesh=mesh)
    except sx.CollectiveError as err:
        return str(err)
    return "no error"


def test_bad_peers_and_tags_are_named():
    assert (
        "got 0" in run_ranks(_bad, "self")[0]
        and "this rank is member 0" in run_ranks(_bad, "self")[0]
    )
    assert "tag is an int >= 0; got -1" in run_ranks(_bad, "tag")[0]
