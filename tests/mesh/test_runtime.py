"""Joining the job: reading each launcher's environment, world size 1 without
one, and clear errors for environments that cannot work."""

from __future__ import annotations

import pytest

import shardax as sx
from shardax import LaunchError
from shardax.mesh import LaunchEnv, detect_env


def test_torchrun_and_shardax_launch_environments():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29511",
    }
    assert detect_env(env) == LaunchEnv(
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        master_addr="node0",
        master_port=29511,
        source="torchrun",
    )
    assert detect_env(env | {"SHARDAX_LAUNCHED": "1"}).source == "shardax launch"


def test_openmpi_environment_needs_master_addr():
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    with pytest.raises(LaunchError, match="mpirun -x MASTER_ADDR"):
        detect_env(env)
    got = detect_env(env | {"MASTER_ADDR": "10.1.1.1"})
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size, got.source) == (
        2,
        8,
        2,
        4,
        "openmpi",
    )
    assert got.master_port == 29500


def test_slurm_step_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_ID": "0",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu-[007-008]",
        "SLURM_JOB_ID": "123",
    }
    got = detect_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (5, 8, 1, 4)
    assert (got.master_addr, got.master_port, got.source) == ("gpu-007", 10123, "slurm")
    assert detect_env(env | {"MASTER_ADDR": "login", "MASTER_PORT": "4000"}).master_addr == "login"
    # a batch script (not an srun step) is not a multi-rank launch
    assert detect_env({k: v for k, v in env.items() if k != "SLURM_STEP_ID"}) is None


def test_no_environment_is_world_size_one(monkeypatch):
    for var in ["RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"]:
        monkeypatch.delenv(var, raising=False)
    info = sx.init()
    assert (info.rank, info.world_size, info.backend, info.source) == (0, 1, None, "none")
    sx.shutdown()
    sx.shutdown()  # idempotent


def test_bad_values_are_launch_errors(monkeypatch):
    with pytest.raises(LaunchError, match=r"WORLD_SIZE='four' is not an integer"):
        detect_env({"RANK": "0", "WORLD_SIZE": "four"})
    monkeypatch.setenv("SHARDAX_TIMEOUT", "soon")
    with pytest.raises(LaunchError, match="SHARDAX_TIMEOUT='soon'"):
        sx.init()
    with pytest.raises(LaunchError, match="timeout must be positive"):
        sx.init(timeout=-1)
