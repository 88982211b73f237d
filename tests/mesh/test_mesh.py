"""Meshes: validation, the rank grid, groups along axes, views, and errors."""

from __future__ import annotations

import pytest
from _dist import run_ranks

import shardax as sx
from shardax import AbstractMesh, Mesh, MeshError


def test_rank_grid_last_axis_fastest():
    mesh = AbstractMesh({"dp": 2, "tp": 2})
    assert mesh.rank_grid.tolist() == [[0, 1], [2, 3]]
    assert mesh.coords(1) == {"dp": 0, "tp": 1}
    assert mesh.ranks_along("tp", rank=2) == (2, 3)
    assert mesh.ranks_along("dp", rank=1) == (1, 3)
    assert mesh.ranks_along(("dp", "tp"), rank=3) == (0, 1, 2, 3)
    assert mesh.ranks_along(("tp", "dp"), rank=3) == (0, 2, 1, 3)  # member order: first axis major
    assert mesh.groups_along("dp") == ((0, 2), (1, 3))
    assert mesh.axis_index(("tp", "dp"), rank=1) == 2
    assert mesh.size() == 4 and mesh.size(("dp", "tp")) == 4 and mesh.size("tp") == 2


def test_repr_rebuilds_the_mesh():
    mesh = AbstractMesh({"pp": 2, "dp": 3, "tp": 2})
    assert eval(repr(mesh), {"AbstractMesh": AbstractMesh}) == mesh
    assert repr(Mesh({"dp": -1})) == "Mesh({'dp': 1})"


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({}, "non-empty mapping"),
        ({"dp": 0}, "has size 0"),
        ({"dp": -2}, "has size -2"),
        ({"dp": 2.0}, "sizes are ints"),
        ({"d p": 2}, "identifiers"),
        ({"dp": -1, "tp": -1}, "at most one mesh axis may have size -1"),
    ],
)
def test_bad_meshes_raise_mesh_error(shape, message):
    with pytest.raises(MeshError, match=message):
        Mesh(shape)


def test_mesh_must_fit_the_world_size():
    with pytest.raises(MeshError, match=r"has 4 ranks but the world size is 1"):
        Mesh({"dp": 2, "tp": 2})
    with pytest.raises(MeshError, match=r"cannot fit world size 1: the other axes multiply to 2"):
        Mesh({"dp": -1, "tp": 2})
    with pytest.raises(MeshError, match="no world size to infer"):
        AbstractMesh({"dp": -1})


def test_unknown_axis_names_the_mesh_and_suggests():
    with pytest.raises(
        MeshError, match=r"unknown mesh axis 'tq'.*\('dp', 'tp'\).*did you mean 'tp'"
    ):
        AbstractMesh({"dp": 2, "tp": 2}).size("tq")
    with pytest.raises(MeshError, match="repeated"):
        AbstractMesh({"dp": 2}).ranks_along(("dp", "dp"), rank=0)
    with pytest.raises(MeshError, match="rank 4 is not in mesh"):
        AbstractMesh({"dp": 2, "tp": 2}).coords(4)


def test_mesh_without_init_under_a_launcher_is_an_error(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MeshError, match=r"one of 2 ranks \(by torchrun\).*call shardax.init\(\)"):
        Mesh({"dp": -1})


def test_with_mesh_sets_the_current_mesh():
    outer, inner = Mesh({"dp": 1}), Mesh({"tp": 1})
    assert sx.mesh.current_mesh() is None
    with outer:
        with inner:
            assert sx.mesh.current_mesh() is inner
        assert sx.mesh.current_mesh() is outer
    assert sx.mesh.current_mesh() is None


def _groups() -> dict:
    mesh = Mesh({"dp": -1, "tp": 2})
    view = mesh.view({"ep": 2, "x": mesh.size() // 2})
    g_tp, g_dp, g_all = mesh.group("tp"), mesh.group("dp"), mesh.group(("tp", "dp"))
    return {
        "rank": mesh.rank,
        "tp": g_tp.members,
        "dp": g_dp.members,
        "all": g_all.members,
        "index": (g_tp.index, g_dp.index, g_all.index),
        "cached": mesh.group("tp") is g_tp,
        "shared_pg": view.group("x").pg is g_tp.pg,  # same ranks, same process group
        "axis_index": (mesh.axis_index("dp"), mesh.axis_index("tp")),
    }


@pytest.mark.world_size(4)
def test_groups_on_four_ranks():
    results = run_ranks(_groups, world_size=4)
    assert [r["tp"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["dp"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(r["all"] == (0, 2, 1, 3) for r in results)
    assert [r["index"] for r in results] == [(0, 0, 0), (1, 0, 2), (0, 1, 1), (1, 1, 3)]
    assert all(r["cached"] and r["shared_pg"] for r in results)
    assert [r["axis_index"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_mesh_without_init_under_slurm_or_mpirun_is_an_error(monkeypatch):
    for var in ["RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n1")
    with pytest.raises(MeshError, match=r"one of 4 ranks \(by slurm\).*shardax.init\(\)"):
        Mesh({"dp": -1})
    for var in ["SLURM_PROCID", "SLURM_STEP_ID"]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(MeshError, match=r"shardax\.init"):
        Mesh({"dp": -1})


def _one_rank_builds(other: str) -> str:
    """Rank 1 never builds the mesh (``other`` = "none") or builds another."""
    import torch.distributed as dist

    try:
        if dist.get_rank() == 0:
            Mesh({"dp": -1}, timeout=3.0)
        elif other == "another":
            Mesh({"dp": 1, "tp": -1}, timeout=3.0)
        else:
            return "skipped"
    except MeshError as err:
        return str(err)
    return "no error"


@pytest.mark.world_size(2)
def test_a_rank_that_never_builds_the_mesh_is_named():
    first, second = run_ranks(_one_rank_builds, "none", world_size=2, reset=True)
    assert second == "skipped"
    assert (
        "building Mesh({'dp': 2}" in first and "ranks [1] did not build a mesh within 3 s" in first
    )
    assert "Every rank must build the same meshes" in first


@pytest.mark.world_size(2)
def test_ranks_that_build_different_meshes_are_told_so():
    first, second = run_ranks(_one_rank_builds, "another", world_size=2, reset=True)
    assert "rank 1 built Mesh({'dp': 1, 'tp': 2}" in first, first
    assert "rank 0 built Mesh({'dp': 2}" in second, second
