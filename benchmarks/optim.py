"""AdamW steps on CPU: shardax's ``optim.adamw`` — ``optim.step(donate=True)``
(update and apply in one native pass), the fused update followed by
``apply_updates(donate=True)``, the reference chain of foreach transforms
(``SHARDAX_NO_NATIVE``), and the one-pass step of bf16 params with fp32
master weights — against ``torch.optim.AdamW`` (foreach and fused) and,
where importable, DeepSpeed's ``DeepSpeedCPUAdam``, side by side on the same
25M-element step, interleaved and repeated; milliseconds per step and the
GB/s of the state they stream (a step reads param, grad, exp_avg, exp_avg_sq
and writes three of them: 28 bytes per element, counted the same for every
implementation — the bf16-master step reads a bf16 gradient and writes a
bf16 param besides, also 28).

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


def _shardax(n: int, native: bool, fused_step: bool, dtype: torch.dtype = torch.float32):
    params = {"w": torch.randn(n).to(dtype)}
    grads = {"w": torch.randn(n).to(dtype)}
    opt = sx.optim.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    if dtype != torch.float32:
        opt = sx.optim.with_master_weights(opt)
    state = opt.init(params)

    def step() -> None:
        nonlocal params, state
        if native:
            os.environ.pop("SHARDAX_NO_NATIVE", None)
        else:
            os.environ["SHARDAX_NO_NATIVE"] = "1"
        try:
            if fused_step:
                params, state = sx.optim.step(opt, grads, state, params, donate=True)
            else:
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
        "shardax_step": _shardax(numel, native=True, fused_step=True),
        "shardax": _shardax(numel, native=True, fused_step=False),
        "shardax_reference": _shardax(numel, native=False, fused_step=False),
        "shardax_step_bf16_master": _shardax(numel, True, True, torch.bfloat16),
        "torch_foreach": _torch(numel, foreach=True),
        "torch_fused": _torch(numel, fused=True),
    }
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _deepspeed import cpu_adamw

    p, g = torch.randn(numel), torch.randn(numel)
    ds_step, ds_skipped = cpu_adamw([p], [g], lr=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                    weight_decay=0.1)  # fmt: skip
    if ds_step is not None:
        steps["deepspeed_cpu_adam"] = ds_step
    times: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():  # warm up: first-touch page faults, kernel build
        fn()
        fn()
    names = list(steps)
    for r in range(reps):  # interleaved, the order rotated (none always follows the same one)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name]()
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
        "deepspeed": {"skipped": ds_skipped},
        "results": rows,
    }
    print(f"AdamW step, {numel:,} fp32 elements, {args.threads} threads, median of {reps}")
    for name, r in rows.items():
        print(
            f"{name:<26}{r['ms']:>9.1f} ms{r['GBps']:>8.1f} GB/s  x{r['vs_torch_fused']:.2f} torch fused"
        )
    if ds_skipped:
        print(f"deepspeed_cpu_adam: skipped ({ds_skipped})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
