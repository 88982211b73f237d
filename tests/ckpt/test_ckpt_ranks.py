"""Checkpoints across real gloo ranks: save on a 2×2 mesh, load on 1, 2 and 4
ranks under other specs, bit for bit — directly, and after an offline
``shardax ckpt reshard``; each box written once; each rank reads only what
it needs; a save one rank skips fails with that rank named."""

from __future__ import annotations

import json

import pytest
import torch
from _dist import RankFailed, run_ranks
from click.testing import CliRunner

import shardax as sx
from shardax.ckpt import _safetensors, _save
from shardax.cli import main

SPECS_2X2 = {
    "w": sx.P("dp", "tp"),  # uneven on both dims
    "z3": sx.P(("dp", "tp")),  # ZeRO-3 style flat split, uneven
    "tp": sx.P(None, "tp"),
    "rep": sx.P(),
    "bf": sx.P("tp"),
}


TARGETS = [  # (world size, mesh, specs) to load a 2×2 save into: every leaf moves
    (
        2,
        {"x": 2},
        {"w": sx.P(None, "x"), "z3": sx.P("x"), "tp": sx.P("x"), "rep": sx.P("x"), "bf": sx.P()},
    ),
    (
        4,
        {"a": 2, "b": 2},
        {
            "w": sx.P("b", "a"),
            "z3": sx.P(("b", "a")),
            "tp": sx.P(("a", "b")),
            "rep": sx.P("b"),
            "bf": sx.P(None, ("a", "b")),
        },
    ),
]


def full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(7, 5, generator=g),
        "z3": torch.randn(9, generator=g),
        "tp": torch.randn(6, 3, generator=g),
        "rep": torch.randn(4, generator=g),
        "bf": torch.randn(5, 4, generator=g).to(torch.bfloat16),
    }


def save_2x2(path: str) -> list[int]:
    mesh = sx.Mesh({"dp": 2, "tp": 2})
    params = {k: sx.shard(v, mesh, SPECS_2X2[k]) for k, v in full().items()}
    sx.ckpt.save(path, {"params": params, "dense": torch.arange(3), "step": 3})
    return sorted(b.sizes[0] for b in sx.ckpt.read_index(path).leaves["params.w"].boxes)


def load_gathered(path: str, shape: dict[str, int], specs: dict[str, sx.P]) -> dict:
    mesh = sx.Mesh(shape)
    target = {"params": {k: specs[k] for k in SPECS_2X2}, "dense": None, "step": 0}
    out = sx.ckpt.load(path, target, mesh=mesh)
    params = out["params"]
    for k, spec in specs.items():
        assert params[k].spec == spec
    return {"params": sx.gather(params), "dense": out["dense"], "step": out["step"]}


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("world", "shape", "specs"),
    [
        (1, {"x": 1}, dict.fromkeys(SPECS_2X2, sx.P("x"))),
        *TARGETS,
        (4, {"x": 4}, dict.fromkeys(SPECS_2X2, sx.P("x"))),
    ],
)
def test_save_on_2x2_loads_bit_identical_on_any_mesh(tmp_path, world, shape, specs):
    path = str(tmp_path / "ckpt")
    rows = run_ranks(save_2x2, path, world_size=4)[0]
    assert rows == [3, 3, 4, 4]  # 7 rows over dp=2, for each of the 2 tp columns
    index = sx.ckpt.read_index(path)
    assert len(index.leaves["params.rep"].boxes) == 1  # replicas are written once
    assert len(index.leaves["params.tp"].boxes) == 2
    assert len(index.leaves["params.w"].boxes) == 4
    expected = full()
    for out in run_ranks(load_gathered, path, shape, specs, world_size=world):
        for k, v in expected.items():
            got = out["params"][k]
            assert got.dtype == v.dtype and torch.equal(got, v), k
        assert torch.equal(out["dense"], torch.arange(3)) and out["step"] == 3


