"""Mixture of experts: shardax's experts against DeepSpeed's MoE, side by side.

One invocation trains the same GPT (``examples/gpt.py`` with every block's
MLP a mixture of ``--experts`` SwiGLU experts, top-``--top-k``, the
load-balancing loss at weight 0.01 in the gradient) on the same
tinyshakespeare bytes, from the same seed, with the same AdamW (lr 3e-4,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1, fp32), the experts split
over ``--ep`` ranks (default: all of them), once per mode:

- ``deepspeed1``, ``deepspeed2``: ``deepspeed.moe.layer.MoE`` in place of
  each MLP — the same experts (a SwiGLU module, copied from the same
  initial weights), the same ``k`` and ``--capacity-factor`` (DeepSpeed's
  top-2 gate without its random token selection and second-expert
  sampling, ``min_capacity`` 0, so that both serve the same pairs) — under
  ZeRO-1 / ZeRO-2 on DeepSpeed's CPU accelerator, with the MoE parameter
  groups it needs; ``deepspeed1-dropless``: ``drop_tokens=False``;
- ``deepspeed3``: DeepSpeed's MoE under ZeRO-3 — recorded as refused, with
  DeepSpeed's own message, where it refuses;
- ``shardax1``, ``shardax2``, ``shardax3``: ``rules.experts("ep")`` and
  ZeRO 1/2/3 over ``("dp", "ep")`` at the same capacity factor (counted
  over the whole batch: one process's drops on any mesh);
  ``shardax1-dropless``, ``shardax3-dropless``: without a capacity.

Every (mode, repeat) runs in fresh rank processes started by ``shardax
launch``, modes interleaved across repeats (the host is noisy); each takes
``--warmup`` untimed steps, then times ``--steps`` steps between barriers.
One JSON line per run: global tokens/s, median step time, peak RSS per rank,
every step's loss and the share of (token, choice) pairs dropped past
capacity. A last JSON line summarises each mode (medians over repeats) with
its ratios against ``deepspeed1`` and ``deepspeed2`` (tokens/s above 1 is
faster, peak RSS below 1 is less memory). Every mode starts from the same
weights and batch: dropless modes must agree on the first loss to 1e-4
(with a capacity the anchors differ by design: DeepSpeed counts capacity per
rank and renormalises the kept weights).

    python benchmarks/moe.py --nproc 2 --repeats 3 --json moe2.json
    python benchmarks/moe.py --nproc 4 --modes deepspeed1,shardax1,shardax1-dropless
    python benchmarks/moe.py --smoke        # tiny model, 2 steps, shardax modes only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from _data import (
    MICRO_BATCH,
    batch,
    interleaved,
    launch_run,
    load_tokens,
    peak_rss_mib,
    rss_per_rank,
    threads_per_rank,
    timed_steps,
)
from gpt import GPT, PRESETS, GPTConfig, _AuxLoss, param_count
from train import (
    BETAS,
    DATA,
    EPS,
    LR,
    TIMEOUT_S,
    WEIGHT_DECAY,
    _deepspeed_missing,
    _loss,
    _shardax_step,
    add_ratios,
    medians,
)

import shardax as sx

ALL_MODES = [
    "deepspeed1",
    "deepspeed2",
    "deepspeed1-dropless",
    "deepspeed3",
    "shardax1",
    "shardax2",
    "shardax3",
    "shardax1-dropless",
    "shardax3-dropless",
]
ANCHORS = ["deepspeed1", "deepspeed2"]
LOSS_TOLERANCE = 1e-4
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def model_config(args: argparse.Namespace, dropless: bool) -> GPTConfig:
    """The preset with its MLPs made mixtures (the capacity unless ``dropless``)."""
    return PRESETS[args.preset].replace(
        experts=args.experts,
        top_k=args.top_k,
        capacity_factor=None if dropless else args.capacity_factor,
        n_layers=args.n_layers,
    )


# ---------------------------------------------------------------- DeepSpeed's MoE


class SwiGLU(nn.Module):
    """One expert as DeepSpeed's ``MoE`` takes it: the math of one slice of
    ``examples/gpt.py``'s stacked ``Experts``."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DeepSpeedMoE(nn.Module):
    """``deepspeed.moe.layer.MoE`` where the example GPT has its ``MoE``, from its weights."""

    def __init__(self, ours: nn.Module, cfg: GPTConfig, ep: int, kept: list[int]) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        d = cfg.d_model
        f = ours.experts.down_proj.shape[-1]
        self.aux_weight, self.kept = cfg.router_aux_loss, kept
        self.moe = MoE(
            d, SwiGLU(d, f), num_experts=cfg.experts, ep_size=ep, k=cfg.top_k,
            capacity_factor=cfg.capacity_factor or 1.0, min_capacity=0,
            drop_tokens=cfg.capacity_factor is not None, use_rts=False,
            top2_2nd_expert_sampling=False,
        )  # fmt: skip
        local = cfg.experts // ep
        first = dist.get_rank() % ep * local  # DeepSpeed's expert groups: consecutive ranks
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
            for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                expert.gate_up.weight.copy_(ours.experts.gate_up_proj[first + i])
                expert.down.weight.copy_(ours.experts.down_proj[first + i])
        self.moe.deepspeed_moe.gate.register_forward_hook(self._count)

    def _count(self, module: nn.Module, inputs: object, output: tuple) -> None:
        experts = output[3]  # [k, tokens]: each pair's expert, negative where evicted
        self.kept[0] += int((experts >= 0).sum())
        self.kept[1] += experts.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux, _ = self.moe(x)
        return _AuxLoss.apply(y, self.aux_weight * aux) if torch.is_grad_enabled() else y


