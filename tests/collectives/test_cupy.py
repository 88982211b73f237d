"""What of the CuPy NCCL backend can be checked without a GPU: its unique-id
exchange through the torch.distributed store on real gloo ranks, the id's
conversions, its dtype and op tables against nccl.h, backend selection and
its clear error where CuPy or a GPU is missing, and that ``import shardax``
and ``shardax report`` never need CuPy. The GPU half is tests/gpu/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_ranks

from shardax.collectives import _backend
from shardax.collectives._cupy_backend import (
    NCCL_DTYPES,
    NCCL_OPS,
    NCCL_UNIQUE_ID_BYTES,
    CupyBackend,
    cupy_available,
    exchange_unique_id,
    id_bytes,
    id_tuple,
)
from shardax.errors import CollectiveError

ROOT = Path(__file__).resolve().parents[2]
AVAILABLE = cupy_available()[0]


def _exchange(rounds: int) -> list[bytes]:
    """Each rank's ids for ``rounds`` communicators of the world: rank 0
    makes random ones, the others get them through the store."""
    import torch.distributed as dist

    from shardax.mesh._runtime import _default_store

    store = _default_store()
    root = dist.get_rank() == 0
    return [
        exchange_unique_id(store, f"test/nccl-id/{i}", root, lambda: os.urandom(128))
        for i in range(rounds)
    ]


@pytest.mark.world_size(3)
def test_unique_ids_reach_every_member_through_the_store():
    per_rank = run_ranks(_exchange, 3, world_size=3)
    assert all(ids == per_rank[0] for ids in per_rank)  # every member, the root's id
    assert len(set(per_rank[0])) == 3  # one id per communicator, none reused
    assert all(len(x) == NCCL_UNIQUE_ID_BYTES for x in per_rank[0])


def test_an_id_of_the_wrong_length_is_refused():
    class Store(dict):
        def set(self, key, value):
            self[key] = value

    with pytest.raises(ValueError, match="128 bytes; got 5"):
        exchange_unique_id(Store(), "k", True, lambda: b"short")
    with pytest.raises(ValueError, match="128 bytes; got 3"):
        id_tuple(b"abc")


def test_ids_convert_between_cupy_chars_and_bytes():
    chars = tuple(range(-128, 0)) if NCCL_UNIQUE_ID_BYTES == 128 else ()
    data = id_bytes(chars)
    assert data == bytes(range(128, 256))
    assert id_tuple(data) == chars
    every = bytes(range(128))
    assert id_bytes(id_tuple(every)) == every


def test_the_tables_follow_nccl_h():
    # ncclDataType_t: Int8 0, Uint8 1, Int32 2, Uint32 3, Int64 4, Uint64 5,
    # Float16 6, Float32 7, Float64 8, Bfloat16 9; ncclRedOp_t: Sum 0, Prod 1,
    # Max 2, Min 3. Every dtype the conformance suite runs is native to NCCL.
    assert NCCL_DTYPES[torch.float32] == 7 and NCCL_DTYPES[torch.bfloat16] == 9
    assert NCCL_DTYPES[torch.float16] == 6 and NCCL_DTYPES[torch.float64] == 8
    assert NCCL_DTYPES[torch.int32] == 2 and NCCL_DTYPES[torch.int64] == 4
    assert NCCL_OPS == {"sum": 0, "max": 2, "min": 3}


def _cpu_through_cupy() -> list[torch.Tensor]:
    import torch.distributed as dist

    import shardax as sx
    from shardax.collectives._api import _group
    from shardax.collectives._torch_backend import TORCH_BACKEND

    group = _group("x", sx.Mesh({"x": -1}), "test")
    backend = CupyBackend(TORCH_BACKEND, store=lambda: None)  # no store: no NCCL at all
    rank = dist.get_rank()
    x = torch.full((3,), float(rank + 1))
    backend.all_reduce(x, "sum", group).wait()
    out = torch.empty(2 * 3)
    backend.all_gather(out, torch.full((3,), float(rank)), group).wait()
    backend.barrier(group).wait()
    return [x, out]


def test_cpu_tensors_go_to_the_fallback():
    """CPU tensors never reach NCCL: the backend hands them to the torch
    backend (gloo here), on real ranks."""
    assert not CupyBackend.covers(torch.ones(1))
    for x, out in run_ranks(_cpu_through_cupy, world_size=2):
        assert torch.equal(x, torch.full((3,), 3.0))
        assert torch.equal(out, torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]))


@pytest.mark.skipif(AVAILABLE, reason="CuPy's NCCL works here: tests/gpu covers it")
def test_asking_for_cupy_where_it_cannot_run_says_why(monkeypatch):
    monkeypatch.setenv("SHARDAX_BACKEND", "cupy")
    with pytest.raises(CollectiveError, match=r"the cupy backend is unavailable here: .*cupy"):
        _backend.get_backend()
    if not torch.cuda.is_available():
        assert _backend._auto() in ("shm", "torch")  # CPU ranks never pick cupy


def test_import_and_report_work_without_cupy(tmp_path):
    # CuPy blocked at import (as if not installed, even where it is)
    code = (
        "import sys, json; sys.modules['cupy'] = None\n"
        "import shardax\n"
        "from shardax.report import collect\n"
        "print(json.dumps(collect()['cupy']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    cupy = json.loads(done.stdout.strip().splitlines()[-1])
    assert cupy["installed"] is False and "cupy" in cupy["why"]


@pytest.mark.parametrize(("gpu", "cupy", "want"), [
    (True, (True, ""), "cupy"),
    (True, (False, "cannot import cupy.cuda.nccl"), "torch"),
])  # fmt: skip
def test_gpu_ranks_pick_cupy_where_it_loads_else_torch(monkeypatch, gpu, cupy, want):
    from shardax.collectives import _cupy_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(_cupy_backend, "cupy_available", lambda: cupy)
    assert _backend._auto() == want
