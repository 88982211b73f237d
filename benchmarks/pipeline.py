"""Pipeline parallelism: ``torch.distributed.pipelining``'s schedules against DDP (issue 21).

One invocation trains the same GPT (``examples/gpt.py``, the ``bench``
preset with ``--layers`` blocks, 8 by default) on the same tinyshakespeare
bytes, from the same seed, with ``train.py``'s AdamW, once per mode, on 2
ranks over gloo. A step is one global batch of ``--micro-batches``
micro-batches (8 by default) of one sequence of ``seq_len`` (256) tokens:

- ``ddp``: ``DistributedDataParallel``; each rank takes half the
  micro-batches as one batch (its data-parallel share of the same global
  batch), and DDP all-reduces the gradients;
- ``torch-gpipe`` (GPipe, Huang et al. 2019), ``torch-1f1b``
  (PipeDream-Flush, Narayanan et al. 2021): one stage per rank;
- ``torch-interleaved-1f1b`` (Megatron-LM's interleaved schedule,
  Narayanan et al. 2021), ``torch-looped-bfs`` (Lamy-Poirier 2023),
  ``torch-interleaved-zb`` (``ScheduleInterleavedZeroBubble``, Qi et al.
  2024): two stages per rank, looped — rank ``r`` holds stages ``r`` and
  ``r + ranks``;
- ``torch-zbv`` (``ScheduleZBVZeroBubble``, Qi et al. 2024, section 6),
  ``torch-dualpipev`` (``ScheduleDualPipeV``, after DeepSeek-V3's DualPipe):
  two stages per rank in a V — rank ``r`` holds stages ``r`` and
  ``2·ranks - 1 - r``.

Each pipeline stage is a ``PipelineStage`` built by hand from the dense
model (the schedule's first use infers the shapes): the layers are split
evenly, stage 0 also holds ``wte`` and ``wpe``, the last stage ``ln_f`` and
the head. The schedules' loss is the mean cross-entropy of a micro-batch and
they divide the gradients by the number of micro-batches, so every mode
steps on the gradient of the same global mean loss.

**The tied head.** The bench GPT ties its head to the token embedding,
which lives on stage 0 while the head runs on the last stage — on another
rank, except in a V. As pipeline users must (Megatron-LM's "embedding
group" does the same), the last stage holds its own copy of the embedding
weight as its head, initialised from it; after each backward the two
gradients are summed — all-reduced between the first and the last stage's
ranks, or added in place when one rank holds both — so both copies take the
gradient of the tied weight and the same AdamW update, and stay equal: every
mode computes the same tied model (``ddp`` runs it as it is), with the same
parameter count.

Every (mode, repeat) runs in fresh rank processes started by ``shardax
launch``, in ``train.py``'s environment (one thread per rank on this 2-core
host, glibc's mmap threshold at 4 MiB), modes interleaved across repeats
(A B C, A B C, …). A run builds the model, takes ``--warmup`` untimed steps,
then times ``--steps`` steps, each between two barriers (the slowest rank's
time). It prints one JSON line per run — global tokens/s, median step time,
peak RSS per rank, every step's global loss (warm-up steps first),
``first_loss`` and ``last_loss`` — and a last line summarising each mode
(medians over repeats) with its ratios against ``ddp``: tokens/s above 1 is
faster, peak RSS below 1 uses less memory. The correctness cross-check:
every mode's first loss (same weights, same batch) must agree with
``ddp``'s to 1e-4 (``first_loss_vs_ddp``); a mode that does not fails the
run (exit code 1). A readable table goes to stderr.

    python benchmarks/pipeline.py --repeats 3 --out pipeline.json
    python benchmarks/pipeline.py --modes ddp,torch-1f1b,torch-zbv --layers 4
    python benchmarks/pipeline.py --smoke     # tiny model: seconds per mode
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import NoReturn

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from _data import (  # noqa: E402  (beside this file, as train.py)
    batch,
    interleaved,
    launch_run,
    load_tokens,
    peak_rss_mib,
    rss_per_rank,
    threads_per_rank,
    timed_steps,
)
from gpt import GPT, PRESETS, GPTConfig, param_count  # noqa: E402
from train import (  # noqa: E402
    BETAS,
    DATA,
    EPS,
    LOSS_TOLERANCE,
    LR,
    WEIGHT_DECAY,
    Step,
    _dense_model,
    _loss,
    _torch_adamw,
    setup_ddp,
    summarize,
)

# name: (torch.distributed.pipelining schedule, stages per rank, placement)
TORCH_SCHEDULES: dict[str, tuple[str, int, str]] = {
    "torch-gpipe": ("ScheduleGPipe", 1, "loop"),
    "torch-1f1b": ("Schedule1F1B", 1, "loop"),
    "torch-interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "torch-looped-bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "torch-interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "torch-zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "torch-dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
# name: (shardax.pipeline schedule, balance) — the same placements as torch's; "layers": the
# blocks split evenly, as torch's modes; "time": split(balance="time") on rank 0's measurement
SHARDAX_SCHEDULES: dict[str, tuple[str, str]] = {
    "shardax-gpipe": ("gpipe", "layers"),
    "shardax-1f1b": ("1f1b", "layers"),
    "shardax-interleaved-1f1b": ("interleaved_1f1b", "layers"),
    "shardax-looped-bfs": ("looped_bfs", "layers"),
    "shardax-zb-h1": ("zb_h1", "layers"),
    "shardax-zbv": ("zbv", "layers"),
    "shardax-dualpipev": ("dualpipe_v", "layers"),
    "shardax-1f1b-timed": ("1f1b", "time"),
    "shardax-zb-h1-timed": ("zb_h1", "time"),
    "shardax-zbv-timed": ("zbv", "time"),
}
SHARDAX_MODES: list[str] = list(SHARDAX_SCHEDULES)
ALL_MODES = ["ddp", *TORCH_SCHEDULES, *SHARDAX_MODES]
TIMEOUT_S = 120.0  # a step takes seconds: a rank silent this long is stuck


# ---------------------------------------------------------------- the pipeline


def stage_indices(rank: int, ranks: int, per_rank: int, placement: str) -> list[int]:
    """The stages rank ``rank`` holds: looped (``r``, ``r + ranks``, …) or in a V.

    >>> stage_indices(0, 2, 2, "loop"), stage_indices(0, 2, 2, "v")
    ([0, 2], [0, 3])
    """
    if placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(per_rank)]


class Stage(nn.Module):
    """Stage ``index`` of ``stages`` of a :class:`GPT`: its share of the
    blocks, with ``wte``/``wpe`` on the first stage and ``ln_f`` and the head
    on the last. A tied head becomes a copy of the embedding weight (see the
    module's docstring)."""

    def __init__(self, model: GPT, index: int, stages: int) -> None:
        super().__init__()
        cfg = model.cfg
        if cfg.n_layers % stages:
            raise ValueError(
                f"{cfg.n_layers} layers do not split evenly over {stages} pipeline stages; "
                "pass --layers as a multiple of the stages (2 per rank for the virtual modes)"
            )
        per = cfg.n_layers // stages
        self.blocks = nn.ModuleList(model.blocks[index * per : (index + 1) * per])
        self.first, self.last = index == 0, index == stages - 1
        self.scale = cfg.d_model**-0.5 if cfg.tie_embeddings else 1.0  # GPT.forward's
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            if cfg.tie_embeddings:
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device="meta")
                self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]).unsqueeze(0))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x) * self.scale) if self.last else x


