"""The CuPy NCCL backend on the GPUs present (run by tests/gpu/run.sh; on a
CPU host every test here skips). On one GPU the communicator path still
runs, with one member: every collective through NCCL, against torch."""

from __future__ import annotations

import pytest
import torch

from shardax.collectives._cupy_backend import CupyBackend, cupy_available
from shardax.collectives._torch_backend import TORCH_BACKEND
from shardax.mesh._groups import Group, PGState

OK, WHY = cupy_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no CuPy NCCL here: {WHY}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64]


@pytest.fixture
def one():
    """A one-member group whose communicator is made through a real store."""
    import torch.distributed as dist

    store = dist.HashStore()
    backend = CupyBackend(TORCH_BACKEND, store=lambda: store)
    group = Group((0,), 0, PGState(None, (0,), 60.0, backend), "the one-GPU test group")
    yield backend, group
    backend.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_collective_runs_through_nccl(one, dtype):
    backend, group = one
    dev = torch.device("cuda", torch.cuda.current_device())
    x = (torch.arange(1000, device=dev) % 7).to(dtype)
    for op in ("sum", "max", "min"):
        out = torch.empty_like(x)
        backend.all_reduce_out(out, x, op, group).wait()
        assert torch.equal(out, x)  # one member: the reduction of one
    y = x.clone()
    backend.all_reduce(y, "sum", group).wait()
    assert torch.equal(y, x)
    gathered = torch.empty_like(x)
    backend.all_gather(gathered, x, group).wait()
    assert torch.equal(gathered, x)
    piece = torch.empty_like(x)
    backend.reduce_scatter(piece, x.view(1, -1), group).wait()
    assert torch.equal(piece, x)
    z = x.clone()
    backend.broadcast(z, 0, group).wait()
    assert torch.equal(z, x)
    swapped = torch.empty_like(x)
    backend.all_to_all(swapped, x, [x.numel()], [x.numel()], group).wait()
    assert torch.equal(swapped, x)
    backend.barrier(group).wait()
    assert len(backend.comms) == 1  # made once, then reused


def test_the_handle_orders_the_callers_stream(one):
    backend, group = one
    x = torch.ones(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        handle = backend.all_reduce(x, "sum", group)
    handle.wait()  # the default stream now runs after the all-reduce
    assert float(x.sum()) == float(1 << 20)


def test_the_conformance_suite_on_cuda_tensors_at_world_size_one():
    """Every check of the suite on this GPU's tensors (collectives over one
    rank are local; run.sh runs the suite over NCCL when there are more GPUs)."""
    import shardax as sx
    from shardax.collectives.conformance import CHECKS, run_all

    device = torch.device("cuda", torch.cuda.current_device())
    assert len(run_all(sx.Mesh({"x": 1}), device=device)) == len(CHECKS)
