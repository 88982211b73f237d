"""AdamW steps on CPU: shardax's ``optim.adamw`` — ``optim.fused_step``
(update and apply in place, in one native pass), ``update`` followed by
``apply_updates(donate=True)``, the reference chain of foreach transforms
(``SHARDAX_NO_NATIVE``), and the one-pass step of bf16 params with fp32
master weights — against ``torch.optim.AdamW`` (foreach and fused) and,
where importable, DeepSpeed's ``DeepSpeedCPUAdam``, side by side on the same
25M-element step, interleaved and repeated; milliseconds per step and the
GB/s of the state they stream (a step reads param, grad, exp_avg, exp_avg_sq
and writes three of them: 28 bytes per element, counted the same for every
implementation — the bf16-master step reads a bf16 gradient and writes a
bf16 param besides, also 28). The ``*_gpt_leaves`` rows step the same
number of elements cut into a GPT's 144 leaves of very uneven sizes (what a
model hands an optimizer): shardax steps them in one native call.

The memory's pace is measured in the same loop, on buffers of the same
size (``stream``): STREAM's copy ``a = b`` and triad ``a = b + s·c``,
counted as STREAM counts them (8 and 12 bytes per element), and an in-place
update ``a += s·b`` (12 bytes), which writes only lines it has just read, as
an optimizer step does — copy and triad write lines they have not read, and
the read for ownership that costs is not counted, so they understate what a
step can reach. ``of_stream`` is each row's GB/s over the best of the three
(a step, streaming four arrays at once, can pass it: one core keeps more
lines in flight that way).

    python benchmarks/optim.py --json optim.json     # 3 processes x 15 steps each
    python benchmarks/optim.py --smoke               # seconds
    python benchmarks/optim.py --device cuda --numel 100000000   # on a GPU (needs CuPy)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import optree
import torch

import shardax as sx

BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v
STREAM_BYTES = {"copy": 8, "triad": 12, "update": 12}  # per element, as STREAM counts


def _stream(n: int) -> dict[str, Callable[[], None]]:
    """The memory's pace on ``n``-element fp32 buffers (see the top of the
    file), with torch's kernels on as many threads as the steps."""
    a, b, c = torch.randn(n), torch.randn(n), torch.randn(n)
    return {
        "copy": lambda: a.copy_(b),
        "triad": lambda: torch.add(b, c, alpha=0.5, out=a),
        "update": lambda: a.add_(b, alpha=1e-9),
    }


def gpt_sizes(n: int, layers: int = 12) -> list[int]:
    """About ``n`` elements cut as a GPT's blocks cut them (width d): per
    layer two layer norms, the attention's qkv and projection, the MLP's two
    matrices, each with its bias — 12 leaves of very uneven sizes."""
    d = max(1, int((n / (12 * layers)) ** 0.5))
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return block * layers


def gpt_shapes(n: int, layers: int = 12) -> list[tuple[int, ...]]:
    """:func:`gpt_sizes`'s leaves as a GPT's shapes: its matrices 2-D (what
    Muon orthogonalizes), its norms and biases 1-D."""
    d = max(1, int((n / (12 * layers)) ** 0.5))
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,),
             (d, 4 * d), (d,)]  # fmt: skip
    return block * layers


def _shardax_muon(params: dict, grads: dict, ns_dtype: torch.dtype) -> tuple[Callable, Any]:
    """A step of ``optim.muon`` with its Newton–Schulz in ``ns_dtype``, and its state."""
    opt = sx.optim.muon(0.02, weight_decay=0.1, ns_dtype=ns_dtype)
    box = {"params": dict(params), "state": opt.init(params)}

    def step() -> None:
        box["params"], box["state"] = sx.optim.step(opt, grads, box["state"], box["params"])

    return step, box


