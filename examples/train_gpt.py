"""Train a small GPT on Tiny Shakespeare with shardax: an explicit,
functional train step under ZeRO-3.

    shardax launch --nproc-per-node 2 examples/train_gpt.py     # 2 CPU ranks, about 2 minutes
    python examples/train_gpt.py --steps 5                      # one process, no launcher
    shardax launch --nproc-per-node 2 examples/train_gpt.py --cp 2   # each sequence split in 2

The model is the plain PyTorch GPT of ``examples/gpt.py``, built on the
``meta`` device; ``sx.init_params`` creates its parameters straight into
their shards (each rank holds 1/N of every tensor under ZeRO-3), with the
same values ``torch.manual_seed(seed); GPT(cfg)`` would give. Each step,
``sx.value_and_grad`` runs the model through ``sx.apply`` — which gathers a
block's parameters just before it runs and frees them after — and returns
the loss (averaged over ranks) and the gradients, reduce-scattered into
shards; the optimizer updates each rank's shards. The loop is yours.

``--cp N`` adds an axis ``cp`` of size N to the mesh: context parallelism
(``rules.context_parallel``), each rank of ``cp`` given its piece of every
sequence (split zigzag, the run config's ``batch_spec``), attention run as
ring attention, ZeRO sharding over ``cp`` too; the loss is each rank's
cross-entropy of its piece, and the logged loss their mean (the seq_len of
the preset must divide by 2N). Text is then sampled with the same
parameters without the ring.

Rank 0 prints the unigram baseline (the loss of a model that ignores
context), the loss and throughput every ``--log-every`` steps, the
validation loss at the end and a sample of generated text.

Checkpoints are sharded (``sx.ckpt``): every ``--save-every`` steps and at
the end, each rank writes its own shards of the parameters and optimizer
state, with the step and every rank's RNG state, into
``--out/step-NNNNNNNN`` — in the background while training goes on (a copy
of the state held meanwhile), the last one in place once training is done.
``--resume`` continues from the latest one (``--resume PATH`` from that
one) on any number of ranks: each rank reads its new shards into
placeholders that hold no memory. On the saved number of ranks the RNG
states are restored and the run goes on bit for bit as if it had not
stopped; on another, where a rank's random stream cannot be split or
merged, each rank's generators are seeded from the checkpoint and the rank
(``--rng``: the default ``reseed`` does both; ``restore`` refuses another
number of ranks, ``skip`` leaves the generators) — the resume line says
which. Turn one into a plain safetensors file of the weights with

    shardax ckpt consolidate checkpoints/train_gpt/step-00000300 gpt.safetensors --only params

Under ``shardax launch --elastic MIN:MAX --max-restarts N`` a lost rank
does not end the run: ``--elastic`` makes a restart resume from the newest
checkpoint on the ranks that remain, the global batch kept by changing the
gradient accumulation (a global batch that cannot split over every
data-parallel size MIN..MAX allows is refused at the start).
``--memory-ckpt-every K`` adds in-memory checkpoints: every K steps each
rank's shards go into host memory the launcher keeps across restarts, with
a copy at a peer rank (another node's), so a restart loses at most K steps;
the disk checkpoints are the fallback when a rank and its peer are both
lost. ``--kill-at STEP:RANK`` (``--kill-node``) SIGKILLs a rank (its node)
mid-step on the first try, for tests and ``benchmarks/elastic.py``::

    shardax launch --nproc-per-node 4 --elastic 2:4 --max-restarts 2 examples/train_gpt.py \
        --elastic --batch-size 12 --memory-ckpt-every 5 --save-every 50

A run config (``--config run.hjson``, see ``docs/config.md``; ``shardax
config from-deepspeed ds_config.json`` converts a DeepSpeed one) sets the
mesh, ZeRO stage, optimizer, schedule, precision (fp16 with dynamic loss
scaling too), batch sizes with gradient accumulation, checkpointing and
logging; flags given on the command line override it. Without one, the
flags make the config. The same file may set the example's own options by
name — ``steps``, ``batch_size``, ``zero``, ``preset``, ``progress`` … (the
flags without their dashes, ``-`` as ``_``) — over their defaults, e.g. a
file holding only ``{"preset": "tiny", "steps": 50}``; flags given on the
command line win over the file, and an unknown key is an error naming the
valid ones.

On a terminal (stdout and stderr both; under ``shardax launch``, the
launcher's, which it says with ``SHARDAX_TTY=1`` and passes the bar's
redraws through), rank 0 shows a progress bar with the ETA, the loss and
tokens/s, the loss lines printed above it; ``--progress``/``--no-progress``
force it on or off. Elsewhere (a pipe, a file, CI) the output is the plain
loss lines. At the end rank 0 writes the loss record
next to the checkpoints: ``loss.csv`` (step, loss, lr, tokens/s, and the
validation loss on the last row) and, where matplotlib is installed,
``loss.png``; without it, a sparkline of the loss curve is printed instead.
Last, it prints each phase's peak resident memory per rank (init, resume,
step, save, eval, sample; the most of any rank): the run's peak is the
training step's.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import GPT, PRESETS, generate, param_count

import shardax as sx

if TYPE_CHECKING:
    from tqdm import tqdm

OPTIMIZERS = ["adamw", "adam", "lion", "sgd"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=-1"`` or ``"dp=2,tp=1"`` → ``{"dp": -1}`` / ``{"dp": 2, "tp": 1}``.

    >>> parse_mesh("dp=-1"), parse_mesh("dp=2, tp=1")
    ({'dp': -1}, {'dp': 2, 'tp': 1})
    """
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        try:
            axes[name.strip()] = int(size)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--mesh {text!r}: write axis sizes as name=size separated by commas, "
                "e.g. dp=-1 or dp=2,tp=1 (-1: whatever the world size leaves)"
            ) from None
        if not eq or not name.strip():
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: {part.strip()!r} is not name=size")
    return axes


