"""Groups that span nodes on the shared-memory backend: reductions go
hierarchically — summed within each node over shared memory, across nodes
between one leader per node over gloo, handed back within the node over
shared memory — and everything else goes to gloo. Two "nodes" are made on
this host by giving ranks different ``SHARDAX_NODE_ID`` s (the backend then
treats them as unable to share memory); the whole conformance suite runs
with the world split 2 + 2 and 3 + 1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import shardax as sx
from shardax.collectives import _shm_backend
from shardax.collectives.conformance import ALL_DTYPES, CHECKS, run_check

pytestmark = pytest.mark.skipif(
    not _shm_backend.shm_available()[0], reason="no /dev/shm or no C++ compiler here"
)

SPLITS = {"2+2": (0, 0, 1, 1), "3+1": (0, 0, 0, 1), "interleaved": (0, 1, 0, 1)}


def _on_nodes(split: str, fn, *args):
    os.environ["SHARDAX_BACKEND"] = "shm"
    os.environ["SHARDAX_NODE_ID"] = f"test-node-{SPLITS[split][dist.get_rank()]}"
    try:
        return fn(*args)
    finally:
        del os.environ["SHARDAX_BACKEND"], os.environ["SHARDAX_NODE_ID"]


def conformance(split: str, check: str, timeout: float) -> int:
    return _on_nodes(split, run_check, check, {"x": 2, "y": 2}, ALL_DTYPES, timeout)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("check", list(CHECKS))
def test_conformance_across_nodes(split, check):
    timeout = 700.0 + list(SPLITS).index(split)  # fresh groups per split
    results = run_ranks(conformance, split, check, timeout, world_size=4)
    assert len(set(results)) == 1 and results[0] > 0


def _world_sum(split: str, timeout: float) -> tuple[list, str]:
    def go():
        mesh = sx.Mesh({"x": 4}, timeout=timeout)
        rank = dist.get_rank()
        backend = sx.collectives.get_backend()
        out = []
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = torch.arange(10, dtype=dtype) + 10 * rank  # exact in every dtype (< 256)
            out.append(sx.collectives.psum(x, "x", mesh=mesh))
            out.append(sx.collectives.pmax(x, "x", mesh=mesh))
        big = torch.full((3 * 2**20 + 5,), float(rank + 1))  # several chunks
        out.append(sx.collectives.psum(big, "x", mesh=mesh)[:: 2**20])
        return out, backend.describe(mesh.group("x"))

    return _on_nodes(split, go)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("split", ["2+2", "3+1"])
def test_a_world_spanning_two_nodes_reduces_hierarchically(split):
    timeout = 710.0 + ["2+2", "3+1"].index(split)
    results = run_ranks(_world_sum, split, timeout, world_size=4)
    for dtype_i, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64)):
        base = torch.arange(10, dtype=dtype)
        want_sum = 4 * base + 60
        want_max = base + 30
        for out, _ in results:
            assert torch.equal(out[2 * dtype_i], want_sum.to(dtype)), dtype
            assert torch.equal(out[2 * dtype_i + 1], want_max.to(dtype)), dtype
    for out, how in results:
        assert torch.equal(out[-1], torch.full((4,), 10.0))
        assert "hierarchical" in how, how
