"""Regenerate the DeepSpeed checkpoints the import tests read without DeepSpeed.

    python tests/data/deepspeed_ckpt/make.py          # 2 gloo ranks on CPU, about a minute

Real DeepSpeed (``pip install deepspeed``; 0.19.8 wrote the committed ones)
trains :class:`TinyLM` on 2 ranks for :data:`SAVED_AT` optimizer steps under
each of :data:`CASES` (ZeRO-1, 2 and 3; fp32 and bf16; the bf16 optimizer
DeepSpeed picks for ZeRO-1 with fp32 gradient accumulation; fp16 with its
dynamic loss scaler), saves a
checkpoint (``<case>/latest`` and ``<case>/global_step3/*.pt``), then goes on
for :data:`CONTINUED` more steps. ``losses.json`` records each case's
DeepSpeed config and those continued losses (per micro-step, the mean over
the ranks): the curve a shardax run resumed from the imported checkpoint
must reproduce. The tests also call :func:`train` on their own gloo ranks
(``tests/_dist.py``) where DeepSpeed is installed. Each case runs in fresh
processes: a DeepSpeed run after another one in the same processes
computed other bf16 losses (0.19.8 on CPU; the fresh ones are the plain
bf16 forward's: ZeRO-3 replaces ``F.linear`` process-wide).

The model, its data and DeepSpeed's config live here so the tests build the
same ones; ``deepspeed`` is imported only inside :func:`train`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
WORLD, MICRO, SAVED_AT, CONTINUED = 2, 4, 3, 5
VOCAB, SEQ = 16, 5

CASES: dict[str, dict[str, Any]] = {
    "zero1_fp32": {"stage": 1, "precision": "fp32", "accumulation": 2},
    "zero2_fp32": {"stage": 2, "precision": "fp32"},
    "zero3_fp32": {"stage": 3, "precision": "fp32"},
    "zero1_bf16": {"stage": 1, "precision": "bf16", "fp32_accumulation": True},  # BF16_Optimizer
    "zero2_bf16": {"stage": 2, "precision": "bf16"},
    "zero3_bf16": {"stage": 3, "precision": "bf16"},
    "zero2_fp16": {"stage": 2, "precision": "fp16"},
}
"""Each checkpoint: ZeRO stage, precision, micro-steps per optimizer step
and (ZeRO-1 bf16) DeepSpeed's ``data_types.grad_accum_dtype: fp32``, which
makes it use its ``BF16_Optimizer``."""
UNIVERSAL = ["zero2_fp32", "zero3_bf16"]
"""The cases also converted to universal checkpoints (``ds_to_universal.py``,
into ``universal_<case>/``): ZeRO-1/2's layout and ZeRO-3's differ."""


class Linear(nn.Linear):
    """``x @ W.T + b`` as two ops, the arithmetic DeepSpeed's ZeRO-3 gives
    every ``F.linear`` (its default ``memory_efficient_linear`` swaps in
    ``LinearFunctionForZeroStage3``, for the whole process): so every stage
    computes the same bf16 forward as shardax's run of the same module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.matmul(self.weight.t())
        return out + self.bias if self.bias is not None else out