def _muon(n: int) -> tuple[dict[str, Callable[[], None]], dict[str, float]]:
    """Muon on a GPT's leaves (:func:`gpt_shapes`, about ``n`` elements):
    shardax's ``optim.muon`` with its Newton–Schulz in fp32 (its default)
    and in bf16, and torch's ``optim.Muon(adjust_lr_fn="match_rms_adamw")``
    (bf16) for the matrices with ``optim.AdamW`` for the rest — the same
    arithmetic — and the optimizer state each keeps, in bytes per parameter."""
    shapes = gpt_shapes(n)
    params = {f"blocks.{i}.w": torch.randn(s) for i, s in enumerate(shapes)}
    grads = {k: torch.randn(v.shape) for k, v in params.items()}
    ours, box = _shardax_muon(params, grads, torch.float32)
    ours_bf16, _ = _shardax_muon(params, grads, torch.bfloat16)

    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    for p, g in zip(ps, grads.values(), strict=True):
        p.grad = g.clone()
    mats, vecs = [p for p in ps if p.ndim == 2], [p for p in ps if p.ndim != 2]
    muon = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(vecs, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)

    def theirs() -> None:
        muon.step()
        adamw.step()

    numel = sum(p.numel() for p in ps)
    ours()  # the state exists after a step (torch's lazily)
    theirs()
    held = [t for t in optree.tree_leaves(box["state"]) if isinstance(t, torch.Tensor) and t.ndim]
    torch_held = [t for st in (*muon.state.values(), *adamw.state.values())
                  for t in st.values() if isinstance(t, torch.Tensor) and t.ndim]  # fmt: skip
    table = sx.explain({k: torch.empty(v.shape, device="meta") for k, v in params.items()},
                       sx.AbstractMesh({"dp": 1}), sx.rules.zero(0),
                       opt_state_bytes=sx.optim.muon_state_bytes)  # fmt: skip
    state_bytes = {
        "shardax_muon": sum(t.numel() * t.element_size() for t in held) / numel,
        "torch_muon": sum(t.numel() * t.element_size() for t in torch_held) / numel,
        "explain": max(dict(table.roles)["opt_state"]) / numel,
        "adamw": 8.0,
    }
    steps = {"shardax_muon_gpt_leaves": ours, "shardax_muon_bf16_gpt_leaves": ours_bf16,
             "torch_muon_gpt_leaves": theirs}  # fmt: skip
    return steps, state_bytes


def _sizes(n: int, leaves: str) -> list[int]:
    return [n] if leaves == "one" else gpt_sizes(n)


def _shardax(n: int, native: bool, fused_step: bool, dtype: torch.dtype = torch.float32,
             leaves: str = "one"):  # fmt: skip
    params = {f"p{i}": torch.randn(k).to(dtype) for i, k in enumerate(_sizes(n, leaves))}
    grads = {k: torch.randn(v.shape).to(dtype) for k, v in params.items()}
    opt = sx.optim.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    if dtype != torch.float32:
        opt = sx.optim.with_master_weights(opt)
    state = opt.init(params)
    stepper = sx.optim.fused_step(opt)  # in place, one native pass

    def step() -> None:
        nonlocal params, state
        if fused_step:
            params, state = stepper.step(params, grads, state)
        else:
            updates, state = opt.update(grads, state, params)
            params = sx.optim.apply_updates(params, updates, donate=True)

    if native:
        return step

    def reference() -> None:  # the pure-torch transforms
        os.environ["SHARDAX_NO_NATIVE"] = "1"
        try:
            step()
        finally:
            os.environ.pop("SHARDAX_NO_NATIVE", None)

    return reference


def _torch(n: int, leaves: str = "one", **kind: bool) -> Callable[[], None]:
    ps = [torch.nn.Parameter(torch.randn(k)) for k in _sizes(n, leaves)]
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **kind)
    return opt.step