def parse_kill(text: str) -> tuple[int, int]:
    """``--kill-at STEP:RANK`` → ``(step, rank)``.

    >>> parse_kill("5:3")
    (5, 3)
    """
    step, colon, rank = text.partition(":")
    try:
        out = int(step), int(rank)
    except ValueError:
        out = (0, -1)
    if not colon or out[0] < 1 or out[1] < 0:
        raise argparse.ArgumentTypeError(
            f"--kill-at {text!r}: write STEP:RANK, a step >= 1 and a rank >= 0, e.g. 5:3"
        )
    return out


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over ``[B, T]`` targets (computed in fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def evaluate(
    loss_of: Callable, params: dict, batches: list[dict], mesh: sx.Mesh, axes: Sequence[str]
) -> float:
    """Mean loss on ``batches`` (each rank its own: ``loss_of(params,
    batch)``), averaged over ``axes`` (the data axes: the logits are whole
    on the ranks of every other axis)."""
    with torch.no_grad():
        total = sum(loss_of(params, b) for b in batches)
    return float(sx.collectives.pmean(total / len(batches), tuple(axes), mesh=mesh))


def pipelined(
    run: sx.config.RunConfig,
    model: torch.nn.Module,
    mesh: sx.Mesh,
    pipe: sx.pipeline.Schedule,
    stages: sx.pipeline.Stages,
) -> tuple[Callable, Callable]:
    """The train step's ``grad_fn(params, batch, scale)`` and the
    evaluation loss ``val_fn(params, batch)`` under a pipeline: the
    schedule's micro-batches split each rank's batch, the loss on the last
    stage (the same on every rank of the pipeline: what ``val_fn``
    returns), the gradients clipped by the whole model's norm."""
    tp, sp, clip = run.parallel.tp, run.parallel.sp, run.optimizer.clip_global_norm
    loss_fn = cross_entropy  # the logits are whole under tp and sp too

    # the rules give the stand-ins of the outer modules (run by middle stages) their pieces
    rules = {"rules": run.make_rules()} if tp is not None or sp is not None else {}
    step = sx.pipeline.value_and_grad(
        model, loss_fn, pipe, stages, mesh=mesh, bucket_bytes=run.parallel.bucket_bytes, **rules
    )
    value = sx.pipeline.value(model, loss_fn, pipe, stages, mesh=mesh, **rules)

    def grad_fn(params: dict, batch: dict, scale: float) -> tuple[torch.Tensor, dict]:
        loss, grads = step(params, batch["x"], batch["y"])
        if clip:
            grads, _ = sx.pipeline.clip_by_global_norm(grads, clip, stages, pipe, mesh=mesh)
        return loss * scale, grads

    return grad_fn, lambda params, batch: value(params, batch["x"], batch["y"])


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; every option with its default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="an hjson or JSON file: a run config (docs/config.md) and/or this script's options "
        "by name (steps, batch_size, zero, ...) over their defaults; flags given override it",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size")
    parser.add_argument("--zero", type=int, choices=range(4), default=3, help="ZeRO stage")
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        default={"dp": -1},
        help="e.g. dp=-1 or dp=2,tp=2 (an axis named tp does tensor parallelism)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (rules.megatron over a tp axis added to the mesh)",
    )
    parser.add_argument(
        "--sp", action="store_true", help="Megatron sequence parallelism over tp (needs --tp)"
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: a pp axis added to the mesh, the blocks split over it",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks: a cp axis added to the mesh, each rank its piece of every "
        "sequence (split zigzag), attention as ring attention (rules.context_parallel); the "
        "preset's seq_len must divide by 2x this",
    )
    parser.add_argument(
        "--schedule",
        choices=list(sx.pipeline.SCHEDULES),
        default="1f1b",
        help="the pipeline schedule (with --pp; see docs/pipeline.md)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        help="pipeline micro-batches per step (%(default)s: twice --pp); they split each "
        "data-parallel rank's batch",
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        help="a mixture of this many experts in place of each block's MLP (0: dense)",
    )
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (with --experts)")
    parser.add_argument(
        "--capacity-factor",
        type=float,
        help="each expert's slots per batch over an even share (%(default)s: dropless)",
    )
    parser.add_argument(
        "--aux-loss",
        type=float,
        default=0.01,
        help="weight of the load-balancing loss in the gradient (with --experts)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks: an ep axis added to the mesh, each rank holding "
        "experts/ep experts of every layer (rules.experts)",
    )
    parser.add_argument(
        "--remat",
        nargs="?",
        const="save_nothing",
        choices=["save_nothing", "save_matmuls"],
        help="recompute each block's activations in backward instead of keeping them "
        "(rules.remat; a bare --remat: save_nothing)",
    )
    parser.add_argument(
        "--offload-opt",
        metavar="KIND",
        help="where the optimizer state lives: disk:PATH (files in that folder, streamed "
        "through each step) or host (rules.offload)",
    )
    parser.add_argument(
        "--offload-params",
        metavar="KIND",
        help="where each rank's shards of the parameters live: disk:PATH or host",
    )
    parser.add_argument(
        "--offload-grads",
        metavar="KIND",
        help="where the reduced gradients live: disk:PATH or host",
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--warmup", type=int, help="linear warmup steps (%(default)s: 10%% of --steps, at most 30)"
    )
    parser.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    parser.add_argument("--clip", type=float, default=1.0, help="global grad norm (0: off)")
    parser.add_argument("--precision", choices=sorted(DTYPES), default="fp32", help="param dtype")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="global, over the dp axis")
    parser.add_argument("--seed", type=int, default=0, help="init and data order")
    parser.add_argument("--log-every", type=int, default=25, help="steps between loss lines")
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("checkpoints/train_gpt"),
        help="checkpoint directory: one step-NNNNNNNN folder per save",
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="save every N steps (0: only at the end)"
    )
    parser.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        type=Path,
        metavar="PATH",
        help="continue from the latest checkpoint in --out, or from PATH (a step-NNNNNNNN "
        "folder), on any number of ranks",
    )
    parser.add_argument(
        "--rng",
        choices=sx.ckpt.RNG_POLICIES,
        default="reseed",
        help="on --resume, each rank's RNG state: reseed restores it as saved where the number "
        "of ranks is the checkpoint's (the run continues bit for bit) and otherwise seeds it "
        "from the checkpoint and the rank (a rank's random stream cannot be split or merged); "
        "restore insists on the saved states (another number of ranks is an error); skip "
        "leaves it. The resume line says which happened",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="for `shardax launch --elastic MIN:MAX --max-restarts N`: on a restart, resume from "
        "the newest checkpoint (in host memory, with --memory-ckpt-every, or in --out) on the "
        "ranks that remain, keeping the global batch by changing the gradient accumulation (the "
        "micro batch is the largest world's, MAX, unless the config sets one); a global batch "
        "that does not split over every data-parallel size the job may take is refused at start",
    )
    parser.add_argument(
        "--memory-ckpt-every",
        type=int,
        default=0,
        metavar="K",
        help="every K steps, each rank copies its shards (params, optimizer state, step, RNG) into "
        "host memory and to a peer rank (another node's, where there are nodes), no disk write: a "
        "restart after a lost rank loses at most K steps (needs shardax launch --max-restarts or "
        "--elastic, which keeps that memory across restarts; 0: off)",
    )
    parser.add_argument(
        "--kill-at",
        type=parse_kill,
        metavar="STEP:RANK",
        help="(tests, benchmarks) on the first try only, rank RANK kills itself with SIGKILL in "
        "the middle of step STEP, after its first micro-step's gradients: a rank lost mid-step",
    )
    parser.add_argument(
        "--kill-node",
        action="store_true",
        help="with --kill-at: the rank first SIGKILLs its node's launcher (its parent), so the "
        "whole node is lost",
    )
    parser.add_argument(
        "--metrics", type=Path, help="append each step's loss and lr as JSON lines (rank 0)"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="a progress bar with the ETA and tokens/s on rank 0 (%(default)s: when stdout and "
        "stderr are terminals; otherwise the plain loss lines)",
    )
    parser.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate")
    parser.add_argument("--prompt", default="ROMEO:", help="the sample's prompt")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (or SHARDAX_DEBUG=1)"
    )
    return parser


