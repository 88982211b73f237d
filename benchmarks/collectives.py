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

All-reduce, all-gather and reduce-scatter run twice. Into reused buffers
(what DDP's buckets and ZeRO's flat parameter and gradient shards do):
``all_reduce`` in place (torch's ``all_reduce`` against ``psum(x, out=x)``),
``all_gather`` and ``reduce_scatter`` into a preallocated output on both
sides (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` against
``all_gather(..., out=)`` / ``psum_scatter(..., out=)``). And into a new
tensor each call (``*_new``: the functional shardax call against torch's
into a fresh tensor — for all-reduce, torch's ``all_reduce`` of a fresh
copy). All-to-all writes into a preallocated output on both sides
(``all_to_all_single`` against ``all_to_all(..., out=)``; what Ulysses'
and expert parallelism's reused activation buffers do).

All-reduce has a third column where DeepSpeed is importable (``pip install
'shardax[bench]'``): DeepSpeed's shared-memory all-reduce on CPU (the op
behind ``deepspeed.comm.inference_all_reduce``, built by
``ShareMemCommBuilder``; see ``_deepspeed.py``), in place on the same
buffer, in the same interleaved loop, checked once per size against
``torch.distributed.all_reduce`` on rank-dependent data (the run fails if
they differ). ``ratio_vs_deepspeed`` is DeepSpeed's time over shardax's.
Where it is not importable, or cannot run here, its columns are ``null``
and ``deepspeed.skipped`` in the JSON says why.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import shardax as sx
from shardax import collectives as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _deepspeed import shm_all_reduce

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
DEEPSPEED_KEYS = (
    "deepspeed_s",
    "ratio_vs_deepspeed",
    "deepspeed_busbw_GBps",
    "deepspeed_algbw_GBps",
)


def _timed(fn: Callable[[], object], mesh: sx.Mesh) -> float:
    C.barrier(mesh=mesh)
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if mesh.size() > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def cases(
    mesh: sx.Mesh, numel: int, ds_all_reduce: Callable | None = None
) -> dict[str, tuple[float, dict[str, Callable]]]:
    """op → (bus factor, {implementation: version}) for a ``numel`` buffer:
    ``torch`` and ``shardax`` for every op, ``deepspeed`` for all-reduce
    when ``ds_all_reduce`` is given."""
    n = mesh.size()
    chunk = numel // n
    full = torch.randn(chunk * n)
    piece = torch.randn(chunk)
    # Reused outputs, one per implementation (warm after the first call).
    gathered = {name: torch.empty(chunk * n) for name in ("torch", "shardax")}
    scattered = {name: torch.empty(chunk) for name in ("torch", "shardax")}
    sizes = (chunk,) * n
    grid = full.view(n, chunk)
    exchanged = {"torch": torch.empty(chunk * n), "shardax": torch.empty(1, chunk * n)}
    # In place on a reused buffer (what DDP's buckets do: torch's and
    # DeepSpeed's calls are in place), each implementation on its own buffer
    # (the sums grow from rep to rep alike: the values do not matter).
    mine = {name: torch.randn(chunk * n) for name in ("torch", "shardax", "deepspeed")}
    all_reduce = {
        "torch": lambda: dist.all_reduce(mine["torch"]),
        "shardax": lambda: C.psum(mine["shardax"], "x", mesh=mesh, out=mine["shardax"]),
    }
    if ds_all_reduce is not None:
        all_reduce["deepspeed"] = lambda: ds_all_reduce(mine["deepspeed"])
    return {
        "all_reduce": (2 * (n - 1) / n, all_reduce),
        # Into a new tensor each call: the functional psum, and torch's
        # all-reduce of a fresh copy (the allocation costs both the same).
        "all_reduce_new": (
            2 * (n - 1) / n,
            {
                "torch": lambda: dist.all_reduce(full.clone()),
                "shardax": lambda: C.psum(full, "x", mesh=mesh),
            },
        ),
        "all_gather": (
            (n - 1) / n,
            {
                "torch": lambda: _all_gather_flat(gathered["torch"], piece),
                "shardax": lambda: C.all_gather(
                    piece, "x", 0, sizes=sizes, mesh=mesh, out=gathered["shardax"]
                ),
            },
        ),
        "all_gather_new": (
            (n - 1) / n,
            {
                "torch": lambda: _all_gather_flat(torch.empty(chunk * n), piece),
                "shardax": lambda: C.all_gather(piece, "x", 0, sizes=sizes, mesh=mesh),
            },
        ),
        "reduce_scatter": (
            (n - 1) / n,
            {
                "torch": lambda: _reduce_scatter_flat(scattered["torch"], full),
                "shardax": lambda: C.psum_scatter(
                    full, "x", 0, mesh=mesh, out=scattered["shardax"]
                ),
            },
        ),
        "reduce_scatter_new": (
            (n - 1) / n,
            {
                "torch": lambda: _reduce_scatter_flat(torch.empty(chunk), full),
                "shardax": lambda: C.psum_scatter(full, "x", 0, mesh=mesh),
            },
        ),
        "all_to_all": (
            (n - 1) / n,
            {
                "torch": lambda: dist.all_to_all_single(exchanged["torch"], full),
                "shardax": lambda: C.all_to_all(
                    grid, "x", 0, 1, concat_sizes=sizes, mesh=mesh, out=exchanged["shardax"]
                ),
            },
        ),
    }


def check_all_reduce(all_reduce: Callable[[torch.Tensor], object], numel: int) -> None:
    """Fail unless ``all_reduce`` sums like ``torch.distributed.all_reduce``
    on data that differs between ranks."""
    data = torch.randn(numel, generator=torch.Generator().manual_seed(1234 + dist.get_rank()))
    expected = data.clone()
    dist.all_reduce(expected)
    all_reduce(data)
    try:
        torch.testing.assert_close(data, expected)
    except AssertionError as e:
        raise RuntimeError(
            f"DeepSpeed's all-reduce of {numel} float32 disagrees with torch's on rank "
            f"{dist.get_rank()}: {e}"
        ) from None


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


def run(
    sizes: list[int], reps: int, mesh: sx.Mesh, ds_all_reduce: Callable | None = None
) -> list[dict]:
    rows = []
    for numel in sizes:
        memcpy = memcpy_gbps(numel * 4, reps)
        if ds_all_reduce is not None:
            check_all_reduce(ds_all_reduce, numel)
        for op, (factor, impls) in cases(mesh, numel, ds_all_reduce).items():
            for fn in impls.values():  # warm up each
                fn()
            times: dict[str, list[float]] = {name: [] for name in impls}
            for _ in range(reps):  # interleaved
                for name, fn in impls.items():
                    times[name].append(_timed(fn, mesh))
            t_torch, t_ours = statistics.median(times["torch"]), statistics.median(times["shardax"])
            nbytes = numel * 4
            row = {
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
            if op == "all_reduce":
                row.update(dict.fromkeys(DEEPSPEED_KEYS))  # null where DeepSpeed is skipped
            if "deepspeed" in times:
                t_ds = statistics.median(times["deepspeed"])
                row["deepspeed_s"] = t_ds
                row["ratio_vs_deepspeed"] = t_ds / t_ours
                row["deepspeed_busbw_GBps"] = factor * nbytes / t_ds / 1e9
                row["deepspeed_algbw_GBps"] = nbytes / t_ds / 1e9
            rows.append(row)
    return rows


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    ds_all_reduce, ds_skipped = shm_all_reduce()  # every rank, after the group exists
    rows = run(sizes, reps, mesh, ds_all_reduce)
    if info.rank == 0:
        result = {
            "benchmark": "collectives",
            "world_size": info.world_size,
            "torch_backend": info.backend,
            "shardax_backend": C.get_backend().name,
            "torch": torch.__version__,
            "deepspeed": {
                "version": _version("deepspeed") if ds_all_reduce else None,
                "all_reduce": "torch.ops.deepspeed.inference_all_reduce_ (ShareMemCommBuilder)"
                if ds_all_reduce
                else None,
                "skipped": ds_skipped,
            },
            "results": rows,
        }
        print(f"busbw in GB/s; torch: {info.backend}, shardax: {C.get_backend().name}")
        print(f"deepspeed: {'shm all-reduce' if ds_all_reduce else f'skipped ({ds_skipped})'}")
        print(
            f"{'op':<19}{'MiB':>8}{'torch':>8}{'shardax':>9}{'ratio':>7}{'memcpy':>8}{'of memcpy':>11}"
            f"{'deepspeed':>11}{'vs ds':>7}"
        )
        for r in rows:
            ds = (
                f"{r['deepspeed_busbw_GBps']:>11.2f}{r['ratio_vs_deepspeed']:>7.2f}"
                if r.get("deepspeed_s")
                else f"{'-':>11}{'-':>7}"
            )
            print(
                f"{r['op']:<19}{r['bytes'] / 2**20:>8.2f}{r['torch_busbw_GBps']:>8.2f}"
                f"{r['shardax_busbw_GBps']:>9.2f}{r['ratio']:>7.2f}{r['memcpy_GBps']:>8.2f}"
                f"{r['shardax_vs_memcpy']:>11.0%}{ds}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    sx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