def _measure(numel: int, reps: int, seed: int) -> tuple[dict[str, list[float]], str | None]:
    """This process's run: every step ``reps`` times, interleaved; the
    seconds of each call per row, and why DeepSpeed was skipped (or None)."""
    steps = {
        "shardax_step": _shardax(numel, native=True, fused_step=True),
        "shardax": _shardax(numel, native=True, fused_step=False),
        "shardax_reference": _shardax(numel, native=False, fused_step=False),
        "shardax_step_bf16_master": _shardax(numel, True, True, torch.bfloat16),
        "torch_foreach": _torch(numel, foreach=True),
        "torch_fused": _torch(numel, fused=True),
        # the same elements as a GPT's 144 leaves (one native call per step)
        "shardax_step_gpt_leaves": _shardax(numel, True, True, leaves="gpt"),
        "torch_fused_gpt_leaves": _torch(numel, "gpt", fused=True),
    }
    steps.update(_muon(numel)[0])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _deepspeed import cpu_adamw

    p, g = torch.randn(numel), torch.randn(numel)
    ds_step, ds_skipped = cpu_adamw([p], [g], lr=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                    weight_decay=0.1)  # fmt: skip
    if ds_step is not None:
        steps["deepspeed_cpu_adam"] = ds_step
    # the memory's pace, interleaved with the steps (the same noise for both)
    steps.update({f"stream_{k}": fn for k, fn in _stream(numel).items()})
    times: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():  # warm up: first-touch page faults, kernel build
        fn()
        fn()
    names = list(steps)
    order = random.Random(seed)
    for _ in range(reps):  # interleaved, in a new order each time: a step runs after
        order.shuffle(names)  # what the one before left in the caches, so none always
        for name in names:  # follows the same one (a rotation would keep the neighbours)
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times, ds_skipped


def _in_processes(args: argparse.Namespace, reps: int) -> tuple[list[dict], str | None]:
    """``_measure`` in ``args.processes`` fresh processes, one after another."""
    runs = []
    skipped = None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            out = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", out, "--seed", str(i),
                   "--numel", str(args.numel), "--reps", str(reps), "--threads", str(args.threads)]  # fmt: skip
            # as under `shardax launch`: torch backs large tensors with huge pages
            env = {"THP_MEM_ALLOC_ENABLE": "1", **os.environ}
            subprocess.run(cmd, check=True, env=env)
            with open(out) as f:
                done = json.load(f)
            runs.append(done["times"])
            skipped = done["skipped"]
    return runs, skipped