def _tie_gradients(stages: list[Stage], group: dist.ProcessGroup | None) -> None:
    """Sum the embedding's and the head copy's gradients where this rank
    holds either; both copies then carry the tied weight's gradient."""
    grads = [s.wte.weight.grad for s in stages if s.first]
    grads += [s.lm_head.weight.grad for s in stages if s.last]
    if len(grads) == 2:  # one rank holds both (a V)
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
    elif grads and group is not None:
        dist.all_reduce(grads[0], group=group)


def setup_torch_pipeline(mode: str, cfg: GPTConfig, seed: int, micro_batches: int) -> Step:
    """``torch.distributed.pipelining``: this rank's ``PipelineStage``\\ s
    and ``mode``'s schedule; the step returns this rank's share of the
    global loss (the mean over micro-batches on the last stage's rank, 0
    elsewhere)."""
    name, per_rank, placement = TORCH_SCHEDULES[mode]
    rank, ranks = dist.get_rank(), dist.get_world_size()
    n = per_rank * ranks
    owner = {s: r for r in range(ranks) for s in stage_indices(r, ranks, per_rank, placement)}
    tied = sorted({owner[0], owner[n - 1]})
    group = dist.new_group(tied) if cfg.tie_embeddings and len(tied) == 2 else None  # collective
    mine = stage_indices(rank, ranks, per_rank, placement)
    model = _dense_model(cfg, seed)  # every rank draws the dense init, keeps its stages
    stages = [Stage(model, i, n) for i in mine]
    del model
    built = [
        pipelining.PipelineStage(s, i, n, torch.device("cpu"))
        for i, s in zip(mine, stages, strict=True)
    ]
    schedule_cls = getattr(pipelining, name)
    schedule = schedule_cls(built if per_rank > 1 else built[0], micro_batches, loss_fn=_loss)
    opt = _torch_adamw([p for s in stages for p in s.parameters()])
    first, last = any(s.first for s in stages), any(s.last for s in stages)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if last else {}
        schedule.step(*([x] if first else []), return_outputs=False, **kwargs)
        if cfg.tie_embeddings:
            _tie_gradients(stages, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if last else torch.zeros(())

    return step


def setup_shardax_pipeline(mode: str, cfg: GPTConfig, seed: int, micro_batches: int) -> Step:
    """``shardax.pipeline``: the model split as it is (``pipeline.split``:
    evenly as torch's modes, or ``-timed`` by each block's measured time,
    each rank's stages together; the tied head kept tied: the first and
    the last stage sum its gradient), this rank's stages initialised alone
    from a meta model (``init_params(only=...)``),
    ``pipeline.value_and_grad`` and ``optim.adamw``'s fused step; the loss
    is on every rank."""
    import shardax as sx
    from shardax import pipeline

    world = dist.get_world_size()
    mesh = sx.Mesh({"dp": 1, "pp": world})
    name, balance = SHARDAX_SCHEDULES[mode]
    schedule = pipeline.schedule(name, world, micro_batches)
    with torch.device("meta"):
        model = GPT(cfg)
    counts: list = [None]
    if balance == "time" and dist.get_rank() == 0:  # measured once, on one rank: all agree
        sample = torch.zeros(1, cfg.seq_len, dtype=torch.long)
        counts = [
            pipeline.split(_dense_model(cfg, seed), schedule, balance="time", sample=sample).counts
        ]
    dist.broadcast_object_list(counts)
    stages = pipeline.split(model, schedule, balance=counts[0] or "layers")
    mine = stages.local(sx.params_of(model), schedule, mesh.axis_index("pp"))
    torch.manual_seed(seed)
    params = sx.init_params(model, mesh.submesh("dp"), sx.rules.zero(0), only=mine)
    grad_fn = pipeline.value_and_grad(model, _loss, schedule, stages, mesh=mesh)
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    fused = sx.optim.fused_step(opt)
    opt_state = opt.init(params)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal params, opt_state
        loss, grads = grad_fn(params, x, y)
        params, opt_state = fused.step(params, grads, opt_state)
        return loss.detach() / world  # the global loss is on every rank: a share each

    return step


def setup(mode: str, cfg: GPTConfig, seed: int, micro_batches: int) -> Step:
    """Build ``mode`` on this rank; its step returns this rank's share of the
    global loss (the shares sum to it)."""
    if mode == "ddp":
        ddp_step, world = setup_ddp(cfg, seed), dist.get_world_size()
        return lambda x, y: ddp_step(x, y) / world  # each rank's mean over half the batch
    if mode in TORCH_SCHEDULES:
        return setup_torch_pipeline(mode, cfg, seed, micro_batches)
    if mode in SHARDAX_SCHEDULES:
        return setup_shardax_pipeline(mode, cfg, seed, micro_batches)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(ALL_MODES)}")