# flag → (section, key) of the run config it sets
CONFIG_FLAGS = {
    "mesh": ("", "mesh"),
    "steps": ("", "steps"),
    "seed": ("", "seed"),
    "zero": ("parallel", "zero"),
    "optimizer": ("optimizer", "type"),
    "lr": ("optimizer", "lr"),
    "weight_decay": ("optimizer", "weight_decay"),
    "clip": ("optimizer", "clip_global_norm"),
    "warmup": ("schedule", "warmup_steps"),
    "precision": ("precision", "params"),
    "batch_size": ("batch", "global"),
    "log_every": ("monitor", "log_every"),
    "out": ("checkpoint", "dir"),
    "save_every": ("checkpoint", "every"),
    "keep": ("checkpoint", "keep"),
    "schedule": ("parallel", "pp_schedule"),
    "microbatches": ("parallel", "pp_micro_batches"),
    "remat": ("memory", "remat"),
    "offload_opt": ("memory", "offload_opt"),
    "offload_params": ("memory", "offload_params"),
    "offload_grads": ("memory", "offload_grads"),
}


def run_config(
    args: argparse.Namespace, given: set[str], base: sx.config.RunConfig | None = None
) -> sx.config.RunConfig:
    """The run: the flags' own config, or ``base`` (the ``--config`` file's
    run config) with the flags given written over it."""
    if base is None:
        data: dict = {
            "optimizer": {"betas": [0.9, 0.95], "momentum": 0.9 if args.optimizer == "sgd" else 0},
            "schedule": {"type": "warmup_cosine", "end_lr": args.lr / 10},
            "batch": {"accumulation": 1},
        }
        flags = CONFIG_FLAGS
    else:
        data = base.to_dict()
        flags = {k: v for k, v in CONFIG_FLAGS.items() if k in given}
        if "batch_size" in given:  # a new global batch: the micro batch follows from it
            data["batch"]["micro"] = None
        if "lr" in given and data["schedule"]["type"] == "warmup_cosine":
            data["schedule"]["end_lr"] = args.lr / 10
    for flag, (section, key) in flags.items():
        value = getattr(args, flag)
        value = (
            str(value) if isinstance(value, Path) else (value or None) if flag == "clip" else value
        )
        (data.setdefault(section, {}) if section else data)[key] = value
    mesh, parallel = dict(data.get("mesh") or {"dp": -1}), data.setdefault("parallel", {})
    # --tp/--pp/--ep/--cp add the axis; an axis named so: its parallelism
    for axis in ("tp", "pp", "ep", "cp"):
        size = getattr(args, axis)
        if size > 1:
            if mesh.get(axis, size) != size:
                raise sx.config.ConfigError(
                    f"--{axis} {size} but the mesh says {axis}={mesh[axis]}"
                )
            mesh[axis] = size
        if mesh.get(axis, 1) != 1 and not parallel.get(axis):
            parallel[axis] = axis
    if args.sp:
        parallel["sequence_parallel"] = True
    if args.experts and not parallel.get("ep"):
        # experts always by rules.experts, over an ep axis of size 1 if need be: the
        # capacity is the whole batch's on every mesh (one process's drops)
        mesh.setdefault("ep", 1)
        parallel["ep"] = "ep"
    data["mesh"] = mesh
    return sx.config.RunConfig.from_dict(data, str(args.config or "the command line"))