def _cuda(numel: int, reps: int) -> dict[str, dict[str, float]]:
    """On the GPU: shardax's CUDA AdamW kernel (:mod:`shardax.kernels.cuda`)
    against torch's fused and foreach AdamW and a plain copy of the same
    bytes (the bandwidth ceiling), each timed by CUDA events, interleaved."""
    from shardax.kernels import cuda

    dev = torch.device("cuda")
    p, g, m, v = (torch.randn(numel, device=dev) for _ in range(4))
    v.abs_()
    count = [0]

    def ours() -> None:
        count[0] += 1
        cuda.adamw_(p, g, m, v, step=count[0], lr=1e-3, weight_decay=0.1)

    steps: dict[str, Callable[[], None]] = {"shardax_cuda_adamw": ours}
    for kind in ("fused", "foreach"):
        tp = torch.nn.Parameter(torch.randn(numel, device=dev))
        tp.grad = torch.randn(numel, device=dev)
        topt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.1, **{kind: True})
        steps[f"torch_{kind}"] = topt.step
    src = torch.empty(BYTES_PER_ELEMENT * numel // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)  # 14 bytes per element read and 14 written, as a step moves
    steps["copy"] = lambda: dst.copy_(src)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():
        fn()
    torch.cuda.synchronize()
    names, order = list(steps), random.Random(0)
    for _ in range(reps):
        order.shuffle(names)
        for name in names:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            steps[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    rows = {}
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows[name] = {"ms": ms, "TBps": BYTES_PER_ELEMENT * numel / (ms / 1e3) / 1e12}
    for r in rows.values():
        r["vs_torch_fused"] = rows["torch_fused"]["ms"] / r["ms"]
        r["of_copy"] = rows["copy"]["ms"] / r["ms"]
    return rows


def _cuda_main(args: argparse.Namespace) -> int:
    numel, reps = (1_000_000, 3) if args.smoke else (args.numel, args.reps)
    result: dict = {"benchmark": "optim", "device": "cuda", "numel": numel}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA device is visible"
        print(f"optim on cuda: skipped ({result['skipped']})")
    else:
        try:
            result["results"] = _cuda(numel, reps)
            result["gpu"] = torch.cuda.get_device_name()
        except ImportError as err:
            result["skipped"] = f"cannot import cupy ({err})"
            print(f"optim on cuda: skipped ({result['skipped']})")
    for name, r in result.get("results", {}).items():
        print(f"{name:<22}{r['ms']:>9.3f} ms{r['TBps']:>7.2f} TB/s  x{r['vs_torch_fused']:.2f} "
              f"torch fused  {100 * r['of_copy']:.0f}% of copy")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: shardax's CUDA AdamW kernel against torch's on the GPU "
        "(--numel 100000000 for the 100M-element goal)",
    )  # fmt: skip
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--reps", type=int, default=15, help="steps of each row per process")
    parser.add_argument(
        "--processes", type=int, default=3,
        help="fresh processes to run the reps in, one after another: each allocates its "
        "buffers anew, and where they land in memory moves a step by up to ±5%% here; "
        "they run with THP_MEM_ALLOC_ENABLE=1 (huge pages) unless it is set, as under "
        "shardax launch",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="100k elements, 2 reps, 1 process")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # write one process's times here
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        return _cuda_main(args)
    numel, reps = (100_000, 2) if args.smoke else (args.numel, args.reps)
    torch.set_num_threads(args.threads)
    if args.child:
        times, skipped = _measure(numel, reps, args.seed)
        with open(args.child, "w") as f:
            json.dump({"times": times, "skipped": skipped}, f)
        return 0
    if args.smoke or args.processes <= 1:
        times, ds_skipped = _measure(numel, reps, args.seed)
        runs = [times]
    else:
        runs, ds_skipped = _in_processes(args, reps)
    from shardax.kernels import OPTIM

    rows, stream, muon = {}, {}, {}
    for name in runs[0]:
        ts = [t for run in runs for t in run[name]]
        ms = 1e3 * statistics.median(ts)
        kind = name.removeprefix("stream_")
        elements = sum(gpt_sizes(numel)) if name.endswith("_gpt_leaves") else numel
        per_element = STREAM_BYTES[kind] if name.startswith("stream_") else BYTES_PER_ELEMENT
        row = {
            "ms": ms,
            "GBps": per_element * elements / (ms / 1e3) / 1e9,
            "process_ms": [1e3 * statistics.median(run[name]) for run in runs],
            "all_ms": [1e3 * t for t in ts],
        }
        if "_muon_" in name:  # compute-bound matrix products: no bytes-per-element pace
            del row["GBps"]
            muon[name] = row
        elif name.startswith("stream_"):
            stream[kind] = row
        else:
            rows[name] = row
    stream_gbps = max(r["GBps"] for r in stream.values())
    fused = rows["torch_fused"]["ms"]
    for r in rows.values():
        r["vs_torch_fused"] = fused / r["ms"]
        r["of_stream"] = r["GBps"] / stream_gbps
    for r in muon.values():
        r["vs_torch_muon"] = muon["torch_muon_gpt_leaves"]["ms"] / r["ms"]
    result = {
        "benchmark": "optim",
        "numel": numel,
        "threads": args.threads,
        "processes": len(runs),
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "1" if len(runs) > 1 else "0"),
        "torch": torch.__version__,
        "native": OPTIM.status(),
        "deepspeed": {"skipped": ds_skipped},
        "stream": {"GBps": stream_gbps, **stream},
        "results": rows,
        "muon": {**muon, "state_bytes_per_param": _muon(min(numel, 1_000_000))[1]},
    }
    print(
        f"AdamW step, {numel:,} fp32 elements, {args.threads} threads, median of {reps} "
        f"steps x {len(runs)} processes (per-process medians in brackets)"
    )
    pace = ", ".join(f"{k} {r['GBps']:.1f}" for k, r in stream.items())
    print(f"stream, measured in the same loop: {pace} GB/s")
    for name, r in rows.items():
        each = " ".join(f"{x:.1f}" for x in r["process_ms"])
        print(
            f"{name:<26}{r['ms']:>9.1f} ms{r['GBps']:>8.1f} GB/s {r['of_stream']:>4.0%} of stream  "
            f"x{r['vs_torch_fused']:.2f} torch fused  [{each}]"
        )
    for name, r in muon.items():
        print(f"{name:<26}{r['ms']:>9.1f} ms  x{r['vs_torch_muon']:.2f} torch Muon")
    print("optimizer state, bytes per parameter: " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["muon"]["state_bytes_per_param"].items()))  # fmt: skip
    if ds_skipped:
        print(f"deepspeed_cpu_adam: skipped ({ds_skipped})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
