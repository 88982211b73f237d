"""``shard_batch`` on real ranks: the data ranks' local batches, in data-index
order, are the global batch; ranks that differ only along other axes hold
the same rows; a batch that does not split evenly is a clear error. A second
spec entry splits the sequence (dim 1), in contiguous chunks or zigzag, and
the pieces of all ranks make the global batch again."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import P, ShardingError, zigzag
from shardax.data import Sampler, TextDataset, batches, shard_batch, shard_batches

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
    (
        {"x": torch.zeros(4, 4, 4)},
        {"dp": 2, "sp": 2},
        P("dp", None, "sp"),
        {},
        ShardingError,
        "at most two entries",
    ),
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


# -- the sequence split (context parallelism) ---------------------------------------
SEQ_CASES = [  # mesh, spec
    ({"dp": 2, "cp": 2}, P("dp", zigzag("cp"))),
    ({"dp": 2, "cp": 2, "tp": 2}, P("dp", zigzag("cp"))),
    ({"cp": 4, "dp": 2}, P("dp", zigzag("cp"))),
    ({"dp": 2, "cp": 2, "sp": 2}, P("dp", zigzag("cp", "sp"))),
    ({"dp": 2, "cp": 2}, P(None, zigzag("cp"))),
    ({"dp": 1, "cp": 1}, P("dp", zigzag("cp"))),
    ({"dp": 2, "cp": 2}, P("dp", "cp")),
    ({"dp": 2, "cp": 2, "tp": 2}, P("dp", ("tp", "cp"))),
    ({"dp": 2, "cp": 2}, P(("dp", "cp"), None)),  # no sequence entry: dim 1 whole
]


def token_batch(batch_size: int = 4, seq_len: int = 16) -> dict:
    return {
        "x": torch.arange(batch_size * seq_len).reshape(batch_size, seq_len),
        "h": torch.randn(batch_size, seq_len, 3, generator=torch.Generator().manual_seed(0)),
        "id": torch.arange(batch_size),
        "step": 7,
    }


def seq_positions(length: int, n: int, i: int, zigzag_split: bool) -> torch.Tensor:
    """The global positions of member i's tokens, written out independently of
    the library: zigzag holds chunks i and 2n-1-i of 2n, in that order."""
    if not zigzag_split:
        return torch.arange(i * length // n, (i + 1) * length // n)
    c = length // (2 * n)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c), torch.arange((2 * n - 1 - i) * c, (2 * n - i) * c)]
    )


@pytest.mark.parametrize(("shape", "spec"), SEQ_CASES, ids=[f"{m}-{s}" for m, s in SEQ_CASES])
def test_every_ranks_sequence_piece_reassembles_the_global_batch(shape, spec):
    mesh = sx.AbstractMesh(shape)
    batch = token_batch()
    entries = [*spec, None, None]
    data_axes, seq_axes = P(entries[0]).axes, P(entries[1]).axes
    is_zigzag = isinstance(entries[1], sx.Zigzag)
    n = mesh.size(seq_axes) if seq_axes else 1
    rebuilt = {k: torch.full_like(batch[k], -1) for k in ("x", "h")}
    pieces: dict[tuple[int, int], dict] = {}
    for rank in range(mesh.world_size):
        local = shard_batch(batch, mesh, spec, rank=rank)
        d = mesh.axis_index(data_axes, rank) if data_axes else 0
        i = mesh.axis_index(seq_axes, rank) if seq_axes else 0
        rows = slice(d * 4 // mesh.size(data_axes), (d + 1) * 4 // mesh.size(data_axes))
        positions = seq_positions(16, n, i, is_zigzag)
        assert local["step"] == 7
        assert torch.equal(local["id"], batch["id"][rows])  # one dim: a value per example
        for k in ("x", "h"):
            assert local[k].shape[1] == 16 // n
            torch.testing.assert_close(local[k], batch[k][rows][:, positions], rtol=0, atol=0)
            rebuilt[k][rows, positions] = local[k]
        if (d, i) in pieces:  # ranks that differ only along other axes: the same data
            torch.testing.assert_close(local, pieces[d, i], rtol=0, atol=0)
        pieces[d, i] = local
    for k in ("x", "h"):
        torch.testing.assert_close(rebuilt[k], batch[k], rtol=0, atol=0)


def test_a_sequence_piece_is_a_view_where_its_chunks_touch_else_a_copy():
    mesh = sx.AbstractMesh({"dp": 2, "cp": 2})
    batch = token_batch()
    ptr = batch["x"].untyped_storage().data_ptr()
    plain = shard_batch(batch, mesh, P("dp", "cp"), rank=3)["x"]
    assert plain.untyped_storage().data_ptr() == ptr
    zig = shard_batch(batch, mesh, P("dp", zigzag("cp")), rank=2)["x"]  # cp 0: chunks 0 and 3
    assert zig.untyped_storage().data_ptr() != ptr and zig.is_contiguous()
    assert zig.tolist() == [[32, 33, 34, 35, 44, 45, 46, 47], [48, 49, 50, 51, 60, 61, 62, 63]]
    middle = shard_batch(batch, mesh, P("dp", zigzag("cp")), rank=3)["x"]  # chunks 1, 2 touch
    assert middle.untyped_storage().data_ptr() == ptr
    assert middle.tolist() == [[36, 37, 38, 39, 40, 41, 42, 43], [52, 53, 54, 55, 56, 57, 58, 59]]


SEQ_BAD = [  # batch, mesh, spec, message fragments
    (
        {"x": torch.zeros(4, 8)},
        {"dp": 2, "cp": 2, "tp": 2},
        P("dp", "cp", "tp"),
        ["at most two entries", "P('dp', 'cp', 'tp')", "Use P('dp', 'cp')"],
    ),
    (
        {"x": torch.zeros(4, 4), "ids": {"tok": torch.zeros(4, 6)}},
        {"dp": 2, "cp": 4},
        P("dp", "cp"),
        ["'ids.tok'", "of 6", "('cp',)", "multiple of 4", "4 or 8", "pad or trim"],
    ),
    (
        {"x": torch.zeros(4, 7)},
        {"dp": 2, "cp": 2},
        P("dp", zigzag("cp")),
        ["'x'", "of 7", "zigzag", "('cp',)", "multiple of 4", "4 or 8"],
    ),
    (  # one member still cuts 2 chunks: the same lengths work at every size
        {"x": torch.zeros(4, 5)},
        {"cp": 1},
        P(None, zigzag("cp")),
        ["'x'", "of 5", "multiple of 2", "4 or 6"],
    ),
    (
        {"x": torch.zeros(4, 8)},
        {"dp": 2, "cp": 2},
        P(zigzag("dp"), "cp"),
        ["dim 0 of a batch", "P('dp', zigzag('cp'))"],
    ),
    (
        {"x": torch.zeros(4, 8)},
        {"dp": 2, "cp": 2},
        P("dp", sx.blocks(2, "cp")),
        ["dim 1 of a batch", "blocks(2, 'cp')"],
    ),
    ({"x": torch.zeros(4, 8)}, {"dp": 2, "cp": 2}, P("dp", zigzag("cq")), ["did you mean 'cp'"]),
]


@pytest.mark.parametrize(("batch", "shape", "spec", "fragments"), SEQ_BAD)
def test_a_bad_sequence_split_is_a_clear_error(batch, shape, spec, fragments):
    with pytest.raises(ShardingError) as err:
        shard_batch(batch, sx.AbstractMesh(shape), spec, rank=0)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_shard_batches_splits_the_sequence_of_each_batch():
    mesh = sx.AbstractMesh({"dp": 2, "cp": 2})
    spec = P("dp", zigzag("cp"))
    loader = [token_batch(), {k: v + 1 for k, v in token_batch().items()}]
    got = list(shard_batches(loader, mesh, spec, rank=2))
    want = [shard_batch(b, mesh, spec, rank=2) for b in loader]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [P("dp", zigzag("cp")), P("dp", "cp")], ids=["zigzag", "chunks"])
def test_batches_of_a_sampler_split_the_sequence_as_shard_batch_does(spec):
    """The sampler picks the examples (dim 0); batches cuts the sequence of
    each loaded batch: the same as shard_batch of the whole global batch."""
    data = TextDataset("It is a truth universally acknowledged, that a single man " * 4, seq_len=8)
    mesh = sx.AbstractMesh({"dp": 2, "cp": 2})
    for rank in range(mesh.world_size):
        sampler = Sampler(len(data), 4, mesh, spec, seed=3, rank=rank)
        assert sampler.spec == spec and repr(spec) in repr(sampler)
        assert sampler.local_batch_size == 2
        loaded = list(batches(data, sampler, start_step=1, num_steps=3))
        for step, local in enumerate(loaded, start=1):
            whole = [data[i] for i in sampler.global_indices(step)]
            stacked = {k: torch.stack([e[k] for e in whole]) for k in ("x", "y")}
            want = shard_batch(stacked, mesh, spec, rank=rank)
            assert local["x"].shape == (2, 4)
            torch.testing.assert_close(local, want, rtol=0, atol=0)


def test_a_sampler_without_a_sequence_entry_keeps_its_spec_and_batches():
    mesh = sx.AbstractMesh({"dp": 2, "cp": 2})
    data = TextDataset("abcdefghijklmnopq", seq_len=2, val_fraction=0)
    sampler = Sampler(len(data), 4, mesh, P("dp", None), shuffle=False, rank=1)
    assert repr(sampler.spec) == "P('dp')"
    assert next(batches(data, sampler))["x"].tolist() == [[97, 98], [99, 100]]


def _live_sequence_pieces(spec) -> dict:
    return shard_batch(token_batch(), sx.Mesh({"dp": 2, "cp": 2}), spec)


@pytest.mark.parametrize("spec", [P("dp", zigzag("cp")), P("dp", "cp")], ids=["zigzag", "chunks"])
def test_live_ranks_keep_the_sequence_piece_of_their_rank(spec):
    results = run_ranks(_live_sequence_pieces, spec, world_size=4)
    mesh = sx.AbstractMesh({"dp": 2, "cp": 2})
    for rank, local in enumerate(results):
        want = shard_batch(token_batch(), mesh, spec, rank=rank)
        torch.testing.assert_close(local, want, rtol=0, atol=0)
