"""``psum`` / ``pmean`` into a caller's buffer (``out=``, ``out=x`` in
place) on real ranks, on the shared-memory backend and on gloo: the same
sums as the functional call, written into that buffer."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import shardax as sx
from shardax import collectives as C


def _sums(backend: str, timeout: float) -> list:
    os.environ["SHARDAX_BACKEND"] = backend
    try:
        mesh = sx.Mesh({"x": -1}, timeout=timeout)
        rank = dist.get_rank()
        got = []
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for numel in (7, 3 * 2**18 + 1):  # one chunk; several
                x = (torch.arange(numel) % 97 + 10 * rank).to(dtype)
                want = C.psum(x, "x", mesh=mesh)
                out = torch.empty_like(x)
                same = C.psum(x, "x", mesh=mesh, out=out)
                inplace = x.clone()
                res = C.psum(inplace, "x", mesh=mesh, out=inplace)
                pending = C.psum(x, "x", mesh=mesh, out=torch.empty_like(x), async_op=True)
                later = pending.wait()
                got.append(
                    same is out
                    and res is inplace
                    and torch.equal(out, want)
                    and torch.equal(inplace, want)
                    and torch.equal(later, want)
                )
        y = torch.full((5,), float(rank + 1))
        mean = C.pmean(y, "x", mesh=mesh, out=y)
        got.append(mean is y and torch.equal(y, torch.full((5,), 1.5)))
        return got
    finally:
        del os.environ["SHARDAX_BACKEND"]


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_psum_into_a_buffer_equals_the_functional_sum(backend):
    timeout = {"shm": 621.0, "torch": 622.0}[backend]
    for per_rank in run_ranks(_sums, backend, timeout, world_size=2):
        assert all(per_rank), per_rank
