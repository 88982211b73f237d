"""What every training benchmark run shares, with no shardax in it (the
plain scripts import it too): the tokens, each step's batch, the timed
steps, peak memory."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MICRO_BATCH", "batch", "interleaved", "load_tokens", "model_facts", "peak_rss_mib",
    "rss_per_rank", "threads_per_rank", "timed_steps",
]  # fmt: skip

MICRO_BATCH = {"tiny": 8, "small": 8, "bench": 4, "wide": 2}  # sequences per rank and step


def model_facts(cfg: Any, params: int) -> dict[str, int]:
    """A GPT config's shape for a benchmark's JSON header."""
    names = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads")
    return {**{name: getattr(cfg, name) for name in names}, "params": params}


def load_tokens(path: Path, vocab_size: int) -> torch.Tensor:
    """The file's bytes as token ids (modulo ``vocab_size``, which byte-level presets never need)."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    return data.long() % vocab_size


def batch(
    tokens: torch.Tensor,
    step: int,
    *,
    seed: int,
    seq_len: int,
    micro_batch: int,
    shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (all of it when
    ``shared``: tensor-parallel ranks work on the same tokens): random
    windows, the same for every mode and world size given the seed."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(tokens) - seq_len - 1, (micro_batch * world,), generator=g)
    mine = starts if shared else starts[rank * micro_batch : (rank + 1) * micro_batch]
    windows = tokens[mine[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (
        peak / 2**20 if sys.platform == "darwin" else peak / 1024
    )  # bytes on macOS, KiB elsewhere


def launch_run(argv: list[str], env: dict, args: Any, result: Path, row: dict) -> dict:
    """Launch one run (``argv`` on ``args.nproc`` fresh ranks, quiet unless
    ``args.verbose``) and fill ``row``: its wall time, and the result file
    rank 0 wrote, or the error."""
    from shardax.launch import launch

    started = time.perf_counter()
    code = launch(argv, nproc_per_node=args.nproc, env=env, log_ranks=None if args.verbose else ())
    row["wall_s"] = time.perf_counter() - started
    if code != 0 or not result.exists():
        row["error"] = f"ranks exited with code {code}"
    else:
        row.update(json.loads(result.read_text()))
    return row


def timed_steps(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    steps: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``warmup`` untimed steps, then ``steps`` steps each timed between two
    barriers: every step's loss (warm-up first) and the timed steps' seconds
    on the slowest rank (float64), the same on every rank."""
    losses = [step(*batch_at(i)) for i in range(warmup)]
    times = []
    for i in range(warmup, warmup + steps):
        x, y = batch_at(i)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(x, y))
        dist.barrier()
        times.append(time.perf_counter() - t0)
    seconds = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return losses, seconds


def rss_per_rank(start_mib: float) -> dict[str, float | list[float]]:
    """Every rank's peak RSS (and its RSS at ``start_mib``, taken before
    building), gathered: the result row's memory fields, on every rank."""
    rss: list = [None] * dist.get_world_size()
    dist.all_gather_object(rss, (start_mib, peak_rss_mib()))
    return {
        "peak_rss_mib": max(peak for _, peak in rss),
        "peak_rss_mib_per_rank": [peak for _, peak in rss],
        "start_rss_mib_per_rank": [start for start, _ in rss],
    }


def threads_per_rank(nproc: int) -> int:
    """This host's cores shared out among ``nproc`` ranks (at least one each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // nproc)


def interleaved(
    modes: list[str], repeats: int, run_once: Callable[[str, int], dict], once: str = ""
) -> list[dict]:
    """Every mode once per repeat, in order (A B C, A B C, …: the host is
    noisy), each row printed as a JSON line as it comes; a mode whose row
    holds the key ``once`` (a refusal) runs in the first repeat only."""
    rows: list[dict] = []
    for repeat in range(repeats):
        for mode in modes:
            if once and any(r["mode"] == mode and once in r for r in rows):
                continue
            rows.append(run_once(mode, repeat))
            print(json.dumps(rows[-1]), flush=True)
    return rows
