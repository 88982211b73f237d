"""Checkpoints across real gloo ranks: save on a 2×2 mesh, load on 1, 2 and 4
ranks under other specs, bit for bit; each box written once; each rank reads
only what it needs; a save one rank skips fails with that rank named."""

from __future__ import annotations

import pytest
import torch
from _dist import RankFailed, run_ranks

import shardax as sx
from shardax.ckpt import _format

SPECS_2X2 = {
    "w": sx.P("dp", "tp"),  # uneven on both dims
    "z3": sx.P(("dp", "tp")),  # ZeRO-3 style flat split, uneven
    "tp": sx.P(None, "tp"),
    "rep": sx.P(),
    "bf": sx.P("tp"),
}


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
        (
            2,
            {"x": 2},
            {
                "w": sx.P(None, "x"),
                "z3": sx.P("x"),
                "tp": sx.P("x"),
                "rep": sx.P("x"),
                "bf": sx.P(),
            },
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


def save_rows(path: str) -> None:
    mesh = sx.Mesh({"dp": -1})
    sx.ckpt.save(path, {"w": sx.shard(torch.arange(8 * 4096.0).reshape(8, 4096), mesh, sx.P("dp"))})


def bytes_read(path: str) -> tuple[int, bool]:
    """Load under P("dp") on this world size; the bytes this rank read."""
    total = 0
    real = _format._read_span

    def counting(f, offset, into, where):
        nonlocal total
        total += len(into)
        return real(f, offset, into, where)

    _format._read_span = counting
    try:
        mesh = sx.Mesh({"dp": -1})
        w = sx.ckpt.load(path, {"w": sx.P("dp")}, mesh=mesh)["w"]
    finally:
        _format._read_span = real
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
