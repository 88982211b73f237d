"""A plain FSDP2 training script, as its users write it: the check on
``benchmarks/train.py``'s ``fsdp2`` mode.

``fully_shard`` on each block, then on the root; ``torch.optim.AdamW`` with
its defaults but the learning rate; the loop timed as a whole (no barrier
per step); no shardax imported and no environment set beyond what
``torchrun`` sets (``OMP_NUM_THREADS``). The model, batches and seed are
``train.py``'s, so its first loss equals every mode's. ``train.py`` runs it
as its ``fsdp2-script`` mode, interleaved with the others, and reads the
same result fields; it also runs on its own:

    torchrun --nproc-per-node 2 benchmarks/fsdp2_script.py --preset bench --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from _data import MICRO_BATCH, batch, load_tokens, peak_rss_mib  # noqa: E402  (beside this file)
from gpt import GPT, PRESETS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--micro-batch", dest="micro", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "tinyshakespeare.txt"))
    parser.add_argument("--result", help="write the result here (JSON) instead of printing it")
    for flag in ["d-model", "n-layers", "n-heads", "vocab", "seq-len"]:
        parser.add_argument(f"--{flag}", type=int)
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset].replace(
        d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        vocab_size=args.vocab, seq_len=args.seq_len,
    )  # fmt: skip
    micro = args.micro or MICRO_BATCH[args.preset]

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = peak_rss_mib()
    tokens = load_tokens(Path(args.data), cfg.vocab_size)

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    build_s = time.perf_counter() - started

    def step(i: int) -> torch.Tensor:
        x, y = batch(tokens, i, seed=args.seed, seq_len=cfg.seq_len, micro_batch=micro)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    losses = [step(i) for i in range(args.warmup)]
    dist.barrier()
    t0 = time.perf_counter()
    losses += [step(i) for i in range(args.warmup, args.warmup + args.steps)]
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    loss = torch.stack(losses).double()
    dist.all_reduce(loss)
    loss /= world
    rss = [None] * world
    dist.all_gather_object(rss, (rss_start, peak_rss_mib()))
    if rank == 0:
        seconds = float(elapsed)
        result = {
            "tokens_per_s": micro * world * cfg.seq_len * args.steps / seconds,
            "step_s": seconds / args.steps,
            "step_s_all": [seconds / args.steps] * args.steps,  # one loop, timed whole
            "build_s": build_s,
            "peak_rss_mib": max(peak for _, peak in rss),
            "peak_rss_mib_per_rank": [peak for _, peak in rss],
            "start_rss_mib_per_rank": [start for start, _ in rss],
            "losses": loss.tolist(),
        }
        if args.result:
            Path(args.result).write_text(json.dumps(result))
        else:
            print(json.dumps({k: v for k, v in result.items() if k != "step_s_all"}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # As train.py's ranks: torch 2.13's gloo sometimes aborts in interpreter
    # finalization after the run is over and its result written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
