"""Collectives: shardax (its shared-memory backend on one node) against raw
torch.distributed (gloo), side by side, with memcpy as the physical limit.

Each op runs both ways on the same buffers, interleaved and repeated (this
host is noisy), timed as the slowest rank's wall time; the median is kept.
Bus bandwidth follows nccl-tests: all-reduce moves 2(n-1)/n of the buffer per
rank, all-gather, reduce-scatter and all-to-all (n-1)/n. ``ratio`` is torch's
time over shardax's: above 1, shardax is faster.

    shardax launch --nproc-per-node 2 benchmarks/collectives.py --json collectives.json
    shardax launch --nproc-per-node 2 benchmarks/collectives.py --smoke   # seconds

Each row also has ``algbw`` (bytes / time) and the single-process memcpy
bandwidth of a buffer that size (``memcpy_GBps``: the most any copy through
memory can do; ``shardax_vs_memcpy`` is the shared-memory busbw's fraction
of it). With ``SHARDAX_BACKEND=torch`` the shardax column is gloo too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import shardax as sx
from shardax import collectives as C

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _timed(fn: Callable[[], object], mesh: sx.Mesh) -> float:
    C.barrier(mesh=mesh)
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if mesh.size() > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def cases(mesh: sx.Mesh, numel: int) -> dict[str, tuple[float, Callable, Callable]]:
    """op → (bus factor, torch version, shardax version) for a ``numel`` buffer."""
    n = mesh.size()
    chunk = numel // n
    full = torch.randn(chunk * n)
    piece = torch.randn(chunk)
    out_full, out_piece = torch.empty(chunk * n), torch.empty(chunk)
    grid = full.view(n, chunk)
    a2a_out = torch.empty(chunk * n)
    return {
        "all_reduce": (
            2 * (n - 1) / n,
            lambda: dist.all_reduce(full),
            lambda: C.psum(full, "x", mesh=mesh),
        ),
        "all_gather": (
            (n - 1) / n,
            lambda: _all_gather_flat(out_full, piece),
            lambda: C.all_gather(piece, "x", 0, sizes=(chunk,) * n, mesh=mesh),
        ),
        "reduce_scatter": (
            (n - 1) / n,
            lambda: _reduce_scatter_flat(out_piece, full),
            lambda: C.psum_scatter(full, "x", 0, mesh=mesh),
        ),
        "all_to_all": (
            (n - 1) / n,
            lambda: dist.all_to_all_single(a2a_out, full),
            lambda: C.all_to_all(grid, "x", 0, 1, concat_sizes=(chunk,) * n, mesh=mesh),
        ),
    }


def memcpy_gbps(nbytes: int, reps: int) -> float:
    """Median bandwidth of copying ``nbytes`` between two buffers in this
    process (read + write counted once, as a collective's bytes are)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(max(reps, 3)):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def run(sizes: list[int], reps: int, mesh: sx.Mesh) -> list[dict]:
    rows = []
    for numel in sizes:
        memcpy = memcpy_gbps(numel * 4, reps)
        for op, (factor, torch_fn, shardax_fn) in cases(mesh, numel).items():
            torch_fn(), shardax_fn()  # warm up both
            times: dict[str, list[float]] = {"torch": [], "shardax": []}
            for _ in range(reps):  # interleaved
                times["torch"].append(_timed(torch_fn, mesh))
                times["shardax"].append(_timed(shardax_fn, mesh))
            t_torch, t_ours = statistics.median(times["torch"]), statistics.median(times["shardax"])
            nbytes = numel * 4
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "torch_s": t_torch,
                    "shardax_s": t_ours,
                    "ratio": t_torch / t_ours,
                    "torch_busbw_GBps": factor * nbytes / t_torch / 1e9,
                    "shardax_busbw_GBps": factor * nbytes / t_ours / 1e9,
                    "torch_algbw_GBps": nbytes / t_torch / 1e9,
                    "shardax_algbw_GBps": nbytes / t_ours / 1e9,
                    "memcpy_GBps": memcpy,
                    "shardax_vs_memcpy": factor * nbytes / t_ours / 1e9 / memcpy,
                    "reps": reps,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,16,64,256", help="buffer sizes in MiB (float32)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 reps: seconds")
    args = parser.parse_args(argv)
    info = sx.init()
    torch.set_num_threads(1)
    mesh = sx.Mesh({"x": -1})
    if args.smoke:
        sizes, reps = [1024, 16 * 1024], 2
    else:
        sizes, reps = [int(float(s) * 2**20 / 4) for s in args.sizes_mb.split(",")], args.reps
    sizes = [max(mesh.size(), s - s % mesh.size()) for s in sizes]
    rows = run(sizes, reps, mesh)
    if info.rank == 0:
        result = {
            "benchmark": "collectives",
            "world_size": info.world_size,
            "torch_backend": info.backend,
            "shardax_backend": C.get_backend().name,
            "torch": torch.__version__,
            "results": rows,
        }
        print(f"busbw in GB/s; torch: {info.backend}, shardax: {C.get_backend().name}")
        print(
            f"{'op':<15}{'MiB':>8}{'torch':>8}{'shardax':>9}{'ratio':>7}{'memcpy':>8}{'of memcpy':>11}"
        )
        for r in rows:
            print(
                f"{r['op']:<15}{r['bytes'] / 2**20:>8.2f}{r['torch_busbw_GBps']:>8.2f}"
                f"{r['shardax_busbw_GBps']:>9.2f}{r['ratio']:>7.2f}{r['memcpy_GBps']:>8.2f}"
                f"{r['shardax_vs_memcpy']:>11.0%}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    sx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
