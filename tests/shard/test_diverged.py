"""Diverged layouts: values each rank of some axes holds its own copy of
(0/1 Adam's local steps), whose whole value is their mean. They never pass
for replicas: ``transfer`` takes the mean (a local scaling, then the
partial-sum plan), computing keeps each rank's copy, and the sum with a
rank's own update stays diverged."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import AbstractMesh, Layout, P
from shardax.errors import ShardingError
from shardax.shard._placement import role_layout


def test_a_diverged_axis_is_neither_split_nor_partial():
    mesh = AbstractMesh({"dp": 2, "tp": 2})
    layout = Layout(mesh, P("tp"), diverged="dp")
    assert layout.replicated == () and layout.diverged == ("dp",)
    assert layout.dual() == Layout(mesh, P("tp"), partial="dp")
    assert layout.settled() == Layout(mesh, P("tp"))
    assert eval(repr(layout), {"Layout": Layout, "AbstractMesh": AbstractMesh, "P": P}) == layout
    with pytest.raises(ShardingError, match=r"axis 'tp' cannot both be diverged and split a dim"):
        Layout(mesh, P("tp"), diverged="tp")
    with pytest.raises(ShardingError, match=r"axis 'dp' cannot both be diverged and be partial"):
        Layout(mesh, P(), partial="dp", diverged="dp")
    with pytest.raises(ShardingError, match=r"diverged axis 'pp' is not an axis of"):
        Layout(mesh, P(), diverged="pp")


def diverged_ranks() -> dict:
    mesh = sx.Mesh({"dp": -1})
    rank = mesh.axis_index("dp")
    own = torch.arange(8.0).reshape(4, 2) * (rank + 1)
    x = sx.Sharded(own, Layout(mesh, P(), diverged="dp"), (4, 2))
    out = {
        "gather": sx.gather(x),
        "split": sx.transfer(x, P("dp")).local,
        "partial": sx.transfer(x, Layout(mesh, P(), partial="dp")).local,
        "kept": sx.transfer(x, x.layout) is x,
        "from_replica": sx.transfer(sx.shard(own, mesh, P()), x.layout).local,
    }
    with pytest.raises(ShardingError, match=r"diverged over \['dp'\] only from a replica"):
        sx.transfer(sx.Sharded(own, Layout(mesh, P(), partial="dp"), (4, 2)), x.layout)
    leaf = own.clone().requires_grad_()
    mean = sx.transfer(sx.Sharded(leaf, x.layout, (4, 2)), P())
    (mean.local.sum() / 2).backward()  # seeded 1 / world, as value_and_grad seeds
    out["grad"] = leaf.grad
    # a rank's own update makes a replica its own; a replica's keeps a copy its own
    replica = {"w": sx.shard(torch.ones(4, 2), mesh, P())}
    mine = sx.optim.apply_updates(replica, {"w": x})
    back = sx.optim.apply_updates(mine, {"w": sx.shard(torch.ones(4, 2), mesh, P())})
    out["layouts"] = (mine["w"].layout.diverged, back["w"].layout.diverged)
    out["values"] = back["w"].local
    out["compute"] = role_layout(mine["w"], "compute").diverged
    return out


@pytest.mark.world_size(2)
def test_diverged_values_relay_as_their_mean():
    """On 2 ranks holding ``x`` and ``2x``: gathering gives ``1.5x``, a
    split gives its piece of it, a partial layout ``x / 2`` and ``x`` (their
    shares of the mean); a replica becomes diverged as it is, a pending sum
    cannot; the mean's gradient reaches each copy divided by 2; and
    ``apply_updates`` keeps a rank's own change its own."""
    x = torch.arange(8.0).reshape(4, 2)
    for rank, got in enumerate(run_ranks(diverged_ranks, world_size=2)):
        torch.testing.assert_close(got["gather"], 1.5 * x)
        torch.testing.assert_close(got["split"], 1.5 * x[2 * rank : 2 * rank + 2])
        torch.testing.assert_close(got["partial"], x * (rank + 1) / 2)
        torch.testing.assert_close(got["from_replica"], x * (rank + 1))
        torch.testing.assert_close(got["grad"], torch.full((4, 2), 0.5))
        assert got["kept"]
        assert got["layouts"] == (("dp",), ("dp",))
        assert got["compute"] == ("dp",)
        torch.testing.assert_close(got["values"], x * (rank + 1) + 2)


def test_the_plan_shows_the_mean():
    """``plan_transfer`` shows what the executor does: the copies scaled to
    their shares, then the partial plan; a replica taken as copies moves
    nothing."""
    mesh = AbstractMesh({"dp": 2, "tp": 2})
    plan = sx.plan_transfer(
        Layout(mesh, P("tp"), diverged="dp"), Layout(mesh, P(("tp", "dp"))), (8,)
    )
    assert [s.kind for s in plan.steps] == ["mean", "psum_scatter"]
    assert "mean over ('dp')" in str(plan) and "diverged=('dp',)" in str(plan)
    assert sx.plan_transfer(Layout(mesh, P()), Layout(mesh, P(), diverged="dp"), (8,)).steps == ()