def setup_deepspeed(stage: int, cfg: GPTConfig, args: argparse.Namespace, kept: list[int]) -> Step:
    """DeepSpeed ZeRO ``stage`` with its MoE layers, ``torch.optim.AdamW`` over its MoE groups."""
    import logging

    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    for block in model.blocks:
        block.mlp = DeepSpeedMoE(block.mlp, cfg, args.ep, kept)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


# ---------------------------------------------------------------- one run, on every rank


def worker(args: argparse.Namespace) -> int:
    """One rank of one run: build, warm up, time; rank 0 writes the result."""
    torch.set_num_threads(args.threads)
    mode = args.worker
    dropless = mode.endswith("-dropless")
    stage = int(mode.removesuffix("-dropless")[-1])
    cfg = model_config(args, dropless)
    if mode.startswith("shardax"):
        sx.init(timeout=TIMEOUT_S)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = peak_rss_mib()
    tokens = load_tokens(Path(args.data), cfg.vocab_size)

    def batch_at(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(tokens, i, seed=args.seed, seq_len=cfg.seq_len, micro_batch=args.micro)

    kept = [0, 0]  # DeepSpeed's pairs kept, routed (its gate's dispatch mask)
    started = time.perf_counter()
    try:
        if mode.startswith("shardax"):
            mesh = sx.Mesh({"dp": world // args.ep, "ep": args.ep})
            data = ("dp", "ep")
            rules = sx.rules.experts("ep", batch=data) + sx.rules.zero(stage, data)
            step = _shardax_step(cfg, args.seed, mesh, rules, _loss)
        else:
            step = setup_deepspeed(stage, cfg, args, kept)
    except Exception as err:  # DeepSpeed refuses some stages with MoE: that is the row
        if rank == 0:
            Path(args.result).write_text(json.dumps({"refused": f"{type(err).__name__}: {err}"}))
        dist.destroy_process_group()
        return 0
    build_s = time.perf_counter() - started
    with sx.moe.expert_load() as seen:
        losses, seconds = timed_steps(step, batch_at, args.warmup, args.steps)
    loss = torch.stack(losses).double()
    dist.all_reduce(loss)  # the global loss: the mean of the ranks' (shardax's is already global)
    loss /= world
    if mode.startswith("shardax"):
        dropped = seen.total().dropped_fraction
    else:
        counts = torch.tensor(kept, dtype=torch.float64)
        dist.all_reduce(counts)
        dropped = 1.0 - float(counts[0] / counts[1]) if counts[1] else 0.0
    memory = rss_per_rank(rss_start)
    if rank == 0:
        result = {
            "tokens_per_s": args.micro * world * cfg.seq_len * args.steps / float(seconds.sum()),
            "step_s": statistics.median(seconds.tolist()),
            "step_s_all": seconds.tolist(),
            "build_s": build_s,
            **memory,
            "losses": loss.tolist(),
            "dropped_fraction": dropped,
        }
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the driver


def run_once(mode: str, repeat: int, args: argparse.Namespace) -> dict:
    """Launch one run of ``mode`` on fresh ranks; its JSON row."""
    row: dict = {"mode": mode, "repeat": repeat}
    with tempfile.TemporaryDirectory(prefix="shardax-moe-bench-") as tmp:
        result = Path(tmp) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode]
        argv += ["--threads", str(args.threads), "--result", str(result), "--data", args.data]
        argv += ["--preset", args.preset, "--micro-batch", str(args.micro), "--ep", str(args.ep)]
        argv += ["--nproc", str(args.nproc)]
        argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
        argv += ["--experts", str(args.experts), "--top-k", str(args.top_k)]
        argv += ["--capacity-factor", str(args.capacity_factor)]
        argv += ["--n-layers", str(args.n_layers)] if args.n_layers else []
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": "cpu"}
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))  # what sx.init() sets, for all
        launch_run(argv, env, args, result, row)
    return row