# ---------------------------------------------------------------- one run, on every rank


def worker(args: argparse.Namespace) -> NoReturn:
    """One rank of one run: build, warm up, time; rank 0 writes the result."""
    # A rank stuck outside a collective (which gloo would time out) prints every
    # thread's stack and exits: the launcher then stops the others.
    faulthandler.dump_traceback_later(60 + 30 * (args.warmup + args.steps), exit=True)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = peak_rss_mib()
    cfg = config_from(args)
    # DDP: this rank's half of the global batch; a pipeline: all of it (its first stage
    # splits it into the micro-batches). The same windows either way.
    batch_at = partial(
        batch,
        load_tokens(Path(args.data), cfg.vocab_size),
        seed=args.seed,
        seq_len=cfg.seq_len,
        micro_batch=args.micro_batches // world,
        shared=args.worker != "ddp",
    )
    started = time.perf_counter()
    step = setup(args.worker, cfg, args.seed, args.micro_batches)
    build_s = time.perf_counter() - started
    losses, seconds = timed_steps(step, batch_at, args.warmup, args.steps)
    loss = torch.stack(losses).double()
    dist.all_reduce(loss)  # the ranks' shares: the global loss
    rss = rss_per_rank(rss_start)
    if rank == 0:
        result = {
            "tokens_per_s": args.micro_batches * cfg.seq_len * args.steps / float(seconds.sum()),
            "step_s": statistics.median(seconds.tolist()),
            "step_s_all": seconds.tolist(),
            "build_s": build_s,
            **rss,
            "losses": loss.tolist(),
            "first_loss": loss[0].item(),
            "last_loss": loss[-1].item(),
        }
        Path(args.result).write_text(json.dumps(result))
    # Leave at once, tearing nothing down: in torch 2.13, freeing DDP's reducer (and with it
    # the gloo process group) after all_gather_object can deadlock — the group's destructor
    # joins its work thread, which waits for the GIL to free the gather's tensors — and gloo
    # sometimes aborts in interpreter finalization (train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- the driver


