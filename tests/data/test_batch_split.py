"""``shard_batch`` on real ranks: the data ranks' local batches, in data-index
order, are the global batch; ranks that differ only along other axes hold
the same rows; a batch that does not split evenly is a clear error."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import P, ShardingError
from shardax.data import shard_batch, shard_batches

CASES = [  # world size, mesh, spec entry (the data axes)
    (2, {"dp": 2}, "dp"),
    (4, {"dp": 2, "tp": 2}, "dp"),
    (4, {"dp": 2, "tp": 2}, "tp"),
    (4, {"dp": 2, "sp": 2}, ("dp", "sp")),
    (4, {"dp": 2, "sp": 2}, ("sp", "dp")),
    (4, {"dp": 2, "tp": 2}, None),
]


def global_batches(batch_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "x": torch.arange(batch_size * 3).reshape(batch_size, 3) + 1000 * k,
            "y": torch.arange(batch_size) + 1000 * k,
            "meta": {"mask": torch.arange(batch_size) % 2 == 0},
        }
        for k in range(count)
    ]


def _local_batches(mesh_shape: dict[str, int], entry, batch_size: int) -> dict:
    mesh = sx.Mesh(mesh_shape)
    batches = global_batches(batch_size, 3)
    one = shard_batch(batches[0], mesh, P(entry))
    return {
        "one": one,
        "is_view": one["x"].untyped_storage().data_ptr()
        == batches[0]["x"].untyped_storage().data_ptr(),
        "stream": list(shard_batches(batches, mesh, P(entry))),
    }


def data_groups(mesh: sx.AbstractMesh, entry) -> list[list[int]]:
    """Ranks grouped by their index along the data axes, groups in index order."""
    axes = P(entry).axes
    size = mesh.size(axes) if axes else 1
    groups: list[list[int]] = [[] for _ in range(size)]
    for rank in range(mesh.world_size):
        groups[mesh.axis_index(axes, rank) if axes else 0].append(rank)
    return groups


def assert_split(results: list, batches: list, mesh: sx.AbstractMesh, entry) -> None:
    groups = data_groups(mesh, entry)
    for k, batch in enumerate(batches):
        for leaf in (lambda b: b["x"], lambda b: b["y"], lambda b: b["meta"]["mask"]):
            pieces = [leaf(results[g[0]]["stream"][k]) for g in groups]
            torch.testing.assert_close(torch.cat(pieces), leaf(batch), rtol=0, atol=0)
            for g in groups:  # same data coordinate: identical rows
                for r in g[1:]:
                    assert torch.equal(
                        leaf(results[r]["stream"][k]), leaf(results[g[0]]["stream"][k])
                    )


@pytest.mark.parametrize(
    ("world_size", "mesh_shape", "entry"), CASES, ids=[f"ws{w}-{m}-{e}" for w, m, e in CASES]
)
def test_local_batches_make_the_global_batch(world_size, mesh_shape, entry):
    batch_size = 8
    results = run_ranks(_local_batches, mesh_shape, entry, batch_size, world_size=world_size)
    mesh = sx.AbstractMesh(mesh_shape)
    batches = global_batches(batch_size, 3)
    assert_split(results, batches, mesh, entry)
    size = mesh.size(P(entry).axes) if P(entry).axes else 1
    for rank, result in enumerate(results):
        assert result["one"]["x"].shape == (batch_size // size, 3), rank
        assert result["is_view"], rank
        torch.testing.assert_close(result["one"], result["stream"][0], rtol=0, atol=0)


def test_world_size_one_keeps_the_whole_batch_and_other_leaves():
    mesh = sx.Mesh({"dp": 1})
    batch = {"x": torch.arange(6).reshape(3, 2), "name": "step 0", "n": 3}
    local = shard_batch(batch, mesh)
    assert torch.equal(local["x"], batch["x"])
    assert local["name"] == "step 0" and local["n"] == 3
    assert shard_batch(torch.arange(3), mesh).tolist() == [0, 1, 2]  # a bare tensor


def test_abstract_mesh_takes_the_rank_of_whose_part():
    mesh = sx.AbstractMesh({"dp": 2, "tp": 2})
    parts = [shard_batch(torch.arange(4), mesh, rank=r).tolist() for r in range(4)]
    assert parts == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_indivisible_batch_names_size_axes_sizes_mesh_and_fix():
    mesh = sx.AbstractMesh({"dp": 2, "sp": 2, "tp": 2})
    with pytest.raises(ShardingError) as err:
        shard_batch({"x": torch.zeros(6, 5)}, mesh, P(("dp", "sp")), rank=0)
    text = str(err.value)
    for fragment in (
        "6 examples",
        "('dp', 'sp')",
        "(2, 2)",
        "AbstractMesh({'dp': 2, 'sp': 2, 'tp': 2})",
        "multiple of 4",
        "4 or 8",
    ):
        assert fragment in text, (fragment, text)


BAD = [  # batch, mesh, spec, kwargs, error, message fragment
    ({"x": torch.zeros(4), "y": torch.zeros(6)}, {"dp": 2}, P("dp"), {}, ShardingError, "'x': 4"),
    ({"x": torch.tensor(1.0)}, {"dp": 2}, P("dp"), {}, ShardingError, "scalar"),
    ({"x": torch.zeros(4, 4)}, {"dp": 2, "sp": 2}, P("dp", "sp"), {}, ShardingError, "one entry"),
    ({"x": torch.zeros(4)}, {"dp": 2}, P("dq"), {}, ShardingError, "did you mean 'dp'"),
    ({"x": torch.zeros(4)}, {"dp": 2}, "dp", {}, ShardingError, "P('dp')"),
    ({"x": torch.zeros(4)}, {"dp": 2}, P("dp"), {"rank": None}, ShardingError, "pass rank="),
    ({"x": torch.zeros(4)}, {"dp": 2}, P("dp"), {"rank": 2}, ShardingError, "ranks 0..1"),
]


@pytest.mark.parametrize(("batch", "shape", "spec", "kwargs", "error", "fragment"), BAD)
def test_bad_input_is_a_clear_error(batch, shape, spec, kwargs, error, fragment):
    kwargs = {"rank": 0, **kwargs}
    with pytest.raises(error) as err:
        shard_batch(batch, sx.AbstractMesh(shape), spec, **kwargs)
    assert fragment in str(err.value), str(err.value)


def test_shard_batches_checks_before_the_first_batch():
    never = iter(())  # a bad spec fails at the call, not when iterating
    with pytest.raises(ShardingError, match="unknown mesh axis"):
        shard_batches(never, sx.Mesh({"dp": 1}), P("tp"))