def check_context(preset: str, cp: str, size: int) -> None:
    """A ``ConfigError`` unless ``preset``'s sequence splits zigzag over
    ``size`` context-parallel ranks (``2 * size`` equal chunks, two a rank).

    >>> check_context("tiny", "cp", 4)
    >>> check_context("tiny", "cp", 3)
    Traceback (most recent call last):
    ...
    shardax.errors.ConfigError: context parallelism over cp=3 splits each sequence zigzag into 6 equal chunks (two a rank), but preset 'tiny' has seq_len 64, not a multiple of 6: choose a --cp N with 64 a multiple of 2N (1, 2, 4, 8, 16, 32), or another --preset
    """
    seq_len = PRESETS[preset].seq_len
    if seq_len % (2 * size):
        fits = ", ".join(str(n) for n in range(1, seq_len // 2 + 1) if seq_len % (2 * n) == 0)
        raise sx.config.ConfigError(
            f"context parallelism over {cp}={size} splits each sequence zigzag into {2 * size} "
            f"equal chunks (two a rank), but preset {preset!r} has seq_len {seq_len}, not a "
            f"multiple of {2 * size}: choose a --cp N with {seq_len} a multiple of 2N ({fits}), "
            "or another --preset"
        )


# -- --config: a run config and/or the options by name -----------------------------

RUN_TOP = ("mesh", "steps", "seed")  # a run config's top-level keys that are options too


def run_sections() -> list[str]:
    """A run config's sections (``parallel``, ``optimizer``, ...)."""
    return [k for k, v in sx.config.RunConfig().to_dict().items() if isinstance(v, dict)
            and k not in RUN_TOP]  # fmt: skip


def file_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options a ``--config`` file may set, by name (``batch_size``)."""
    actions = parser._actions  # argparse lists its actions nowhere public
    return {a.dest: a for a in actions if a.option_strings and a.dest not in ("help", "config")}


def read_config(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The object in the hjson (or JSON) file ``path``; any other content
    is a ``parser.error``."""
    import hjson

    try:
        data = hjson.loads(path.read_text(), object_pairs_hook=_unique_keys)
    except OSError as err:
        parser.error(f"--config {path}: cannot read it: {err.strerror or err}")
    except (ValueError, OverflowError) as err:  # bad syntax, a key twice, 1e400
        parser.error(f"--config {path}: not valid hjson or JSON: {err}")
    if not isinstance(data, dict):
        parser.error(
            f'--config {path}: write an object of settings, e.g. {{"steps": 50}}; '
            f"got {type(data).__name__}"
        )
    return data


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is written twice (the later would replace it)")
        out[key] = value
    return out


def split_config(data: dict[str, Any], options: Sequence[str]) -> tuple[dict, dict]:
    """``data``'s options and its run-config sections (an object under
    ``optimizer`` or ``precision`` is the section, a string the option).

    >>> split_config({"steps": 5, "optimizer": "lion", "batch": {"global": 8}}, ["optimizer"])
    ({'steps': 5, 'optimizer': 'lion'}, {'batch': {'global': 8}})
    """
    names = run_sections()
    sections = {
        k: v for k, v in data.items() if k in names and (isinstance(v, dict) or k not in options)
    }
    return {k: v for k, v in data.items() if k not in sections}, sections


def option_words(action: argparse.Action, value: Any) -> list[str]:
    """An option's value from a file as the command line writes it
    (``ValueError`` for a value no flag can take).

    >>> option_words(file_options(build_parser())["mesh"], {"dp": 2, "tp": 1})
    ['--mesh=dp=2,tp=1']
    """
    flag, key = action.option_strings[0], action.dest
    if value is None:  # null: the default
        return []
    if action.nargs == 0 or (action.nargs == "?" and isinstance(value, bool)):  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"{key} is true or false; got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else f"--no-{flag[2:]}"]
        return [flag] if value else []
    if key == "mesh" and isinstance(value, dict):
        value = ",".join(f"{axis}={size}" for axis, size in value.items())
    if isinstance(value, (bool, list, dict)):
        raise ValueError(f"{key} takes one value, as {flag} does; got {value!r}")
    return [f"{flag}={value}"]


def config_words(data: dict[str, Any], parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The options of a ``--config`` file as command-line words, checked as
    the flags are (an unknown key, a bad value: ``parser.error`` naming the
    file)."""
    options = file_options(parser)
    sections = run_sections()
    own, _ = split_config(data, list(options))
    words: list[str] = []
    for key, value in own.items():
        if key not in options:
            close = difflib.get_close_matches(key, [*options, *sections], n=1)
            parser.error(
                f"--config {path}: unknown key {key!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; the keys are this script's options: {', '.join(sorted(options))}; and "
                f"the run-config sections: {', '.join(sections)} (docs/config.md)"
            )
        try:
            words += option_words(options[key], value)
        except ValueError as err:
            parser.error(f"--config {path}: {err}")
    checker = build_parser()  # the file's words alone: an error names the file

    def error(message: str) -> None:
        parser.error(f"--config {path}: {message}")

    checker.error = error  # type: ignore[method-assign, assignment]
    checker.parse_args(words)
    return words


def file_run_config(args: argparse.Namespace, data: dict[str, Any]) -> sx.config.RunConfig | None:
    """The ``--config`` file's run config: None without sections (the file
    only sets options); the whole file, read as ``shardax config check``
    reads it, when it holds nothing else; else its sections with the
    run's mesh, steps and seed."""
    options, sections = split_config(data, list(file_options(build_parser())))
    if not sections:
        return None
    if set(options) <= set(RUN_TOP):
        return sx.config.load_config(args.config)
    top = {k: getattr(args, k) for k in RUN_TOP if k in args.given}
    return sx.config.RunConfig.from_dict({**sections, **top}, str(args.config))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options: defaults, then the ``--config`` file's, then the flags given."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    data: dict[str, Any] = {}
    if args.config is not None:
        data = read_config(args.config, parser)
        argv = [*config_words(data, parser, args.config), *argv]  # the later word wins
        args = parser.parse_args(argv)
    probe = build_parser()
    probe.set_defaults(**dict.fromkeys(vars(args)))
    args.given = {k for k, v in vars(probe.parse_args(argv)).items() if v is not None}
    if args.steps < 1 or args.batch_size < 1 or args.log_every < 1 or args.eval_batches < 0:
        parser.error("--steps, --batch-size and --log-every must be positive")
    if args.save_every < 0 or args.keep < 1 or args.memory_ckpt_every < 0:
        parser.error("--save-every and --memory-ckpt-every must be >= 0 and --keep >= 1")
    if args.kill_node and args.kill_at is None:
        parser.error("--kill-node goes with --kill-at STEP:RANK (which rank, at which step)")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    if args.warmup is None:
        args.warmup = min(30, args.steps // 10)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps={args.steps})")
    try:
        args.run = run_config(args, args.given, file_run_config(args, data) if data else None)
        cp = args.run.parallel.cp
        if cp is not None and args.run.mesh[cp] > 0:  # else: checked once the world size is known
            check_context(args.preset, cp, args.run.mesh[cp])
    except sx.config.ConfigError as err:
        parser.error(str(err))
    return args


# -- the progress bar ------------------------------------------------------------


def shows_progress(flag: bool | None, rank: int) -> bool:
    """Whether this rank shows the bar: ``--progress``/``--no-progress``, or
    (neither given) whether stdout and stderr are both terminals — directly,
    or at the end of ``shardax launch``'s pipes (it sets ``SHARDAX_TTY=1``
    and passes redraws through); rank 0 only."""
    if rank != 0:
        return False
    if flag is not None:
        return flag
    if os.environ.get("SHARDAX_TTY") == "1":
        return True
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


def progress_bar(steps: int, start: int) -> tqdm:
    """A bar over the steps on stderr: done, elapsed < ETA, then the postfix."""
    from tqdm import tqdm  # imported only when a bar is shown

    return tqdm(
        total=steps,
        initial=start,
        desc="train",
        dynamic_ncols=True,
        bar_format="{desc} {percentage:3.0f}%|{bar}| step {n_fmt}/{total_fmt} "
        "[{elapsed}<{remaining}{postfix}]",
    )


def advance(bar: tqdm, loss: float, tokens_per_step: int) -> None:
    """One step on, showing the loss (4 decimals) and tokens/s (3
    significant digits: ``24.8k``) at the bar's smoothed step rate, which
    the ETA uses too."""
    rate = bar.format_dict["rate"]  # steps/s; None until the bar has been drawn twice
    speed = f", {bar.format_sizeof(rate * tokens_per_step)} tokens/s" if rate else ""
    bar.set_postfix_str(f"loss {loss:.4f}{speed}", refresh=False)
    bar.update()


class AboveBar:
    """A text stream whose lines are printed above a bar (``tqdm.write``),
    so the periodic loss lines and the bar do not mix."""

    def __init__(self, bar: tqdm, file: TextIO) -> None:
        self.bar, self.file, self.pending = bar, file, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.bar.write(line, file=self.file)
        return len(text)

    def flush(self) -> None:
        self.file.flush()


# -- the loss record --------------------------------------------------------------

LOSS_FIELDS = ("step", "loss", "lr", "tokens_per_s", "val_loss")
BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """``values`` as a line of block characters, low ``▁`` to high ``█``,
    averaged down to ``width`` characters; a NaN or infinite one (or a
    stretch of them) is a space.

    >>> sparkline([1, 2, 3, 4, 5, 6, 7, 8])
    '▁▂▃▄▅▆▇█'
    >>> sparkline([2.0, 2.0, float("nan"), float("inf"), 1.0])
    '██  ▁'
    """
    n = len(values)
    if n > width:  # the mean of each of ``width`` runs of steps
        cuts = [i * n // width for i in range(width + 1)]
        values = [math.fsum(values[a:b]) / (b - a) for a, b in itertools.pairwise(cuts)]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    low, span = min(finite), max(finite) - min(finite)
    top = len(BLOCKS) - 1
    return "".join(
        BLOCKS[round(top * (v - low) / span) if span else 0] if math.isfinite(v) else " "
        for v in values
    )


def read_loss_csv(path: Path, upto: int) -> list[dict[str, Any]]:
    """The rows of an earlier ``loss.csv`` up to step ``upto`` (a resumed
    run's record starts with them); none if there is no such file."""
    if upto < 1 or not path.is_file():
        return []
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        rows = [{k: (int if k == "step" else float)(v) for k, v in r.items() if v} for r in rows]
    except (TypeError, ValueError):  # not a loss record of this script: start afresh
        return []
    return [r for r in rows if r.get("step", upto + 1) <= upto]


def write_loss_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """``rows`` as CSV: step, loss, lr, tokens_per_s and (last row) val_loss."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, LOSS_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot_loss(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Plot the loss curve (and the validation loss) into the PNG ``path``;
    False, and no file, when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)  # no display needed
    ax = fig.add_subplot()
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="train_gpt.py")
    ax.legend()
    fig.savefig(path, dpi=100)
    return True


def loss_record(directory: Path, rows: list[dict[str, Any]], start: int) -> list[str]:
    """Write ``directory/loss.csv`` (an earlier record's rows up to ``start``
    first) and ``loss.png`` where matplotlib is; the lines to print."""
    path = directory / "loss.csv"
    rows = [*read_loss_csv(path, start), *rows]
    if not rows:
        return []
    write_loss_csv(path, rows)
    png = directory / "loss.png"
    if plot_loss(rows, png):
        return [f"loss record: {path}, plot: {png}"]
    losses = [r["loss"] for r in rows]
    return [
        f"loss {losses[0]:.4f} {sparkline(losses)} {losses[-1]:.4f} "
        f"(steps {rows[0]['step']}-{rows[-1]['step']})",
        f"loss record: {path} (no plot: matplotlib is not installed)",
    ]


# -- resuming ---------------------------------------------------------------------------


def resume_path(resume: Path | bool | None, manager: sx.ckpt.CheckpointManager) -> Path | None:
    """The checkpoint ``--resume`` continues from: the one named, or the
    latest in ``--out`` (None while there is none)."""
    if resume is True:
        latest = manager.latest()
        return None if latest is None else manager.path(latest)
    return resume or None


def elastic_bounds(world: int) -> tuple[int, int]:
    """``SHARDAX_ELASTIC``'s ``MIN:MAX`` (``shardax launch --elastic`` sets
    it), or this world's size for both when it is not set."""
    text = os.environ.get("SHARDAX_ELASTIC")
    if not text:
        return world, world
    lo, _, hi = text.partition(":")
    return int(lo), int(hi)


def elastic_batch(
    run: sx.config.RunConfig, world: int, bounds: tuple[int, int]
) -> tuple[sx.config.ResolvedBatch, str | None]:
    """The batch of an elastic run on ``world`` ranks, and a note when the
    micro batch had to shrink. The global batch stays; the micro batch is
    the config's, or else the largest world's (``bounds[1]`` ranks); the
    accumulation makes up the rest. A global batch that does not split over
    every data-parallel size of ``bounds`` is refused, with the fix.

    >>> run = parse_args(["--batch-size", "12"]).run
    >>> elastic_batch(run, 4, (2, 4))
    (ResolvedBatch(global_size=12, micro=3, accumulation=1), None)
    >>> elastic_batch(run, 3, (2, 4))[1]
    'elastic: global batch 12 kept on 3 data-parallel rank(s): micro batch 3 does not divide it, micro 2 x accumulation 2'
    >>> elastic_batch(parse_args(["--batch-size", "16"]).run, 4, (2, 4))
    Traceback (most recent call last):
    ...
    shardax.errors.ConfigError: --elastic 2:4: the global batch 16 does not split over 3 data-parallel rank(s), a size the run may shrink to; choose a --batch-size (batch.global) that is a multiple of 12, or narrow the launcher's --elastic
    """
    lo, hi = bounds
    top = run.batch.resolve(run.dp_size(hi))
    g, micro = top.global_size, run.batch.micro or top.micro
    sizes = {}
    for w in range(lo, hi + 1):
        try:
            sizes[w] = run.dp_size(w)
        except sx.config.ConfigError as err:
            raise sx.config.ConfigError(f"--elastic {lo}:{hi}: on {w} rank(s): {err}") from None
    bad = sorted({dp for dp in sizes.values() if g % dp})
    if bad:
        raise sx.config.ConfigError(
            f"--elastic {lo}:{hi}: the global batch {g} does not split over "
            f"{', '.join(map(str, bad))} data-parallel rank(s), a size the run may shrink to; "
            f"choose a --batch-size (batch.global) that is a multiple of "
            f"{math.lcm(*sizes.values())}, or narrow the launcher's --elastic"
        )
    dp = sizes.get(world) or run.dp_size(world)
    m = max(m for m in range(1, micro + 1) if g % (m * dp) == 0)
    note = None
    if m != micro:
        note = (f"elastic: global batch {g} kept on {dp} data-parallel rank(s): micro batch "
                f"{micro} does not divide it, micro {m} x accumulation {g // (m * dp)}")  # fmt: skip
    return sx.config.ResolvedBatch(g, m, g // (m * dp)), note


def kill_now(step: int, rank: int, args: argparse.Namespace) -> None:
    """``--kill-at``: on the first try, the rank it names dies here by
    SIGKILL — with ``--kill-node``, its node's launcher first."""
    if args.kill_at != (step, rank) or os.environ.get("SHARDAX_RESTART_COUNT", "0") != "0":
        return
    import signal

    print(f"--kill-at: rank {rank} is killed in step {step}", flush=True)
    if args.kill_node:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


LOSS_SCALE_STATE = ("scale", "growth_tracker", "skipped", "hysteresis_left")


def loss_scale_state(ls: sx.optim.DynamicLossScale) -> dict[str, float | int]:
    """Where fp16's loss scale stands, for the checkpoint (how it scales
    is the run config's)."""
    return {k: getattr(ls, k) for k in LOSS_SCALE_STATE}


def resumed_loss_scale(
    fresh: sx.optim.DynamicLossScale, saved: dict | None, imported: dict | None
) -> tuple[sx.optim.DynamicLossScale, str]:
    """fp16's loss scale on resuming, and what became of it in words: where
    the scale stood (``saved``: the checkpoint's ``loss_scale`` entries;
    ``imported``: an imported DeepSpeed checkpoint's, from its metadata)
    with how it scales from the run config (``fresh``); the config's
    initial scale where the checkpoint holds none.

    >>> fresh = sx.optim.DynamicLossScale(65536.0)
    >>> ls, said = resumed_loss_scale(fresh, {"scale": 1024.0, "growth_tracker": 7}, None)
    >>> ls.scale, ls.growth_tracker, said
    (1024.0, 7, 'loss scale 1024 as saved')
    >>> resumed_loss_scale(fresh, None, None)[1]
    'loss scale: none in the checkpoint, starting at 65536'
    """
    for found, how in ((saved, "as saved"), (imported, "as DeepSpeed left it")):
        if found:
            kept = {k: type(getattr(fresh, k))(found[k]) for k in LOSS_SCALE_STATE if k in found}
            ls = fresh._replace(**kept)
            return ls, f"loss scale {ls.scale:g} {how}"
    return fresh, f"loss scale: none in the checkpoint, starting at {fresh.scale:g}"


def rng_outcome(policy: str, index: Any, world: int) -> str:
    """What ``--rng policy`` made of the RNG states of a checkpoint (its
    index) on ``world`` ranks, in words: the default, ``reseed``, restores
    them where the number of ranks is the saved one, else seeds each rank's
    generators from the checkpoint and the rank.

    >>> from types import SimpleNamespace as Index
    >>> rng_outcome("reseed", Index(world_size=2, rng={0: {}, 1: {}}), 2)
    'rng: restored as saved'
    >>> rng_outcome("reseed", Index(world_size=2, rng={0: {}, 1: {}}), 3)
    'rng: reseeded from the checkpoint and the rank (saved on 2 ranks, resumed on 3)'
    """
    if policy == "skip":
        return "rng: left as it was (--rng skip)"
    if index.world_size == world and set(index.rng) == set(range(world)):
        return "rng: restored as saved"
    why = f"saved on {index.world_size} ranks, resumed on {world}" if index.rng else "none saved"
    return f"rng: reseeded from the checkpoint and the rank ({why})"


# -- peak memory by phase -------------------------------------------------------------

PHASES = ("init", "resume", "step", "save", "eval", "sample")


class PhasePeaks:
    """The peak resident memory (RSS) of each phase of the run, in MiB: the
    kernel's high-water mark (``VmHWM``) read when a phase ends and reset
    when the next one starts (``/proc/self/clear_refs``), so a phase's peak
    is its own, the memory it found included. A phase entered many times
    (``step``, ``save``) keeps its highest. Where the kernel has no such
    reset (not Linux), ``works`` is False and nothing is recorded."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.current: str | None = None
        self.works = sx.monitor.reset_peak_memory()

    def enter(self, phase: str | None) -> None:
        """End the current phase (recording its peak) and start ``phase``."""
        if not self.works:
            return
        if self.current is not None:
            peak = sx.monitor.peak_memory()["peak_rss_mib"]
            self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), peak)
        self.current = phase
        sx.monitor.reset_peak_memory()

    def line(self, mesh: sx.Mesh) -> str | None:
        """Every rank's peaks gathered (collective): the highest of any rank
        per phase, as one line; None where not measured."""
        self.enter(None)
        if not self.works:
            return None
        mine = torch.tensor([self.peaks.get(p, 0.0) for p in PHASES], dtype=torch.float64)
        if mesh.world_size > 1:
            mine = sx.collectives.all_gather(mine[None], mesh.axis_names, 0, mesh=mesh)
        peaks = mine.reshape(-1, len(PHASES)).amax(0).tolist()
        top = max(range(len(PHASES)), key=lambda i: peaks[i])
        parts = ", ".join(f"{p} {v:.0f}" for p, v in zip(PHASES, peaks, strict=True) if v > 0)
        return f"peak RSS per rank (MiB, the most of any rank): {parts}; peak in {PHASES[top]}"


def sampling_rules(run: sx.config.RunConfig) -> sx.Rules | None:
    """The module rules to sample with, the same params as training's:
    prompts grow one token at a time, so what splits the sequence —
    Megatron's sequence parallelism over tp, Ulysses over sp, the ring over
    cp — gives way to plain tensor parallelism and the experts' rule where
    the run has them (every rank runs the whole sequence); None: the
    params' own rules.

    >>> sampling_rules(parse_args(["--cp", "2", "--mesh", "dp=1"]).run)
    Rules()
    >>> sampling_rules(parse_args([]).run) is None
    True
    """
    p = run.parallel
    if not (p.sequence_parallel or p.sp is not None or p.cp is not None):
        return None
    out = sx.rules.zero(0)  # no rules of its own: the params' layouts do the rest
    if p.tp is not None:
        out = sx.rules.megatron(p.tp) + out
    if p.ep is not None:
        out = sx.rules.experts(p.ep, tp=p.tp, batch=run.data_axes) + out
    return out


def _zeropp(run: sx.config.RunConfig) -> str:
    """The ZeRO++ options of the header, if any."""
    p = run.parallel
    parts = [text for text, on in (("int8 weight gathers (qwZ)", p.quantize_weights),
             (f"a secondary copy over {p.zero_axis} (hpZ)", p.secondary),
             ("int4 gradient reduce-scatters (qgZ)", p.quantize_grads)) if on]  # fmt: skip
    return f" over {p.node} x {p.zero_axis} with ZeRO++: " + ", ".join(parts) if parts else ""


def _remat(run: sx.config.RunConfig) -> str:
    """The remat rule the run adds, as it prints."""
    return "; ".join(repr(r.remat) for r in run.make_rules().modules if r.remat is not None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    phases = PhasePeaks()  # each phase's peak memory, printed at the end
    phases.enter("init")
    run = args.run
    info = sx.init()
    mesh = sx.Mesh(run.mesh)
    rank = info.rank

    def say(*lines: object) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    cfg = PRESETS[args.preset].replace(
        experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        router_aux_loss=args.aux_loss,
    )
    if run.parallel.ep is not None and not cfg.experts:
        raise sx.config.ConfigError(
            f"parallel.ep ({run.parallel.ep!r}) splits experts over ranks, but the model has "
            "none: give --experts N (e.g. --experts 8 --top-k 2)"
        )
    cp = run.parallel.cp  # context parallelism: each cp rank its piece of every sequence
    if cp is not None:
        check_context(args.preset, cp, mesh.size(cp))
    data_axes = run.data_axes  # with experts, the ep ranks take their own rows too
    restart = int(os.environ.get("SHARDAX_RESTART_COUNT", "0"))  # shardax launch's tries
    if args.elastic:  # the global batch kept on whatever number of ranks remains
        batch, note = elastic_batch(run, info.world_size, elastic_bounds(info.world_size))
        if note:
            say(note)
        if restart and args.resume is None:  # a restart: go on from the newest checkpoint
            args.resume = True
    else:
        batch = run.batch.resolve(run.dp_size(info.world_size))
    steps, accumulation = run.steps, batch.accumulation
    train = sx.data.TextDataset.tinyshakespeare(cfg.seq_len, split="train")
    val = sx.data.TextDataset.tinyshakespeare(cfg.seq_len, split="val")
    micro_global = batch.global_size // accumulation  # sequences per micro-step, all ranks
    spec = run.batch_spec  # the examples over the data axes; with cp, the sequence zigzag over it
    sampler = sx.data.Sampler(len(train), micro_global, mesh, spec, seed=run.seed)
    precision = run.precision.params
    say(
        f"{mesh} on {info.world_size} rank(s); GPT {args.preset}: "
        f"{param_count(cfg) / 1e6:.2f}M params; ZeRO-{run.parallel.zero}"
        + (
            f" in each replica over {run.parallel.replicate} (HSDP)"
            if run.parallel.replicate
            else ""
        )
        + _zeropp(run)
        + f", {run.optimizer.type}, "
        f"{precision}, global batch {batch.global_size} x {cfg.seq_len} tokens"
        + (f" in {accumulation} micro-steps" if accumulation > 1 else "")
        + (f"; tensor parallel over {run.parallel.tp}" if run.parallel.tp else "")
        + (" with sequence parallelism" if run.parallel.sequence_parallel else "")
        + (f"; context parallel over {cp} (ring attention, sequences split zigzag)" if cp else "")
        + (f"; {cfg.experts} experts, top-{cfg.top_k}" if cfg.experts else "")
        + (f", capacity factor {cfg.capacity_factor:g}" if cfg.capacity_factor else "")
        + (f", split over {run.parallel.ep}" if run.parallel.ep else "")
        + (f"; blocks rematerialised ({_remat(run)})" if run.memory.remat else "")
        + (f"; optimizer state in {run.memory.offload_opt}" if run.memory.offload_opt else "")
        + (f"; parameters in {run.memory.offload_params}" if run.memory.offload_params else "")
        + (f"; gradients in {run.memory.offload_grads}" if run.memory.offload_grads else ""),
        f"unigram baseline (a model that ignores context): {train.unigram_entropy():.3f} nats/byte",
    )

    if precision == "fp16" and info.device.type == "cpu":
        say(
            "warning: fp16 on CPU has no fast matmul kernels (about 3.5x slower than fp32 on "
            "the 2-core test host); bf16 is the CPU half precision (--precision bf16)"
        )
    with torch.device("meta"):
        model = GPT(cfg)
    ckpt = run.checkpoint
    manager = sx.ckpt.CheckpointManager(
        ckpt.dir, every=ckpt.every or steps, keep=ckpt.keep, async_save=ckpt.async_save
    )
    # The last save writes the state from where it lives: in the background it would first
    # copy all of it (the state's size again in memory), yet nothing changes it after the
    # last step and the run waits for the save before it ends.
    last_save = attrs.evolve(manager, async_save=False)
    resume_from = resume_path(args.resume, manager)
    memory = None  # in-memory checkpoints: each rank's shards in host memory and with a peer
    if args.memory_ckpt_every:
        memory = sx.ckpt.MemoryCheckpointManager(every=args.memory_ckpt_every)
        memory.slot()  # no host memory kept across restarts: say so now
    snapshot = memory.latest() if memory is not None and args.resume is True else None
    if snapshot is not None and (resume_from is None or snapshot.step >= manager.latest()):
        resume_from = None  # the newest checkpoint is in host memory
    else:
        snapshot = None
    resuming = resume_from is not None or snapshot is not None
    rules = run.make_rules()

    def new_params(mesh: sx.Mesh, only: Any = None) -> dict[str, sx.Sharded]:
        """This rank's shards, initialised; or, to resume, stand-ins on
        ``meta`` (layouts and memory kinds, no memory) that the checkpoint's
        values replace: the rank never holds its state twice."""
        if not resuming:
            return sx.init_params(model, mesh, rules, only=only)
        keep = None if only is None else set(only)
        shapes = {k: v for k, v in sx.params_of(model).items() if keep is None or k in keep}
        return sx.shard(shapes, mesh, rules)

    torch.manual_seed(run.seed)
    pipe = run.make_pipeline(info.world_size)  # a pipeline schedule, with --pp
    if pipe is None:
        params = new_params(mesh)
    else:  # each rank holds its stages' parameters, laid out over the other axes
        pp = run.parallel.pp
        stage_mesh = mesh.submesh([a for a in mesh.axis_names if a != pp])
        stages = sx.pipeline.split(model, pipe.stages)
        mine = stages.local(sx.params_of(model), pipe, mesh.axis_index(pp))  # its key paths
        params = new_params(stage_mesh, only=mine)
        say(f"pipeline: {pipe.stages} stages ({stages.counts} blocks) on {pp}={mesh.size(pp)}, "
            f"{run.parallel.pp_schedule} over {pipe.micro_batches} micro-batches")  # fmt: skip
    schedule = run.make_schedule()
    opt = run.make_optimizer(accumulation, clip=pipe is None)  # a pipeline clips by its own norm
    if args.elastic and accumulation == 1:  # a restart may bring accumulation: the same state
        opt = sx.optim.MultiSteps(opt, 1)  # tree (MultiSteps') whatever the accumulation
    dtype = DTYPES[precision]
    if dtype != torch.float32:  # compute in bf16/fp16; fp32 master weights in the optimizer state
        params = {k: v.astype(dtype) for k, v in params.items()}  # kept where it lives
    loss_scale = run.make_loss_scale()  # fp16: dynamic loss scaling
    opt_state = opt.init(params)  # on meta too, resuming: the checkpoint fills it

    meta = {"preset": args.preset, "config": attrs.asdict(cfg), "seed": run.seed}
    meta.update(sx.ckpt.model_metadata(model))  # tied names: the consolidated file loads strictly
    start = 0
    if args.resume and not resuming:
        say(f"no checkpoint in {ckpt.dir}: starting from step 0")
    elif snapshot is not None:
        phases.enter("resume")
        target = {"params": params, "opt_state": opt_state, "step": 0}
        if loss_scale is not None:  # an earlier try of this run saved it
            target["loss_scale"] = loss_scale_state(loss_scale)
        strict = True if pipe is None else "target"
        _, state = memory.restore(target, step=snapshot.step, rng=args.rng, strict=strict)
        start, params, opt_state = int(state["step"]), state["params"], state["opt_state"]
        if loss_scale is not None:
            loss_scale, scaled = resumed_loss_scale(loss_scale, state["loss_scale"], None)
            say(scaled)
        del target, state
        index = argparse.Namespace(world_size=snapshot.world_size, rng=range(snapshot.world_size))
        peers = snapshot.from_peers
        say(f"resumed from host memory at step {start} (an in-memory checkpoint of "
            f"{snapshot.world_size} rank(s)" + (f"; the shards of rank(s) {list(peers)} rebuilt "
            "from their peers' copies" if peers else "") + f"); "
            f"{rng_outcome(args.rng, index, info.world_size)}")  # fmt: skip
    elif resume_from is not None:
        phases.enter("resume")
        target = {"params": params, "opt_state": opt_state, "step": 0}
        index = sx.ckpt.read_index(resume_from)
        if loss_scale is not None and any(k.startswith("loss_scale.") for k in index.leaves):
            target["loss_scale"] = loss_scale_state(loss_scale)
        strict = True if pipe is None else "target"  # a pipeline rank: its stages' part
        try:
            state = sx.ckpt.load(resume_from, target, rng=args.rng, strict=strict)
        except sx.CheckpointError as err:
            if "rng='restore'" not in str(err):
                raise
            raise sx.CheckpointError(f"{err} (the flags: --rng reseed or --rng skip)") from None
        start, params, opt_state = int(state["step"]), state["params"], state["opt_state"]
        outcome = rng_outcome(args.rng, index, info.world_size)
        if loss_scale is not None:  # fp16: where the scale stood (a DeepSpeed import: its own)
            loss_scale, scaled = resumed_loss_scale(
                loss_scale, state.get("loss_scale"), index.metadata.get("loss_scale")
            )
            outcome += f"; {scaled}"
        del target, state  # the stand-ins, and a second name for the state
        say(f"resumed from {resume_from} at step {start}; {outcome}")
    metrics = open(args.metrics, "a") if args.metrics and rank == 0 else None  # noqa: SIM115

    def loss_fn(params: dict, batch: dict, scale: float) -> torch.Tensor:
        # whole logits on every rank, under tp and sp too: a plain loss; under cp, the logits
        # and targets of this rank's piece of each sequence (the value: the mean over ranks)
        return cross_entropy(sx.apply(model, params, batch["x"]), batch["y"]) * scale

    def logits_of(params: dict, x: torch.Tensor, rules: sx.Rules | None = None) -> torch.Tensor:
        """The whole vocabulary's logits for the whole sequence."""
        return sx.apply(model, params, x, rules=rules)

    # 1-bit optimizers average the gradients themselves: each rank's own, unreduced
    grad_fn = sx.value_and_grad(
        loss_fn, bucket_bytes=run.parallel.bucket_bytes, unreduced=run.unreduced_axes
    )
    if pipe is not None:
        grad_fn, val_fn = pipelined(run, model, mesh, pipe, stages)
    tokens_per_step = batch.global_size * cfg.seq_len
    bar = progress_bar(steps, start) if shows_progress(args.progress, rank) else None
    monitor = sx.monitor.Monitor.from_config(
        attrs.evolve(run.monitor, experts=run.monitor.experts or bool(cfg.experts)),
        mesh=mesh,
        samples_per_step=batch.global_size,
        tokens_per_step=tokens_per_step,
        flops_per_token=sx.monitor.transformer_flops_per_token(
            param_count(cfg, active=True), cfg.n_layers, cfg.seq_len, cfg.d_model
        ),
        total_steps=steps,
        stream=AboveBar(bar, sys.stdout) if bar is not None else None,
    )
    record: list[dict] = []  # rank 0: each step's loss, lr and tokens/s, for the loss record
    started = time.perf_counter()
    micro_steps = iter(
        sx.data.batches(
            train,
            sampler,
            start_step=start * accumulation,
            num_steps=(steps - start) * accumulation,
        )
    )
    for step in range(start + 1, steps + 1):
        began = time.perf_counter()
        phases.enter("step")
        with monitor.step(step):
            losses = []  # the step's loss: the mean of its micro-steps' (the global batch's)
            for micro in itertools.islice(micro_steps, accumulation):
                scale = loss_scale.scale if loss_scale is not None else 1.0
                loss, grads = grad_fn(params, micro, scale)
                if args.kill_at is not None:
                    kill_now(step, rank, args)  # a rank lost mid-step (tests, benchmarks)
                losses.append(loss / scale)
                finite = True
                if loss_scale is not None:  # fp16: an overflow on any rank skips the update
                    grads, loss_scale = loss_scale.unscale_and_adjust(grads)
                    finite = loss_scale.finite
                    if not finite and accumulation > 1:  # keep the window: add nothing
                        grads = {
                            k: g.with_local(torch.zeros_like(g.local)) for k, g in grads.items()
                        }
                if finite or accumulation > 1:
                    with monitor.timer("optimizer"):
                        # update + apply in place, in one native pass where the optimizer has one
                        params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
                grads = None  # freed now, not while the next micro-step makes its own
            loss = sum(losses) / len(losses)
            monitor.log(loss=loss, lr=schedule(step - 1))
            if loss_scale is not None:
                monitor.log(loss_scale=loss_scale.scale)
        if rank == 0:
            tokens_per_s = tokens_per_step / (time.perf_counter() - began)
            record.append({"step": step, "loss": float(loss), "lr": schedule(step - 1),
                           "tokens_per_s": tokens_per_s})  # fmt: skip
            if bar is not None:
                advance(bar, record[-1]["loss"], tokens_per_step)
        phases.enter("save")
        state = {"params": params, "opt_state": opt_state, "step": step}
        if loss_scale is not None:  # fp16: where the scale stands, so a resume goes on from it
            state["loss_scale"] = loss_scale_state(loss_scale)
        saver = manager if step < steps else last_save
        saver.save(step, state, metadata=meta, force=step == steps)
        if memory is not None:
            memory.save(step, state, metadata=meta)
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "loss": float(loss), "lr": schedule(step - 1)}))
            metrics.write("\n")
            metrics.flush()
    if bar is not None:
        bar.close()
    monitor.close()
    elapsed = time.perf_counter() - started
    if metrics is not None:
        metrics.close()

    phases.enter("eval")
    val_sampler = sx.data.Sampler(len(val), micro_global, mesh, spec, shuffle=False)
    val_batches = list(sx.data.batches(val, val_sampler, num_steps=args.eval_batches))
    if not val_batches:
        val_loss = float("nan")
    elif pipe is not None:
        val_loss = evaluate(val_fn, params, val_batches, mesh, list(data_axes))
    else:

        def val_loss_of(params: dict, b: dict) -> torch.Tensor:
            return cross_entropy(logits_of(params, b["x"]), b["y"])

        # under cp each rank's loss is that of its piece (equal pieces): averaged over cp too
        val_axes = [*data_axes, *([cp] if cp is not None else [])]
        val_loss = evaluate(val_loss_of, params, val_batches, mesh, val_axes)
    say(f"val loss {val_loss:.4f} after {steps} steps in {elapsed:.0f} s")
    if record and val_batches:
        record[-1]["val_loss"] = val_loss

    phases.enter("save")
    manager.wait()
    if manager.latest() is not None:
        say(f"saved {manager.path(manager.latest())}")
    if rank == 0 and (lines := loss_record(Path(ckpt.dir), record, start)):
        say(*lines)  # loss.csv (and loss.png) next to the checkpoints

    if args.sample_tokens > 0 and pipe is not None:
        say("sample: not drawn under a pipeline (--pp): each rank holds only its stages")
    elif args.sample_tokens > 0:
        phases.enter("sample")
        prompt = sx.data.TextDataset.encode(args.prompt)[None]
        plain = sampling_rules(run)
        out = generate(
            lambda idx: logits_of(params, idx, plain),
            prompt,
            args.sample_tokens,
            temperature=0.8,
            top_k=40,
            generator=torch.Generator().manual_seed(run.seed),
            context=cfg.seq_len,
        )
        say("sample:", sx.data.TextDataset.decode(out[0]))
    if (peaks := phases.line(mesh)) is not None:
        say(peaks)
    sx.shutdown()
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """``main``, with a bad setting (a typed shardax error) shown as one line
    and exit status 2, as argparse does for its own errors."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return main(argv)
    except sx.errors.USER_ERRORS as err:
        if "--debug" in argv or sx.errors.debugging():
            raise
        print(f"train_gpt.py: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