def summarize(rows: list[dict], modes: Sequence[str], skipped: dict[str, str]) -> dict:
    """Per mode, medians over repeats, ratios against the anchors, the loss check."""
    per_mode: dict[str, dict] = {}
    refused: dict[str, str] = {}
    for mode in modes:
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        if ok and "refused" in ok[0]:
            refused[mode] = ok[0]["refused"]
            continue
        if not ok:
            continue
        per_mode[mode] = medians(ok)
        per_mode[mode]["dropped_fraction"] = statistics.median(r["dropped_fraction"] for r in ok)
    for stats in per_mode.values():
        add_ratios(stats, per_mode, ANCHORS)
    summary: dict = {"summary": per_mode, "refused": refused, "skipped": skipped}
    failed = sorted({r["mode"] for r in rows if "error" in r})
    if failed:
        summary["failed"] = failed
    firsts = {m: s["first_loss"] for m, s in per_mode.items() if m.endswith("-dropless")}
    if len(firsts) > 1:
        spread = max(firsts.values()) - min(firsts.values())
        summary["dropless_first_loss_spread"] = spread
        if spread > LOSS_TOLERANCE:
            summary["warning"] = (
                f"dropless first-step losses disagree by {spread:.2e} (> {LOSS_TOLERANCE:g}) "
                f"although every mode starts from the same weights and batch: {firsts}"
            )
    return summary


def print_table(summary: dict, file=sys.stderr) -> None:
    """The summary, readable."""
    anchors = [a for a in ANCHORS if a in summary["summary"]]
    short = {"deepspeed1": "ds1", "deepspeed2": "ds2"}
    head = f"{'mode':<22}{'tokens/s':>10}{'step ms':>9}{'peak MiB':>10}{'dropped':>9}"
    head += f"{'first loss':>12}" + "".join(
        f"{'tok/s/' + short[a]:>12}{'rss/' + short[a]:>10}" for a in anchors
    )
    print(head, file=file)
    for mode, s in summary["summary"].items():
        line = f"{mode:<22}{s['tokens_per_s']:>10.0f}{s['step_s'] * 1e3:>9.1f}"
        line += f"{s['peak_rss_mib']:>10.0f}{s['dropped_fraction']:>9.3f}{s['first_loss']:>12.5f}"
        for a in anchors:
            line += f"{s[f'tokens_per_s_vs_{a}']:>12.2f}{s[f'peak_rss_vs_{a}']:>10.2f}"
        print(line, file=file)
    for mode, reason in summary["refused"].items():
        print(f"refused {mode}: {reason}", file=file)
    for mode, reason in summary["skipped"].items():
        print(f"skipped {mode}: {reason}", file=file)
    if "warning" in summary:
        print(f"WARNING: {summary['warning']}", file=file)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--modes", help=f"comma list (default: all available): {','.join(ALL_MODES)}"
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--ep", type=int, help="expert-parallel ranks (default: --nproc)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer")
    parser.add_argument("--top-k", dest="top_k", type=int, default=2, choices=(1, 2))
    parser.add_argument("--capacity-factor", dest="capacity_factor", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    parser.add_argument("--json", help="also write every row and the summary here")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--n-layers", dest="n_layers", type=int)
    parser.add_argument("--micro-batch", dest="micro", type=int, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=str(DATA), help="a text file, read as bytes")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, 1 repeat")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.steps, args.warmup, args.repeats, args.nproc = "tiny", 2, 1, 1, 2
        args.experts = 4
        if args.modes is None:
            args.modes = "shardax1,shardax3-dropless"
    args.ep = args.ep or args.nproc
    args.micro = args.micro or MICRO_BATCH[args.preset]
    if args.threads is None:
        args.threads = threads_per_rank(args.nproc)
    if args.nproc % args.ep or args.experts % args.ep:
        parser.error(
            f"--ep {args.ep} must divide --nproc {args.nproc} and --experts {args.experts}"
        )
    for name in ["nproc", "steps", "repeats", "micro", "threads", "experts"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('micro', 'micro-batch')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        code = worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # torch 2.13's gloo may abort in finalization (benchmarks/train.py)
    requested = args.modes.split(",") if args.modes else ALL_MODES
    unknown = [m for m in requested if m not in ALL_MODES]
    if unknown:
        print(f"unknown mode(s) {unknown}; modes: {','.join(ALL_MODES)}", file=sys.stderr)
        return 2
    reason = _deepspeed_missing() if any(m.startswith("deepspeed") for m in requested) else None
    skipped = {m: reason for m in requested if reason and m.startswith("deepspeed")}
    modes = [m for m in requested if m not in skipped]
    cfg = model_config(args, dropless=False)
    header = {
        "benchmark": "moe",
        "preset": args.preset,
        "model": {**{k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "d_model", "n_layers",
                                                   "n_heads", "experts", "top_k")},
                  "capacity_factor": args.capacity_factor, "params": param_count(cfg),
                  "active_params": param_count(cfg, active=True)},
        "nproc": args.nproc,
        "ep": args.ep,
        "micro_batch": args.micro,
        "global_batch": args.micro * args.nproc,
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "modes": modes,
        "skipped": skipped,
    }  # fmt: skip
    print(json.dumps(header), flush=True)
    # a refusal is not noise: once is enough
    rows = interleaved(modes, args.repeats, partial(run_once, args=args), once="refused")
    summary = summarize(rows, modes, skipped)
    print(json.dumps(summary), flush=True)
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({**header, "runs": rows, **summary}, indent=2))
    return 1 if summary.get("failed") or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
