"""What the collectives' signature check costs: each collective with the
check and without, side by side on one group of each backend (``shm``, the
default on one CPU node, and gloo through ``torch``), interleaved and
repeated (this host is noisy).

Each repetition times ``--calls`` collectives of each kind (a 1-element
``psum``: the check's fixed cost shows whole; and a ZeRO-3 sized
``all_gather`` / ``psum_scatter`` of ``--numel`` elements per rank) as the
slowest rank's wall time. A row gives the median time per collective with
and without the check, and the difference. The check costs the same
whatever the buffer; ``per_step`` multiplies its cost on the 1-element
``psum`` (where it is measured precisely) — and, as ``*_by_op``, each op's
measured difference in that step's mix (16 all-gathers, 14 reduce-scatters,
one pmean: an upper bound, noisier) — by the collectives of one ``benchmarks/train.py --preset bench``
ZeRO-3 step (``--calls-per-step``, 31 there: 16 all-gathers, 14
reduce-scatters, one pmean) and relates it to that step's time
(``--step-ms``): the check's share of a training step.

    shardax launch --nproc-per-node 2 benchmarks/check_cost.py --json check_cost.json
    shardax launch --nproc-per-node 2 benchmarks/check_cost.py --smoke     # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import shardax as sx
from shardax import collectives as C
from shardax.collectives import _shm_backend

# Distinct timeouts give each (backend, check) its own process groups: both
# are fixed when a group is made.
TIMEOUTS = {("shm", True): 701.0, ("shm", False): 702.0, ("torch", True): 703.0,
            ("torch", False): 704.0}  # fmt: skip


def _mesh(backend: str, check: bool) -> sx.Mesh:
    saved = {k: os.environ.get(k) for k in ("SHARDAX_BACKEND", "SHARDAX_CHECK_COLLECTIVES")}
    os.environ["SHARDAX_BACKEND"] = backend
    os.environ["SHARDAX_CHECK_COLLECTIVES"] = "1" if check else "0"
    try:
        return sx.Mesh({"x": -1}, timeout=TIMEOUTS[(backend, check)])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _time(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item() / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="collectives per repetition")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--numel", type=int, default=2**20, help="per rank, gather/scatter")
    parser.add_argument("--calls-per-step", type=int, default=31)
    parser.add_argument("--step-ms", type=float, default=2400.0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: seconds")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.repeats, args.numel = 5, 2, 64
    torch.set_num_threads(1)
    sx.init()
    backends = ["torch"] + (["shm"] if _shm_backend.shm_available()[0] else [])
    meshes = {(b, c): _mesh(b, c) for b in backends for c in (True, False)}
    n = meshes[(backends[0], True)].size("x")
    one = torch.ones(1)
    piece = torch.ones(args.numel)
    whole = torch.ones(n * args.numel)
    ops: dict[str, Callable[[sx.Mesh], object]] = {
        "psum_1": lambda m: C.psum(one, "x", mesh=m),
        "all_gather": lambda m: C.all_gather(piece, "x", mesh=m, tiled=True),
        "psum_scatter": lambda m: C.psum_scatter(whole, "x", mesh=m, tiled=True),
    }
    times: dict[tuple[str, str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for (backend, check), mesh in meshes.items():
            for name, op in ops.items():
                calls = args.calls if name == "psum_1" else max(1, args.calls // 10)
                t = _time(lambda op=op, mesh=mesh: op(mesh), calls)
                times.setdefault((backend, name, check), []).append(t)
    rows = []
    for backend in backends:
        for name in ops:
            on = statistics.median(times[(backend, name, True)])
            off = statistics.median(times[(backend, name, False)])
            rows.append({"backend": backend, "op": name, "checked_us": on * 1e6,
                         "unchecked_us": off * 1e6, "cost_us": (on - off) * 1e6})  # fmt: skip
    per_step = {}
    mix = {"all_gather": 16, "psum_scatter": 14, "psum_1": 1}  # one bench ZeRO-3 step's
    scale = args.calls_per_step / sum(mix.values())
    for backend in backends:
        cost = {r["op"]: r["cost_us"] for r in rows if r["backend"] == backend}
        fixed = max(cost["psum_1"], 0.0) * args.calls_per_step / 1e3
        by_op = max(sum(n * cost[op] for op, n in mix.items()), 0.0) * scale / 1e3
        per_step[backend] = {
            "cost_ms": fixed, "fraction_of_step": fixed / args.step_ms,
            "cost_ms_by_op": by_op, "fraction_of_step_by_op": by_op / args.step_ms,
        }  # fmt: skip
    result = {"benchmark": "check_cost", "world_size": n, "numel": args.numel,
              "calls_per_step": args.calls_per_step, "step_ms": args.step_ms,
              "rows": rows, "per_step": per_step}  # fmt: skip
    if dist.get_rank() == 0:
        print(json.dumps(result))
        for r in rows:
            print(f"{r['backend']:>6} {r['op']:<13} checked {r['checked_us']:9.1f} µs  unchecked "
                  f"{r['unchecked_us']:9.1f} µs  cost {r['cost_us']:8.1f} µs")  # fmt: skip
        for b, s in per_step.items():
            print(
                f"{b:>6} per bench step: {s['cost_ms']:.2f} ms = {100 * s['fraction_of_step']:.2f} %"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    sx.shutdown()


if __name__ == "__main__":
    main()
