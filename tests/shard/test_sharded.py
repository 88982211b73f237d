"""shard / gather / reshard of pytrees on real ranks: exact round trips
(uneven and empty dims), broadcast from one rank, rules, and Sharded values."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _layouts import dims_and_shape, integer_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardax as sx
from shardax import Layout, P, Rule


def _params() -> dict:
    return {
        "emb": integer_tensor((7, 5), 1),  # uneven over 2 and 4 ranks
        "blocks": [
            {"w": integer_tensor((6, 3), 2 + i), "b": integer_tensor((3,), 9 + i)} for i in range(2)
        ],
        "scale": torch.tensor(2.0),
        "name": "gpt",
    }


def _tree_round_trip(mesh_shape: dict[str, int]) -> dict:
    mesh = sx.Mesh(mesh_shape)
    names = mesh.axis_names
    params = _params()
    rules = Rule("emb", P(names, None)) + Rule(r"blocks\.\d+\.w", P(None, names[-1]))
    sharded = sx.shard(params, mesh, rules)
    back = sx.gather(sharded)
    moved = sx.gather(sx.reshard(sharded, Rule(".*", P(names[0]))))
    return {
        "back": back,
        "moved": moved,
        "emb_local": sharded["emb"].local.clone(),
        "emb_spec": sharded["emb"].spec,
        "name": sharded["name"],
        "scale_spec": sharded["scale"].spec,
    }


@pytest.mark.parametrize(
    ("world_size", "mesh_shape"),
    [
        pytest.param(1, {"x": 1}, id="ws1"),
        pytest.param(2, {"x": 2}, id="ws2"),
        pytest.param(4, {"x": 2, "y": 2}, id="ws4", marks=pytest.mark.slow),  # 2-D: test_transfer
    ],
)
def test_gather_of_shard_is_exact_for_trees(world_size, mesh_shape):
    results = run_ranks(_tree_round_trip, mesh_shape, world_size=world_size)
    expected = _params()
    n = world_size
    sizes = [len(range(7)[r * -(-7 // n) : (r + 1) * -(-7 // n)]) for r in range(n)]
    for rank, r in enumerate(results):
        for got in (r["back"], r["moved"]):
            assert got.pop("name") == expected["name"]
            torch.testing.assert_close(
                got, {k: v for k, v in expected.items() if k != "name"}, rtol=0, atol=0
            )
        assert r["emb_local"].shape[0] == sizes[rank]
        assert r["name"] == "gpt" and r["scale_spec"] == P()


def _from_rank0(shape: tuple[int, ...]) -> list:
    mesh = sx.Mesh({"x": -1})
    full = integer_tensor(shape, 5) if mesh.rank == 0 else torch.empty(shape)
    x = sx.shard(full, mesh, P("x"), src=0)
    return [x.local.clone(), sx.gather(x)]


@pytest.mark.world_size(4)
def test_shard_from_one_rank_broadcasts():
    results = run_ranks(_from_rank0, (6, 2), world_size=4)
    dense = integer_tensor((6, 2), 5)
    for rank, (local, full) in enumerate(results):
        torch.testing.assert_close(full, dense, rtol=0, atol=0)
        torch.testing.assert_close(
            local, dense[2 * rank : 2 * rank + 2], rtol=0, atol=0
        )  # 2, 2, 2, 0 rows


@st.composite
def cases(draw):
    mesh_shape = draw(
        st.sampled_from(
            [{"a": 4}, {"a": 2, "b": 2}, {"a": 1, "b": 2, "c": 2}, {"a": 2, "b": 1, "c": 2}]
        )
    )
    dims, shape = draw(dims_and_shape(list(mesh_shape), max_len=6))
    return mesh_shape, dims, shape, draw(st.integers(0, 1000))


def _round_trip_case(mesh_shape, dims, shape, seed) -> bool:
    mesh = sx.Mesh(mesh_shape)
    x = integer_tensor(shape, seed)
    s = sx.shard(x, mesh, P.from_dim_axes(dims))
    assert s.local.shape == s.layout.local_shape(shape, mesh.rank)
    return bool(torch.equal(sx.gather(s), x))


@pytest.mark.world_size(4)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_property_gather_shard_is_identity(case):
    assert all(run_ranks(_round_trip_case, *case, world_size=4))


def test_sharded_checks_its_local_shape():
    mesh = sx.Mesh({"dp": 1})
    with pytest.raises(sx.ShardingError, match=r"must have shape \(4, 2\); got \(3, 2\)"):
        sx.Sharded(torch.ones(3, 2), Layout(mesh, P("dp")), (4, 2))
    with pytest.raises(sx.ShardingError, match="live Mesh"):
        sx.Sharded(torch.ones(4), Layout(sx.AbstractMesh({"dp": 1})), (4,))
    with pytest.raises(sx.ShardingError, match="src rank 3"):
        sx.shard(torch.ones(2), mesh, P(), src=3)


def test_reshard_across_meshes_needs_a_mesh_argument():
    a, b = sx.Mesh({"dp": 1}), sx.Mesh({"tp": 1})
    tree = {"x": sx.shard(torch.ones(2), a, P()), "y": sx.shard(torch.ones(2), b, P())}
    with pytest.raises(sx.ShardingError, match="several meshes"):
        sx.reshard(tree, P())
    moved = sx.reshard(tree, P("tp"), mesh=b)
    assert moved["x"].mesh == b and moved["x"].spec == P("tp")