class TinyLM(nn.Module):
    """A language model small enough for a checkpoint of a few KB that still
    has what DeepSpeed's files must describe: a head tied to the embedding
    (DeepSpeed's ``shared_params``), a persistent buffer, a LayerNorm, and
    sizes that do not divide by 2 (its padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.norm = nn.LayerNorm(6)
        self.up = Linear(6, 9)
        self.down = Linear(9, 6)
        self.head = Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.head(h) / self.temperature


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batch(micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of micro-step ``micro_step``: inputs and targets,
    ``WORLD * MICRO`` rows; rank ``r`` takes rows ``r * MICRO`` onwards."""
    g = torch.Generator().manual_seed(1000 + micro_step)
    rows = torch.randint(0, VOCAB, (WORLD * MICRO, SEQ + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


ADAMW = {"lr": 0.02, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True}
SCHEDULE = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 4,
            "warmup_type": "linear", "total_num_steps": 20}  # fmt: skip


def ds_config(case: str) -> dict[str, Any]:
    """DeepSpeed's config for ``case``: AdamW (``torch.optim``'s, as
    DeepSpeed's fused kernels need a GPU), clipping, and a warmup-then-decay
    schedule that the continued steps cross."""
    c = CASES[case]
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": c.get("accumulation", 1),
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "scheduler": {"type": "WarmupDecayLR", "params": SCHEDULE},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": c["stage"]},
        "bf16": {"enabled": c["precision"] == "bf16"},
        "fp16": {"enabled": c["precision"] == "fp16", "initial_scale_power": 8},
        "steps_per_print": 2**31 - 1,
    }
    if c["stage"] == 3:  # split every parameter, small ones too
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if c.get("fp32_accumulation"):
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def train(case: str, out: str) -> list[float]:
    """On every rank of a gloo group of :data:`WORLD`: DeepSpeed trains
    :class:`TinyLM` under ``case`` for :data:`SAVED_AT` steps, saves into
    ``out`` (``out/latest``, ``out/global_step3``), and trains
    :data:`CONTINUED` more; the continued micro-steps' losses, averaged over
    the ranks."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    deepspeed.utils.logger.setLevel(logging.WARNING)
    rank = dist.get_rank()
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed asks; one node
    torch.manual_seed(0)
    model = TinyLM()
    config = ds_config(case)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    accumulation = config["gradient_accumulation_steps"]
    losses = []
    for step in range(SAVED_AT + CONTINUED):
        if step == SAVED_AT:
            engine.save_checkpoint(out)
        for micro in range(accumulation):
            x, y = batch(step * accumulation + micro)
            x, y = x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]
            loss = loss_of(engine(x), y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if step >= SAVED_AT:
                losses.append(float(mean) / WORLD)
    dist.barrier()
    engine.destroy()
    return losses


def _rank(rank: int, store: str, out: str, case: str, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    losses = train(case, str(Path(out) / case))
    if rank == 0:
        results[case] = losses
    dist.destroy_process_group()


def universal(case_dir: Path, out: Path) -> None:
    """``out``: DeepSpeed's universal checkpoint of ``case_dir``'s, as
    ``ds_to_universal.py`` writes it (``latest_universal`` naming the folder)."""
    import subprocess

    tag = (case_dir / "latest").read_text().strip()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(case_dir / tag), "--output_folder", str(out / f"{tag}_universal"),
         "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
        check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    (out / "latest_universal").write_text(f"{tag}_universal")


def tidy(directory: Path) -> None:
    """Keep DeepSpeed's checkpoint files only: the recovery scripts it copies
    beside them (``zero_to_fp32.py``, 40 KB) are not data."""
    for script in directory.glob("*.py"):
        script.unlink()


def main(argv: list[str]) -> int:
    import torch.multiprocessing as mp

    cases = argv or list(CASES)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        print(f"unknown cases {unknown}; the cases: {sorted(CASES)}", file=sys.stderr)
        return 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    work = Path(tempfile.mkdtemp(prefix="deepspeed-ckpt-"))
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            for case in cases:  # fresh processes each: DeepSpeed's runs in one process interfere
                args = (str(work / f"store-{case}"), str(work), case, results)
                mp.spawn(_rank, args=args, nprocs=WORLD, join=True)
            losses = dict(results)
        record_path = HERE / "losses.json"
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
        import deepspeed

        for case in cases:
            shutil.rmtree(HERE / case, ignore_errors=True)
            shutil.copytree(work / case, HERE / case)
            tidy(HERE / case)
            if case in UNIVERSAL:
                universal(HERE / case, HERE / f"universal_{case}")
            record[case] = {
                "deepspeed": deepspeed.__version__,
                "torch": torch.__version__.split("+")[0],
                "config": ds_config(case),
                "saved_at": SAVED_AT,
                "losses": losses[case],
            }
        record_path.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {', '.join(cases)} and losses.json under {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