def config_from(args: argparse.Namespace) -> GPTConfig:
    """The preset with ``--layers`` blocks."""
    return PRESETS[args.preset].replace(n_layers=args.layers)


def run_once(mode: str, repeat: int, args: argparse.Namespace) -> dict:
    """Launch one run of ``mode`` on fresh ranks; its JSON row."""
    row: dict = {"mode": mode, "repeat": repeat}
    with tempfile.TemporaryDirectory(prefix="shardax-pipeline-bench-") as tmp:
        result = Path(tmp) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode]
        argv += ["--result", str(result), "--data", args.data, "--preset", args.preset]
        argv += ["--layers", str(args.layers), "--micro-batches", str(args.micro_batches)]
        argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        argv += ["--seed", str(args.seed), "--threads", str(args.threads)]
        # train.py's environment: its threads, and the allocator setting sx.init() makes
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))
        launch_run(argv, env, args, result, row)
    return row


def summarize_vs_ddp(rows: list[dict], modes: Sequence[str]) -> dict:
    """``train.py``'s summary (medians over repeats, the first-loss spread)
    with each mode's peak RSS per rank, its ratios against ``ddp`` and the
    first-loss check against it."""
    summary = summarize(rows, modes, {})
    del summary["skipped"]
    stats = summary["summary"]
    for mode, s in stats.items():
        peaks = [r["peak_rss_mib_per_rank"] for r in rows if r["mode"] == mode and "error" not in r]
        s["peak_rss_mib_per_rank"] = [statistics.median(p) for p in zip(*peaks, strict=True)]
    if "ddp" not in stats:
        summary["first_loss_check"] = "no ddp run to compare with"
        return summary
    base = stats["ddp"]
    for s in stats.values():
        s["tokens_per_s_vs_ddp"] = s["tokens_per_s"] / base["tokens_per_s"]
        s["peak_rss_vs_ddp"] = s["peak_rss_mib"] / base["peak_rss_mib"]
        s["first_loss_vs_ddp"] = s["first_loss"] - base["first_loss"]
    wrong = {m: s["first_loss_vs_ddp"] for m, s in stats.items()}
    wrong = {m: d for m, d in wrong.items() if abs(d) > LOSS_TOLERANCE}
    summary["first_loss_check"] = "failed" if wrong else "ok"
    if wrong:
        summary["first_loss_mismatch"] = wrong
    return summary


