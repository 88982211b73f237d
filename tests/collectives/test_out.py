"""Collectives into a caller's buffer on real ranks, on the shared-memory
backend, on gloo and hierarchically across "nodes": ``psum`` / ``pmean``
(``out=``, ``out=x`` in place), ``all_gather`` and ``psum_scatter``
(tiled or not, uneven and empty pieces, reused, async) give the same
results as the functional call, written into that buffer — straight from
the backend where the layout allows."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import shardax as sx
from shardax import collectives as C
from shardax.collectives import chunk_sizes
from shardax.collectives._backend import comm_of


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


# -- all_gather / psum_scatter into a caller's buffer ----------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
LONG = 3 * 2**16 + 1  # several 256 KiB chunks of the shm ring
SPLIT = (0, 0, 1, 1)  # "nodes" of the hierarchical case: two per node


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Exact in every dtype, and in sums of up to 4 ranks (< 256)."""
    return (torch.arange(math.prod(shape)).view(shape) % 50 + seed).to(dtype)


def _cases(n: int, rank: int) -> list[tuple[str, str, tuple, dict, bool]]:
    """``(label, op, x shape, kwargs, direct)``: ``direct`` when the backend
    must write straight into ``out`` (even pieces, nothing but 1s before dim)."""
    uneven = 2 * n + 1  # psum_scatter pieces (3, 2) or (3, 3, 3, 0)
    mine = chunk_sizes(uneven, n)[rank] == max(chunk_sizes(uneven, n))
    return [
        ("gather dim 0", "all_gather", (7,), {}, True),
        ("gather dim 0, long", "all_gather", (LONG,), {}, True),
        ("gather dim 1", "all_gather", (3, 5), {"dim": 1}, False),
        ("gather dim 1 after 1", "all_gather", (1, 5, 2), {"dim": 1}, True),
        ("gather uneven", "all_gather", (rank + 1, 2), {}, False),
        ("gather an empty piece", "all_gather", (0 if rank == 0 else 3,), {}, False),
        ("gather untiled dim 0", "all_gather", (3, 5), {"tiled": False}, True),
        ("gather untiled dim 1", "all_gather", (3, 5), {"tiled": False, "dim": 1}, False),
        ("scatter dim 0", "psum_scatter", (n * 7,), {}, True),
        ("scatter dim 0, long", "psum_scatter", (n * LONG,), {}, True),
        ("scatter dim 1", "psum_scatter", (3, n * 4), {"dim": -1}, False),
        ("scatter uneven", "psum_scatter", (uneven, 2), {}, mine),
        ("scatter untiled dim 0", "psum_scatter", (n, 5), {"tiled": False}, True),
        ("scatter untiled dim 1", "psum_scatter", (3, n, 2), {"tiled": False, "dim": 1}, False),
    ]


def _spy(method, seen: list):
    def spy(out, x, group):
        seen.append(out.data_ptr())
        return method(out, x, group)

    return spy


@contextlib.contextmanager
def _outputs_seen(backend):
    """The addresses of the outputs ``backend`` is asked to write."""
    seen: list[int] = []
    backend.all_gather = _spy(backend.all_gather, seen)
    backend.reduce_scatter = _spy(backend.reduce_scatter, seen)
    try:
        yield seen
    finally:
        del backend.all_gather, backend.reduce_scatter


def _into_buffers(backend: str, timeout: float, nodes: bool) -> list:
    """``(label, passed)`` for each case: into ``out`` (twice, reused; and
    async) the same as the functional call, and straight from the backend
    where it can be."""
    os.environ["SHARDAX_BACKEND"] = backend
    if nodes:
        os.environ["SHARDAX_NODE_ID"] = f"test-node-{SPLIT[dist.get_rank()]}"
    try:
        mesh = sx.Mesh({"x": -1}, timeout=timeout)
        n, rank = mesh.size(), dist.get_rank()
        results = []
        for dtype in DTYPES:
            for label, name, shape, kw, direct in _cases(n, rank):
                op = getattr(C, name)
                first, second = _data(shape, dtype, 10 * rank), _data(shape, dtype, 3 - rank)
                want = [op(first, "x", mesh=mesh, **kw), op(second, "x", mesh=mesh, **kw)]
                out = torch.full_like(want[0], 7, memory_format=torch.contiguous_format)
                with _outputs_seen(comm_of(mesh.group("x")).backend) as seen:
                    same = op(first, "x", mesh=mesh, out=out, **kw)
                    ok = same is out and torch.equal(out, want[0])
                    again = op(second, "x", mesh=mesh, out=out, **kw)  # reused
                    ok = ok and again is out and torch.equal(out, want[1])
                hits = seen.count(out.data_ptr())  # written straight into, or not at all
                ok = ok and (out.numel() == 0 or hits == (2 if direct else 0))
                fresh = torch.empty_like(out)
                later = op(first, "x", mesh=mesh, out=fresh, async_op=True, **kw).wait()
                ok = ok and later is fresh and torch.equal(fresh, want[0])
                results.append((f"{label} {dtype}", ok))
        if nodes:
            how = comm_of(mesh.group("x")).backend.describe(mesh.group("x"))
            results.append((f"hierarchical, not {how!r}", "hierarchical" in how))
        return results
    finally:
        del os.environ["SHARDAX_BACKEND"]
        os.environ.pop("SHARDAX_NODE_ID", None)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("backend", "world_size", "nodes"),
    [("shm", 2, False), ("torch", 2, False), ("shm", 4, False), ("torch", 4, False),
     ("shm", 4, True)],
    ids=["shm-ws2", "gloo-ws2", "shm-ws4", "gloo-ws4", "hierarchical-ws4"],
)  # fmt: skip
def test_gather_and_scatter_into_a_buffer_equal_the_functional_call(backend, world_size, nodes):
    timeout = 631.0 + 2 * ["shm", "torch"].index(backend) + nodes  # fresh groups for each
    for rank, per_rank in enumerate(run_ranks(_into_buffers, backend, timeout, nodes,
                                              world_size=world_size)):  # fmt: skip
        failed = [label for label, ok in per_rank if not ok]
        assert not failed, (rank, failed)
        assert len(per_rank) == len(DTYPES) * len(_cases(world_size, rank)) + nodes


def test_gather_and_scatter_into_a_buffer_on_one_rank():
    """A size-1 axis copies into ``out`` (no backend), tiled or not."""
    mesh = sx.Mesh({"x": 1})
    x = torch.arange(6.0).view(2, 3)
    cases = [
        (C.all_gather, {}, x, x),
        (C.all_gather, {"tiled": False, "dim": 1}, x, x[:, None]),
        (C.psum_scatter, {"dim": 1}, x, x),
        (C.psum_scatter, {"tiled": False}, x[:1], x[0]),
    ]
    for op, kw, arg, want in cases:
        out = torch.empty_like(want)
        assert op(arg, "x", mesh=mesh, out=out, **kw) is out and torch.equal(out, want)
        pending = op(arg, "x", mesh=mesh, out=out, async_op=True, **kw)
        assert pending.wait() is out
