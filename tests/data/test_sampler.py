"""The sampler on real ranks: at every step the data ranks' indices partition
the global batch (the same on every rank), each rank loads what
``shard_batch`` would have given it, permutations depend on (seed, epoch)
alone, and resuming at any step — across epochs too — continues the
uninterrupted stream."""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import P, ShardingError
from shardax.data import Sampler, batches, shard_batch

# world size, mesh, spec entry, num_examples, global batch, drop_last, steps
CASES = [
    (2, {"dp": 2}, "dp", 23, 4, True, 12),  # 5 steps an epoch: 12 steps cross two epochs
    (4, {"dp": 2, "tp": 2}, "dp", 10, 4, False, 7),  # last step of each epoch: 2 examples
    (4, {"dp": 2, "tp": 2}, "dp", 9, 4, False, 7),  # last step: 1 example, dp rank 1 none
    (4, {"dp": 2, "sp": 2}, ("dp", "sp"), 16, 8, True, 5),
]
RESUME_AT = (0, 1, 4, 5, 6)


class Toy:
    """A dataset whose example i is recognisable: {"x": [i, -i], "y": i}."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([i, -i]), "y": torch.tensor(i)}


def stack(dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    return {
        "x": torch.stack([dataset[i]["x"] for i in indices]),
        "y": torch.stack([dataset[i]["y"] for i in indices]),
    }


def _streams(mesh_shape, entry, n, batch_size, drop_last, steps) -> dict:
    mesh = sx.Mesh(mesh_shape)
    sampler = Sampler(n, batch_size, mesh, P(entry), seed=7, drop_last=drop_last)
    data = Toy(n)
    return {
        "stream": list(itertools.islice(sampler, steps)),
        "global": [sampler.global_indices(s) for s in range(steps)],
        "resumed": {
            s: list(itertools.islice(sampler.iter_from(s), steps - s))
            for s in RESUME_AT
            if s < steps
        },
        "loaded": list(batches(data, sampler, num_steps=steps)),
        # shard_batch takes only evenly split batches: not a short last one
        "sliced": [
            shard_batch(stack(data, sampler.global_indices(s)), mesh, P(entry))
            if len(sampler.global_indices(s)) == batch_size
            else None
            for s in range(steps)
        ],
    }


def flat(lists: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def data_groups(mesh: sx.AbstractMesh, entry) -> list[list[int]]:
    axes = P(entry).axes
    groups: list[list[int]] = [[] for _ in range(mesh.size(axes))]
    for rank in range(mesh.world_size):
        groups[mesh.axis_index(axes, rank)].append(rank)
    return groups


@pytest.mark.parametrize(
    ("world_size", "mesh_shape", "entry", "n", "batch_size", "drop_last", "steps"),
    CASES,
    ids=[f"ws{c[0]}-{c[1]}-N{c[3]}-B{c[4]}-drop{c[5]}" for c in CASES],
)
def test_ranks_partition_each_step_and_resume_exactly(
    world_size, mesh_shape, entry, n, batch_size, drop_last, steps
):
    results = run_ranks(
        _streams, mesh_shape, entry, n, batch_size, drop_last, steps, world_size=world_size
    )
    mesh = sx.AbstractMesh(mesh_shape)
    reference = Sampler(n, batch_size, mesh, P(entry), seed=7, drop_last=drop_last, rank=0)
    spe = reference.steps_per_epoch
    expected_global = [reference.global_indices(s) for s in range(steps)]
    for rank, result in enumerate(results):
        # every rank (and this process) agrees on the global batches
        assert result["global"] == expected_global, rank
        # resuming anywhere, across epoch boundaries too, continues the stream
        for s, resumed in result["resumed"].items():
            assert resumed == result["stream"][s:], (rank, s)
        # loading its indices = slicing the global batch with shard_batch
        for s, (loaded, sliced) in enumerate(zip(result["loaded"], result["sliced"], strict=True)):
            assert loaded["y"].tolist() == result["stream"][s]
            if sliced is not None:
                torch.testing.assert_close(loaded, sliced, rtol=0, atol=0)
    for s in range(steps):
        groups = data_groups(mesh, entry)
        pieces = [results[g[0]]["stream"][s] for g in groups]
        assert flat(pieces) == expected_global[s], s
        for g in groups:
            assert all(results[r]["stream"][s] == pieces[groups.index(g)] for r in g), s
    for epoch in range(steps // spe):
        seen = flat(expected_global[epoch * spe : (epoch + 1) * spe])
        assert len(seen) == len(set(seen)) == (spe * batch_size if drop_last else n)
        assert seen != list(range(len(seen)))  # shuffled
    if steps >= 2 * spe:
        first, second = (flat(expected_global[e * spe : (e + 1) * spe]) for e in (0, 1))
        assert first != second  # a fresh permutation each epoch


def mesh2(rank: int = 0, **kwargs) -> Sampler:
    options = {"seed": 0, **kwargs}
    return Sampler(20, 4, sx.AbstractMesh({"dp": 2}), rank=rank, **options)


def test_permutation_depends_on_seed_and_epoch_only():
    a, b = mesh2(seed=3), mesh2(seed=3, rank=1)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    first = a.permutation(0)
    assert torch.equal(torch.random.get_rng_state(), before)  # never the global RNG
    torch.manual_seed(123)
    assert torch.equal(a.permutation(0), first)
    assert torch.equal(b.permutation(0), first)
    assert sorted(first.tolist()) == list(range(20))
    assert not torch.equal(a.permutation(1), first)
    assert not torch.equal(mesh2(seed=4).permutation(0), first)
    # (seed, epoch) pairs whose sum agrees still differ
    assert not torch.equal(mesh2(seed=0).permutation(1), mesh2(seed=1).permutation(0))


def test_no_shuffle_is_in_order():
    sampler = mesh2(shuffle=False, rank=1)
    assert list(itertools.islice(sampler, 6)) == [
        [2, 3],
        [6, 7],
        [10, 11],
        [14, 15],
        [18, 19],
        [2, 3],
    ]


@pytest.mark.parametrize(
    ("n", "batch_size", "drop_last", "steps_per_epoch", "last"),
    [(20, 4, True, 5, 4), (22, 4, True, 5, 4), (22, 4, False, 6, 2), (3, 4, False, 1, 3)],
)
def test_steps_per_epoch(n, batch_size, drop_last, steps_per_epoch, last):
    sampler = Sampler(n, batch_size, sx.Mesh({"dp": 1}), drop_last=drop_last)
    assert sampler.steps_per_epoch == steps_per_epoch
    assert len(sampler.global_indices(steps_per_epoch - 1)) == last
    assert sampler.epoch_of(steps_per_epoch - 1) == 0
    assert sampler.epoch_of(steps_per_epoch) == 1
    assert sampler.global_indices(steps_per_epoch) == Sampler(
        n, batch_size, sx.Mesh({"dp": 1}), drop_last=drop_last
    ).global_indices(steps_per_epoch)


def test_resume_from_any_step_single_process():
    sampler = mesh2(rank=1, seed=11)
    stream = list(itertools.islice(sampler, 16))
    for s in range(16):
        assert list(itertools.islice(sampler.iter_from(s), 16 - s)) == stream[s:], s
        resumed = attrs.evolve(sampler, start_step=s)
        assert list(itertools.islice(resumed, 16 - s)) == stream[s:], s
        assert sampler.indices(s) == stream[s]


def test_a_value_with_a_repr_that_rebuilds_it():
    sampler = mesh2(rank=1, seed=5, drop_last=False, start_step=3)
    assert (
        eval(repr(sampler), {"Sampler": Sampler, "AbstractMesh": sx.AbstractMesh, "P": P})
        == sampler
    )
    assert sampler != mesh2(rank=0, seed=5, drop_last=False, start_step=3)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        sampler.seed = 1  # type: ignore[misc]
    assert repr(Sampler(4, 2, sx.Mesh({"dp": 1}))) == (
        "Sampler(4, 2, Mesh({'dp': 1}), P('dp'), shuffle=True, seed=0, drop_last=True, start_step=0)"
    )


BAD = [  # args, kwargs, error, message fragments
    ((0, 4), {}, ValueError, ["num_examples must be positive", "0"]),
    ((20, 0), {}, ValueError, ["global_batch_size must be positive"]),
    ((20, -2), {}, ValueError, ["global_batch_size must be positive"]),
    ((20, 2.0), {}, TypeError, ["global_batch_size must be an int"]),
    ((20, 3), {}, ShardingError, ["3 examples", "('dp',)", "(2,)", "multiple of 2", "2 or 4"]),
    ((10, 12), {}, ValueError, ["12 examples", "10 examples", "at most 10", "drop_last=False"]),
    ((1, 2), {}, ValueError, ["1 examples", "more examples"]),
    ((20, 4), {"seed": -1}, ValueError, ["seed must be at least 0"]),
    ((20, 4), {"shuffle": "yes"}, TypeError, ["shuffle must be True or False"]),
    ((20, 4), {"spec": P("tp")}, ShardingError, ["unknown mesh axis 'tp'"]),
    ((20, 4), {"rank": None}, ShardingError, ["pass rank="]),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "fragments"), BAD)
def test_bad_sizes_are_clear_errors(args, kwargs, error, fragments):
    kwargs = {"rank": 0, **kwargs}
    with pytest.raises(error) as err:
        Sampler(*args, sx.AbstractMesh({"dp": 2}), **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_drop_last_false_keeps_a_short_last_batch():
    sampler = Sampler(5, 4, sx.Mesh({"dp": 1}), shuffle=False, drop_last=False)
    assert list(itertools.islice(sampler, 3)) == [[0, 1, 2, 3], [4], [0, 1, 2, 3]]
    empty = Sampler(5, 4, sx.AbstractMesh({"dp": 2}), shuffle=False, drop_last=False, rank=1)
    loaded = list(batches(Toy(5), empty, num_steps=2))
    assert loaded[0]["y"].tolist() == [2, 3]
    assert loaded[1]["x"].shape == (0, 2) and loaded[1]["y"].shape == (0,)


def test_batches_start_count_and_checks():
    sampler = mesh2(shuffle=False, start_step=4)
    got = list(batches(Toy(20), sampler, num_steps=2))
    assert [b["y"].tolist() for b in got] == [[16, 17], [0, 1]]
    got = list(batches(Toy(20), sampler, start_step=1, num_steps=1))
    assert got[0]["x"].tolist() == [[4, -4], [5, -5]]
    assert list(batches(Toy(20), sampler, num_steps=0)) == []
    with pytest.raises(ValueError, match="the dataset has 19 examples but the sampler is for 20"):
        batches(Toy(19), sampler)
    with pytest.raises(ValueError, match="num_steps must be at least 0"):
        batches(Toy(20), sampler, num_steps=-1)


def test_usable_as_a_dataloader_batch_sampler():
    sampler = mesh2(rank=1, seed=2, start_step=3)
    loader = torch.utils.data.DataLoader(Toy(20), batch_sampler=sampler)
    from_loader = list(itertools.islice(loader, 6))
    mine = list(batches(Toy(20), sampler, num_steps=6))
    assert len(from_loader) == 6
    for a, b in zip(from_loader, mine, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