def _spec_json(spec: sx.P) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("world", "shape", "specs"),
    [(1, {"x": 1}, dict.fromkeys(SPECS_2X2, sx.P())), *TARGETS],
)
def test_offline_reshard_of_a_2x2_save_loads_bit_identical(tmp_path, world, shape, specs):
    """``shardax ckpt reshard`` (no process group) to the target mesh and
    specs: the new checkpoint's boxes are exactly each target rank's pieces,
    so each rank reads one box, and the values are bit for bit the saved ones."""
    src, dst = str(tmp_path / "ckpt"), str(tmp_path / "resharded")
    run_ranks(save_2x2, src, world_size=4)
    spec_file = tmp_path / "specs.json"
    spec_file.write_text(json.dumps({k: _spec_json(v) for k, v in specs.items()}))
    mesh = ",".join(f"{k}={v}" for k, v in shape.items())
    result = CliRunner().invoke(
        main, ["ckpt", "reshard", src, dst, "--mesh", mesh, "--specs", str(spec_file), "-q"]
    )
    assert result.exit_code == 0, result.output
    index = sx.ckpt.read_index(dst)
    assert index.world_size == world and index.mesh == shape
    abstract = sx.AbstractMesh(shape)
    for k, spec in specs.items():
        entry = index.leaves[f"params.{k}"]
        assert entry.spec == spec
        pieces = {sx.Layout(abstract, spec).local_bounds(entry.shape, r) for r in range(world)}
        stored = {
            tuple((o, o + n) for o, n in zip(b.offsets, b.sizes, strict=True)) for b in entry.boxes
        }
        assert stored == {p for p in pieces if all(b > a for a, b in p)}, k
    expected = full()
    for out in run_ranks(load_gathered, dst, shape, specs, world_size=world):
        for k, v in expected.items():
            got = out["params"][k]
            assert got.dtype == v.dtype and torch.equal(got, v), k
        assert torch.equal(out["dense"], torch.arange(3)) and out["step"] == 3


def save_rows(path: str) -> None:
    mesh = sx.Mesh({"dp": -1})
    sx.ckpt.save(path, {"w": sx.shard(torch.arange(8 * 4096.0).reshape(8, 4096), mesh, sx.P("dp"))})


def bytes_read(path: str) -> tuple[int, bool]:
    """Load under P("dp") on this world size; the bytes this rank read."""
    total = 0
    real = _safetensors._read_span

    def counting(f, offset, into, where):
        nonlocal total
        total += len(into)
        return real(f, offset, into, where)

    _safetensors._read_span = counting
    try:
        mesh = sx.Mesh({"dp": -1})
        w = sx.ckpt.load(path, {"w": sx.P("dp")}, mesh=mesh)["w"]
    finally:
        _safetensors._read_span = real
    (a, b), _ = w.bounds()
    expected = torch.arange(8 * 4096.0).reshape(8, 4096)[a:b]
    return total, torch.equal(w.local, expected)


