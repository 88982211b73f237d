"""Joining the job: read the launcher's environment, pick device and backend,
initialize torch.distributed; and leaving it."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..errors import LaunchError

__all__ = ["DEFAULT_TIMEOUT", "LaunchEnv", "ProcessInfo", "detect_env", "init", "shutdown"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective may wait before it raises (override: ``SHARDAX_TIMEOUT``)."""


@attrs.frozen(kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it.

    >>> detect_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
    ...             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr='10.0.0.1', master_port=29400, source='torchrun')
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str


@attrs.frozen(kw_only=True)
class ProcessInfo:
    """What :func:`init` set up for this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None
    source: str


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: ``node[003-005,9],gpu1`` → ``node003``.

    >>> _first_slurm_host("node[003-005,9],gpu1"), _first_slurm_host("gpu7,gpu8")
    ('node003', 'gpu7')
    """
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise LaunchError(f"cannot read the Slurm nodelist {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _local_world_from_slurm(env: Mapping[str, str], world: int) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "4(x2),3"; take this node's share when uniform.
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    m = re.match(r"(\d+)", spec)
    return int(m.group(1)) if m else world


def detect_env(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """Read the launch environment: ``shardax launch``/torchrun (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), OpenMPI
    (``OMPI_COMM_WORLD_*``) or a Slurm step (``SLURM_PROCID``, …). None when
    the process was started on its own.

    >>> detect_env({}) is None
    True
    >>> detect_env({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_ID": "0",
    ...             "SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    ...             "SLURM_STEP_NODELIST": "gpu[12-13]", "SLURM_JOB_ID": "4242"})
    LaunchEnv(rank=3, world_size=8, local_rank=3, local_world_size=4, master_addr='gpu12', master_port=14242, source='slurm')
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return LaunchEnv(
            rank=_int(env, "RANK"),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            source="shardax launch" if env.get("SHARDAX_LAUNCHED") == "1" else "torchrun",
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        if "MASTER_ADDR" not in env:
            raise LaunchError(
                "running under mpirun (OMPI_COMM_WORLD_RANK is set) but MASTER_ADDR is not: "
                "export it to every rank, e.g. `mpirun -x MASTER_ADDR=$(hostname) ...`"
            )
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        return LaunchEnv(
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            world_size=world,
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
            if "OMPI_COMM_WORLD_LOCAL_RANK" in env
            else 0,
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
            if "OMPI_COMM_WORLD_LOCAL_SIZE" in env
            else world,
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            source="openmpi",
        )
    # Only inside an srun step (not a batch script, which also has SLURM_PROCID).
    if "SLURM_PROCID" in env and env.get("SLURM_STEP_ID", "batch").isdigit():
        world = _int(
            env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        )
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif nodelist:
            addr = _first_slurm_host(nodelist)
        else:
            raise LaunchError("inside a Slurm step without SLURM_STEP_NODELIST: set MASTER_ADDR")
        job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        return LaunchEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            local_world_size=_local_world_from_slurm(env, world),
            master_addr=addr,
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 10000 + job % 20000,
            source="slurm",
        )
    return None


def _timeout_seconds(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get("SHARDAX_TIMEOUT")
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise LaunchError(f"SHARDAX_TIMEOUT={raw!r} is not a number of seconds") from None
    if not timeout > 0:
        raise LaunchError(f"timeout must be positive seconds; got {timeout!r}")
    return float(timeout)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def tune_allocator() -> int | None:
    """Set glibc's mmap threshold (see :func:`init`); the threshold in bytes,
    or None when left alone (not glibc, disabled, or already set)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return None
    try:
        value = int(os.environ.get("SHARDAX_MMAP_THRESHOLD", 4 * 2**20))
    except ValueError:
        raise LaunchError(
            "SHARDAX_MMAP_THRESHOLD must be a byte count (0 leaves malloc alone); got "
            f"{os.environ['SHARDAX_MMAP_THRESHOLD']!r}"
        ) from None
    if value <= 0 or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(value))
    except (OSError, AttributeError):
        return None
    return value if ok == 1 else None


def init(backend: str | None = None, *, timeout: float | None = None) -> ProcessInfo:
    """Join the job this process was launched into.

    Reads the environment of ``shardax launch``, torchrun, Slurm (``srun``) or
    OpenMPI (``mpirun``); picks the device (``cuda:LOCAL_RANK`` when CUDA is
    present, else CPU) and the backend (NCCL on GPU, gloo on CPU) unless
    ``backend`` says otherwise; initializes torch.distributed. With no launch
    environment this is world size 1 and no process group is created. Adopts
    an already initialized torch.distributed (keeping its timeout). Safe to
    call twice.

    On glibc it also sets malloc's mmap threshold to 4 MiB (unless
    ``MALLOC_MMAP_THRESHOLD_`` is set, or ``SHARDAX_MMAP_THRESHOLD=0``), so
    tensors of 4 MiB and more go straight back to the OS when freed. A
    training step allocates and frees many such tensors (gathered
    parameters, gradients, updates); with glibc's default, which raises the
    threshold to 32 MiB after the first free, they fragment the heap and a
    rank's resident memory creeps up step after step.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; None picks by device.
        timeout: seconds before a collective that cannot complete raises;
            None → ``SHARDAX_TIMEOUT`` or 600.

    >>> info = init()
    >>> info.world_size, info.rank, info.device.type
    (1, 0, 'cpu')
    """
    seconds = _timeout_seconds(timeout)
    tune_allocator()
    if dist.is_available() and dist.is_initialized():
        env = detect_env()
        local_rank = env.local_rank if env else 0
        name = dist.get_backend()
        device = _device(name, local_rank)
        return ProcessInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            local_world_size=env.local_world_size if env else 1,
            device=device,
            backend=name,
            source="existing",
        )
    env = detect_env()
    if env is None:
        return ProcessInfo(
            rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            device=_device(backend, 0),
            backend=None,
            source="none",
        )
    if not 0 <= env.rank < env.world_size:
        raise LaunchError(f"rank {env.rank} is outside world size {env.world_size} ({env.source})")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = _device(backend, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=seconds),
    )
    return ProcessInfo(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        device=device,
        backend=backend,
        source=env.source,
    )


def _device(backend: str | None, local_rank: int) -> torch.device:
    if (backend is None or "nccl" in backend) and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _default_store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def _exit_together(store: Any, rank: int, world: int, timeout: float = 30.0) -> None:
    """Rank 0's process hosts the rendezvous store; if it exits while a peer
    still tears down its process group, that peer's gloo threads lose the
    store and abort the process ("terminate called without an active
    exception"). So every rank checks out through the store, and rank 0
    returns only when all have (or after ``timeout`` seconds)."""
    try:
        store.add("shardax/shutdown", 1)
        if rank != 0:
            return
        deadline = time.monotonic() + timeout
        while store.add("shardax/shutdown", 0) < world and time.monotonic() < deadline:
            time.sleep(0.005)
    except Exception:  # a peer already gone: nothing left to protect
        return


def shutdown() -> None:
    """Leave the job: wait until every rank is here (so no rank tears down its
    connections while a peer still uses them — gloo then aborts the peer),
    then destroy the process groups. Collective: every rank calls it. Safe to
    call when not initialized.

    >>> shutdown()
    """
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        store = _default_store() if world > 1 else None
        if world > 1:
            dist.barrier()
        from ._groups import forget_groups

        forget_groups()  # our references would keep the groups alive past their teardown
        dist.destroy_process_group()
        gc.collect()  # their threads stop now, not in the interpreter's teardown
        if store is not None:
            _exit_together(store, rank, world)
