"""AdamW steps on CPU: shardax's ``optim.adamw`` (the fused native update,
then ``apply_updates(donate=True)``; and the reference chain of foreach
transforms, ``SHARDAX_NO_NATIVE``) against ``torch.optim.AdamW`` (foreach
and fused), side by side on the same 25M-element fp32 step, interleaved and
repeated; milliseconds per step and the GB/s of the state they stream (a
step reads param, grad, exp_avg, exp_avg_sq and writes three of them: 28
bytes per element for every implementation, counted the same).

    python benchmarks/optim.py --json optim.json
    python benchmarks/optim.py --smoke          # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import shardax as sx

BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v


def _shardax(n: int, native: bool) -> Callable[[], None]:
    params = {"w": torch.randn(n)}
    grads = {"w": torch.randn(n)}
    opt = sx.optim.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    state = opt.init(params)

    def step() -> None:
        nonlocal params, state
        if native:
            os.environ.pop("SHARDAX_NO_NATIVE", None)
        else:
            os.environ["SHARDAX_NO_NATIVE"] = "1"
        try:
            updates, state = opt.update(grads, state, params)
            params = sx.optim.apply_updates(params, updates, donate=True)
        finally:
            os.environ.pop("SHARDAX_NO_NATIVE", None)

    return step


def _torch(n: int, **kind: bool) -> Callable[[], None]:
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **kind)
    return opt.step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="100k elements, 2 reps")
    args = parser.parse_args(argv)
    numel, reps = (100_000, 2) if args.smoke else (args.numel, args.reps)
    torch.set_num_threads(args.threads)
    steps = {
        "shardax": _shardax(numel, native=True),
        "shardax_reference": _shardax(numel, native=False),
        "torch_foreach": _torch(numel, foreach=True),
        "torch_fused": _torch(numel, fused=True),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():  # warm up: first-touch page faults, kernel build
        fn()
        fn()
    for _ in range(reps):  # interleaved
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    from shardax.kernels import OPTIM

    rows = {}
    for name, ts in times.items():
        ms = 1e3 * statistics.median(ts)
        rows[name] = {"ms": ms, "GBps": BYTES_PER_ELEMENT * numel / (ms / 1e3) / 1e9, "all_ms": ts}
    fused = rows["torch_fused"]["ms"]
    for r in rows.values():
        r["vs_torch_fused"] = fused / r["ms"]
    result = {
        "benchmark": "optim",
        "numel": numel,
        "threads": args.threads,
        "torch": torch.__version__,
        "native": OPTIM.status(),
        "results": rows,
    }
    print(f"AdamW step, {numel:,} fp32 elements, {args.threads} threads, median of {reps}")
    for name, r in rows.items():
        print(
            f"{name:<20}{r['ms']:>9.1f} ms{r['GBps']:>8.1f} GB/s  x{r['vs_torch_fused']:.2f} torch fused"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