@pytest.mark.world_size(4)
def test_each_rank_reads_only_its_overlap(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(save_rows, path, world_size=4)
    row = 4096 * 4
    for total, ok in run_ranks(bytes_read, path, world_size=4):
        assert ok and total == 2 * row  # its own two rows, nothing else
    for total, ok in run_ranks(bytes_read, path, world_size=2):
        assert ok and total == 4 * row


def save_on_rank0_only(path: str) -> str:
    mesh = sx.Mesh({"dp": -1}, timeout=3)
    x = sx.shard(torch.zeros(4), mesh, sx.P("dp"))
    if mesh.rank == 0:
        sx.ckpt.save(path, {"x": x})
    return "skipped"


@pytest.mark.world_size(2)
def test_a_save_one_rank_skips_names_the_missing_rank(tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(RankFailed) as e:
        run_ranks(save_on_rank0_only, str(path), world_size=2, reset=True)
    err = e.value.errors[0]
    assert isinstance(err, sx.CheckpointError)
    assert "missing: ['rank1']" in str(err) and "call it on every rank" in str(err)
    assert not path.exists()


def rng_round_trip(path: str) -> bool:
    mesh = sx.Mesh({"dp": -1})
    torch.manual_seed(100 + mesh.rank)  # each rank its own stream
    x = sx.shard(torch.zeros(4), mesh, sx.P("dp"))
    sx.ckpt.save(path, {"x": x})
    expected = torch.rand(5)
    torch.manual_seed(0)
    sx.ckpt.load(path, {"x": x}, rng=True)
    return torch.equal(torch.rand(5), expected)


@pytest.mark.world_size(2)
def test_each_rank_gets_its_own_rng_state_back(tmp_path):
    assert run_ranks(rng_round_trip, str(tmp_path / "ckpt"), world_size=2) == [True, True]


def rng_after_offline_reshard(src: str, dst: str) -> bool:
    """Per-rank RNG states survive ``reshard`` to another mesh of as many ranks."""
    mesh = sx.Mesh({"dp": -1})
    torch.manual_seed(200 + mesh.rank)
    x = sx.shard(torch.arange(6.0), mesh, sx.P("dp"))
    sx.ckpt.save(src, {"x": x})
    expected = torch.rand(5)
    if mesh.rank == 0:
        sx.ckpt.reshard(src, dst, {"x": [None]}, mesh={"tp": 2})
        assert sx.ckpt.verify(dst) == []
    sx.collectives.barrier(mesh=mesh)
    torch.manual_seed(0)
    back = sx.ckpt.load(dst, {"x": sx.P()}, mesh=sx.Mesh({"tp": 2}), rng=True)
    return torch.equal(torch.rand(5), expected) and torch.equal(back["x"].local, torch.arange(6.0))


@pytest.mark.world_size(2)
def test_offline_reshard_keeps_each_ranks_rng_state(tmp_path):
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    assert run_ranks(rng_after_offline_reshard, src, dst, world_size=2) == [True, True]


def rank0_cannot_write(path: str) -> str:
    mesh = sx.Mesh({"dp": -1}, timeout=60)
    x = sx.shard(torch.zeros(4), mesh, sx.P("dp"))
    real = _save.write_safetensors

    def full_disk(where, items):
        raise OSError(28, "No space left on device")

    if mesh.rank == 0:
        _save.write_safetensors = full_disk
    try:
        sx.ckpt.save(path, {"x": x})
    except sx.CheckpointError as e:
        return str(e)
    finally:
        _save.write_safetensors = real
    return "saved"


@pytest.mark.world_size(2)
def test_a_rank0_write_failure_reaches_every_rank_at_once(tmp_path):
    """Rank 0 still publishes the outcome, so rank 1 gets rank 0's error
    instead of waiting out the timeout (and blaming itself)."""
    for text in run_ranks(rank0_cannot_write, str(tmp_path / "c"), world_size=2):
        assert "rank 0 could not write rank-00000-of-00002.safetensors" in text, text
        assert "No space left on device" in text and "did not arrive" not in text
    assert not (tmp_path / "c").exists()


def _save_on_two(path: str) -> None:
    mesh = sx.Mesh({"dp": -1})
    torch.manual_seed(300 + mesh.rank)
    sx.ckpt.save(path, {"x": sx.shard(torch.arange(4.0), mesh, sx.P("dp"))}, metadata={"step": 7})


@pytest.mark.world_size(2)
def test_rng_policy_on_another_world_size(tmp_path):
    """Saved on 2 ranks, loaded on 1: ``restore`` cannot split or merge a
    rank's stream and says so, naming the other policies; ``reseed`` seeds
    from the checkpoint and the rank (the same each time); ``skip`` leaves
    the generator alone. The values load the same under each."""
    path = str(tmp_path / "c")
    run_ranks(_save_on_two, path, world_size=2)
    with pytest.raises(sx.CheckpointError) as err:
        sx.ckpt.load(path, {"x": None}, rng="restore")
    text = str(err.value)
    assert "holds the RNG states of 2 rank(s) and this job has 1" in text
    assert "rng='reseed'" in text and "rng='skip'" in text
    with pytest.raises(sx.CheckpointError, match="cannot be split or merged"):
        sx.ckpt.load(path, {"x": None}, rng=True)  # True is "restore"
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        out = sx.ckpt.load(path, {"x": None}, rng="reseed")
        assert torch.equal(out["x"], torch.arange(4.0))
        draws.append(torch.rand(3))
    torch.manual_seed(0)
    unseeded = torch.rand(3)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], unseeded)
    torch.manual_seed(0)
    sx.ckpt.load(path, {"x": None}, rng="skip")
    assert torch.equal(torch.rand(3), unseeded)
    with pytest.raises(sx.CheckpointError, match=r"rng='sometimes' is not a policy; use 'restore'"):
        sx.ckpt.load(path, {"x": None}, rng="sometimes")
    # A manager resumes on any number of ranks by default: reseeded here.
    manager = sx.ckpt.CheckpointManager(tmp_path)
    (tmp_path / "c").rename(manager.path(7))
    torch.manual_seed(0)
    step, out = manager.restore({"x": None})
    assert step == 7 and torch.equal(out["x"], torch.arange(4.0))
    assert torch.equal(torch.rand(3), draws[0])