def print_table(summary: dict, file=sys.stderr) -> None:
    """The summary, readable."""
    head = f"{'mode':<24}{'tokens/s':>10}{'step ms':>9}{'peak MiB per rank':>19}"
    print(head + f"{'first loss':>12}{'last loss':>11}{'tok/s/ddp':>11}{'rss/ddp':>9}", file=file)
    for mode, s in summary["summary"].items():
        peaks = "/".join(f"{p:.0f}" for p in s["peak_rss_mib_per_rank"])
        line = f"{mode:<24}{s['tokens_per_s']:>10.0f}{s['step_s'] * 1e3:>9.0f}{peaks:>19}"
        line += f"{s['first_loss']:>12.5f}{s['last_loss']:>11.5f}"
        if "tokens_per_s_vs_ddp" in s:
            line += f"{s['tokens_per_s_vs_ddp']:>11.2f}{s['peak_rss_vs_ddp']:>9.2f}"
        print(line, file=file)
    print(f"first losses against ddp's: {summary['first_loss_check']}", file=file)
    for mode, diff in summary.get("first_loss_mismatch", {}).items():
        print(f"WARNING: {mode}'s first loss is {diff:+.2e} off ddp's", file=file)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--modes", help=f"comma list (default: all): {','.join(ALL_MODES)}")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument(
        "--micro-batches",
        dest="micro_batches",
        type=int,
        default=8,
        help="per step, of one sequence each: the global batch",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    parser.add_argument("--out", help="also write every row and the summary here (JSON)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=str(DATA), help="a text file, read as bytes")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model, 4 micro-batches, 1 + 2 steps, 1 repeat"
    )
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:  # 8 tiny layers: 2 per stage where a rank holds 2 stages, else 4
        args.preset, args.micro_batches, args.warmup, args.steps, args.repeats = "tiny", 4, 1, 2, 1
    if args.threads is None:
        args.threads = threads_per_rank(args.nproc)
    for name in ["nproc", "layers", "micro_batches", "steps", "repeats", "threads"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.micro_batches % args.nproc:
        parser.error(
            f"--micro-batches {args.micro_batches} must be a multiple of --nproc {args.nproc} "
            "(DDP gives each rank the same share of them)"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    modes = args.modes.split(",") if args.modes else ALL_MODES
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        print(f"unknown mode(s) {unknown}; modes: {','.join(ALL_MODES)}", file=sys.stderr)
        return 2
    if not Path(args.data).is_file():
        print(f"no data file {args.data}; pass --data PATH", file=sys.stderr)
        return 2
    for mode in modes:
        stages = TORCH_SCHEDULES[mode][1] * args.nproc if mode in TORCH_SCHEDULES else 1
        if args.layers % stages:
            print(
                f"{mode} splits the model into {stages} stages on {args.nproc} ranks; "
                f"--layers {args.layers} is not a multiple of {stages}",
                file=sys.stderr,
            )
            return 2
    cfg = config_from(args)
    header = {
        "benchmark": "pipeline",
        "preset": args.preset,
        "model": {**attrs.asdict(cfg), "params": param_count(cfg)},
        "nproc": args.nproc,
        "micro_batches": args.micro_batches,
        "tokens_per_step": args.micro_batches * cfg.seq_len,
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "modes": modes,
    }
    print(json.dumps(header), flush=True)
    rows = interleaved(modes, args.repeats, partial(run_once, args=args))
    summary = summarize_vs_ddp(rows, modes)
    print(json.dumps(summary), flush=True)
    print_table(summary)
    if args.out:
        Path(args.out).write_text(json.dumps({**header, "runs": rows, **summary}, indent=2))
    return 1 if summary.get("failed") or "first_loss_mismatch" in summary or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
