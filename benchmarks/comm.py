"""Communication across a slow link: ZeRO-3, HSDP, ZeRO++, 1-bit and 0/1 Adam on two emulated nodes, against DeepSpeed.

One invocation trains the same GPT (``examples/gpt.py``, the ``small``
preset by default: 1.85M parameters) on the same tinyshakespeare bytes,
from the same seed, with ``train.py``'s AdamW (lr 3e-4, betas (0.9, 0.95),
eps 1e-8, weight decay 0.1, fp32), on 4 ranks: two "nodes" of 2 ranks each,
made on this host by ``shardax.launch._emulated.EmulatedCluster`` (two
network namespaces joined by a veth whose bandwidth ``tc``'s token bucket
caps at each of ``--speeds``; the ranks of a node share memory, gloo
crosses the link). Each rank takes ``--micro-batch`` sequences per step
(the global batch split over all 4 ranks, whatever the layout). The
layouts (:data:`LAYOUTS`, ``docs/comm.md``):

- ``zero3``: ``Mesh({"node": 2, "local": 2})``, ``rules.zero(3, ("node",
  "local"))``: parameters, gradients and optimizer state split over all 4
  ranks; every gather and the gradients' reduce-scatter cross the link;
- ``hsdp``: ``Mesh({"replicate": 2, "fsdp": 2})``, ``rules.zero(3,
  "fsdp")``: ZeRO-3 within each node, the nodes replicas of each other;
  only the replicas' all-reduce of each gradient shard crosses;
- ``zero3-persist``: ``zero3`` with ``persist_below=100_000``
  (DeepSpeed's default ``stage3_param_persistence_threshold``): the
  parameters under 100k elements (the embeddings, the attention's output
  projections, the norms and biases) stay whole, their gradients
  reduce-scattered and their updates gathered once a step;
- ``zero3-keep``: ``zero3`` with ``keep_gathered=True`` (FSDP2's
  ``reshard_after_forward=False``): the forward's gathers kept for the
  backward, which gathers nothing — what ``deepspeed-zero3`` does on this
  model (its gathers are once a step);
- ``zero3-hpz``: ``zero3`` with ``secondary="local"`` (ZeRO++'s hpZ): the
  backward gathers from a copy split within the node;
- ``zero3-qwz``: ``zero3`` with ``quantize_weights=True`` (ZeRO++'s qwZ):
  the gathers send blockwise int8;
- ``zero3-qwz-hpz``: both;
- ``zero3-qgz``: ``zero3`` with ``quantize_grads=True`` (ZeRO++'s qgZ):
  the gradients reduce-scattered in int4, by an all-to-all within each node
  then one across;
- ``zeropp``: all three (qwZ + hpZ + qgZ), DeepSpeed's ZeRO++;
- ``zero0``: ``Mesh({"dp": 4})``, ``rules.zero(0)``: plain data
  parallelism, each gradient all-reduced;
- ``onebit-adam``: ``zero0`` with ``optim.onebit_adam`` (AdamW's bias
  correction, 1-bit from step 3): after its 2 warm-up steps only the
  momenta's signs and scales cross (``value_and_grad(unreduced="dp")``);
- ``zero-one-adam``: ``zero0`` with ``optim.zero_one_adam`` (0/1 Adam,
  :data:`ZERO_ONE`: ``var_freeze_step=2, local_step_scaler=1,
  local_step_clipper=4``): its steady state after the variance freezes,
  the ranks syncing their change in 1 bit once every H = 4 steps and
  sending nothing on the 3 local steps between. Not DeepSpeed's defaults
  (``local_step_scaler=32678``: a local interval of 1, a sync every step,
  for 32678 steps, then 2, …, up to 16), which a 7-step run would measure
  as 1-bit Adam's bytes. On DeepSpeed's count (``ds = t + 1`` at step
  ``t``, from 1): steps 1 and 2 average the gradients in fp32 (the
  variance's updates: 1-bit Adam's 2-step warm-up; frozen after one, the
  small GPT's loss is NaN by step 7); then a 1-bit sync wherever ``ds``
  is a multiple of the local interval, which is 1 at step 3, 2 at step 4
  and 4 from step 5 on: syncs at steps 3, 7, 11, … (``t % 4 == 3``). The
  default run's timed steps (3..7) send ``onebit, none, none, none,
  onebit``: 2 of 1-bit Adam's 5 averages, 0.4 of its bytes (1/4 over a
  multiple of 4 steps); the smoke's (2..4) ``psum, onebit, none``. A
  row's ``sends`` lists its timed steps' (:mod:`_onebit_sends`), and the
  test checks its traffic log against them;

and the DeepSpeed anchors (:data:`DEEPSPEED`), on its CPU accelerator
(``DS_ACCELERATOR=cpu``) over gloo, with ``torch.optim.AdamW`` as the
client optimizer as in ``train.py``, every parameter split
(``stage3_param_persistence_threshold: 0``: DeepSpeed's default keeps
those under 100k elements whole on every rank, an eighth of this model's
elements, which ``deepspeed-zero3-persist`` measures):

- ``deepspeed-zero3``: ``zero_optimization: {stage: 3}``;
- ``deepspeed-zero3-persist``: the same with DeepSpeed's default threshold
  (``zero3-persist``'s anchor);
- ``deepspeed-zeropp``: ``{stage: 3, zero_quantized_weights: true,
  zero_hpz_partition_size: 2, zero_quantized_gradients: true}`` (a node's
  2 ranks hold the secondary copy);
- ``deepspeed-onebit-adam``: ``optimizer: {type: OneBitAdam}`` (stage 0,
  its ``compressed`` comm backend);
- ``deepspeed-zero-one-adam``: ``optimizer: {type: ZeroOneAdam}`` with
  :data:`ZERO_ONE`'s schedule (likewise).

A DeepSpeed layout that fails to start (to build, or to take its first
step) is recorded as skipped: ``skipped`` is the exception's last line,
``raised_at`` its last two frames; it is tried at the first speed only and
never replaced by something else under its name. A new layout is one more
entry of :data:`LAYOUTS` (a mesh, rules and, where its optimizer averages
the gradients itself, a ``setup``) and of :data:`CROSSING` for what its
collectives send.

For each repeat, for each speed (a fresh cluster), one launch (``shardax
launch`` on each node, one thread per rank, glibc's mmap threshold at 4 MiB
as ``train.py`` sets it) runs the shardax layouts one after the other,
their order rotated by the repeat (``--fresh``: a launch for each), then
one launch for each DeepSpeed layout: starting 4 ranks costs more than a
layout's steps on this 2-core host. A layout builds the model, takes
``--warmup`` untimed steps, then times ``--steps`` steps, each between two
barriers (the slowest rank's time). Around the timed steps, after a barrier
(every send before it received), each rank reads its node's veth counter
(``link_bytes_sent()``), and counts the collectives: shardax's traffic log
(``sx.collectives.traffic()``, by op and mesh axes) or, for DeepSpeed, the
``torch.distributed`` calls its ``deepspeed.comm`` makes (by op and group
size). **bytes across** is what a node sent over the link per step (the
larger node; TCP/IP headers included, and the barriers' few hundred bytes a
step); **traffic** each collective's buffer bytes per step, one rank's, as
nccl-tests' "size" counts them. ``across_formula`` is what shardax's log
says should cross per node, by :data:`CROSSING` (gloo's ring all-gather
over 4 ranks on 2 nodes crosses 3/4 of its size; its reduce-scatter, an
all-to-all, all of it; the replicas' all-reduce twice a rank's buffer, once
for each of the node's ranks; collectives within a node nothing), and
``across_vs_formula`` the measured bytes over it: a layout sending more than
its collectives should shows there.

One JSON line per layout and run: global tokens/s, median step time, bytes
across (per node and the larger), traffic per step, every step's global
loss (warm-up first). A last line summarises each (speed, layout): medians
over repeats, ``tokens_per_s_vs_zero3`` and ``bytes_across_vs_zero3`` (at
the same speed), and ``zero3`` and ``zeropp`` over their DeepSpeed
counterparts where those ran (``tokens_per_s_vs_deepspeed-zeropp``).
Losses: the exact layouts (all but the quantized) start from the same
weights and batch, so their first losses agree with ``zero3``'s to 1e-4
and their last ones to 1e-3 (fp32 sums in other orders over a few AdamW
steps); the quantized ones' to 2 % (int8 weights, ``docs/comm.md``);
1-bit and 0/1 Adam's first loss to 1e-4 (their last is their own: other
optimizers). A
layout outside that fails the run (exit code 1) with a ``warning``. A
readable table goes to stderr.

    python benchmarks/comm.py --repeats 3 --json benchmarks/results/comm.json
    python benchmarks/comm.py --speeds 100mbit --layouts zero3,zeropp,deepspeed-zeropp
    python benchmarks/comm.py --smoke    # tiny GPT, 1gbit only, 1 + 3 steps: 30–60 s

Needs root (network namespaces, ``tc``); elsewhere it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from _data import MICRO_BATCH, batch, load_tokens, model_facts
from _onebit_sends import onebit_adam_sends, zero_one_adam_sends
from gpt import PRESETS, GPTConfig, param_count
from train import (
    BETAS,
    DATA,
    EPS,
    LR,
    WEIGHT_DECAY,
    _dense_model,
    _loss,
    _shardax_step,
    _torch_adamw,
)

import shardax as sx
from shardax.launch._emulated import EmulatedCluster, link_bytes_sent, unavailable

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""One optimizer step on this rank's micro-batch ``(x, y)``; returns the loss."""

NODES, NPROC_PER_NODE = 2, 2
TIMEOUT_S = 120.0  # a collective that cannot complete (a DeepSpeed rank that failed alone)
SPEEDS = ["1gbit", "100mbit"]
EXACT_FIRST, EXACT_LAST, QUANTIZED = 1e-4, 1e-3, 0.02  # loss tolerances, see the docstring


# ---------------------------------------------------------------- the layouts


@attrs.frozen(kw_only=True)
class Layout:
    """A shardax layout of the benchmark: a mesh over the 2 + 2 ranks (the
    last axis the fastest: a node's ranks), its rules, and the train step
    (``train.py``'s: ``init_params``, ``value_and_grad``, fused AdamW)."""

    mesh: dict[str, int]
    rules: Callable[[], sx.Rules]
    exact: bool = True  # computes what one process would (no quantized weights or gradients)
    setup: Callable[[GPTConfig, int, sx.Mesh, sx.Rules], Step] = attrs.field(
        default=lambda cfg, seed, mesh, rules: _shardax_step(cfg, seed, mesh, rules, _loss)
    )


ONEBIT_FREEZE = 2  # the warm-up steps: the timed steps after them are 1-bit


def _onebit_adam() -> Any:
    """1-bit Adam, 1-bit after :data:`ONEBIT_FREEZE` steps, with AdamW's
    bias correction: its losses compare with the other layouts' AdamW."""
    return sx.optim.onebit_adam(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                                freeze_step=ONEBIT_FREEZE)  # fmt: skip


ZERO_ONE = {"var_freeze_step": 2, "local_step_scaler": 1, "local_step_clipper": 4}
"""0/1 Adam's schedule here: the variance frozen after step 2, a 1-bit sync
every H = 4 steps from step 3 (the module's docstring)."""


def _zero_one_adam() -> Any:
    """0/1 Adam with :data:`ZERO_ONE`'s schedule and AdamW's settings."""
    return sx.optim.zero_one_adam(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS,
                                  weight_decay=WEIGHT_DECAY, **ZERO_ONE)  # fmt: skip


def _partial_grads(opt: Callable[[], Any]) -> Callable[[GPTConfig, int, sx.Mesh, sx.Rules], Step]:
    """The train step of an optimizer that averages the gradients itself:
    ``opt()`` on gradients left partial over dp."""
    return lambda cfg, seed, mesh, rules: _shardax_step(
        cfg, seed, mesh, rules, _loss, opt=opt(), unreduced=("dp",)
    )


SENDS: dict[str, Callable[[int], list[str]]] = {
    "onebit-adam": lambda n: onebit_adam_sends(n, freeze_step=ONEBIT_FREEZE),
    "zero-one-adam": lambda n: zero_one_adam_sends(n, **ZERO_ONE),
}
"""What the 1-bit layouts send on steps 1..n (``psum``, ``onebit`` or
``none``, :mod:`_onebit_sends`): a row's ``sends`` are its timed steps'."""

OTHER_OPTIMIZER = {"onebit-adam", "deepspeed-onebit-adam", "zero-one-adam",
                   "deepspeed-zero-one-adam"}  # fmt: skip
"""Layouts training with another optimizer than AdamW: their first loss is
``zero3``'s (the same weights and batch), their last one is their own (1-bit
Adam's frozen variance, after a 2-step warm-up, takes larger steps; 0/1
Adam's likewise, its ranks stepping apart between syncs)."""

PERSISTENCE = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold``: ``zero3-persist``
keeps the parameters under it whole, as ``deepspeed-zero3-persist`` does."""

NODE_LOCAL = {"node": NODES, "local": NPROC_PER_NODE}
BOTH = ("node", "local")
LAYOUTS: dict[str, Layout] = {
    "zero3": Layout(mesh=NODE_LOCAL, rules=lambda: sx.rules.zero(3, BOTH)),
    "hsdp": Layout(
        mesh={"replicate": NODES, "fsdp": NPROC_PER_NODE}, rules=lambda: sx.rules.zero(3, "fsdp")
    ),
    "zero3-persist": Layout(  # DeepSpeed's default: parameters under 100k elements kept whole
        mesh=NODE_LOCAL, rules=lambda: sx.rules.zero(3, BOTH, persist_below=PERSISTENCE)
    ),
    "zero3-keep": Layout(  # the forward's gathers kept for the backward, as DeepSpeed's here
        mesh=NODE_LOCAL, rules=lambda: sx.rules.zero(3, BOTH, keep_gathered=True)
    ),
    "zero3-hpz": Layout(mesh=NODE_LOCAL, rules=lambda: sx.rules.zero(3, BOTH, secondary="local")),
    "zero3-qwz": Layout(
        mesh=NODE_LOCAL, rules=lambda: sx.rules.zero(3, BOTH, quantize_weights=True), exact=False
    ),
    "zero3-qwz-hpz": Layout(
        mesh=NODE_LOCAL,
        rules=lambda: sx.rules.zero(3, BOTH, quantize_weights=True, secondary="local"),
        exact=False,
    ),
    "zero3-qgz": Layout(
        mesh=NODE_LOCAL, rules=lambda: sx.rules.zero(3, BOTH, quantize_grads=True), exact=False
    ),
    "zeropp": Layout(  # all three of ZeRO++'s options
        mesh=NODE_LOCAL,
        rules=lambda: sx.rules.zero(
            3, BOTH, quantize_weights=True, secondary="local", quantize_grads=True
        ),
        exact=False,
    ),
    "zero0": Layout(mesh={"dp": NODES * NPROC_PER_NODE}, rules=lambda: sx.rules.zero(0)),
    "onebit-adam": Layout(
        mesh={"dp": NODES * NPROC_PER_NODE},
        rules=lambda: sx.rules.zero(0),
        exact=False,
        setup=_partial_grads(_onebit_adam),
    ),
    "zero-one-adam": Layout(
        mesh={"dp": NODES * NPROC_PER_NODE},
        rules=lambda: sx.rules.zero(0),
        exact=False,
        setup=_partial_grads(_zero_one_adam),
    ),
}
"""The shardax layouts, in the order they run."""

WHOLE = {"stage": 3, "stage3_param_persistence_threshold": 0}
"""ZeRO-3 splitting every parameter, as shardax's does (DeepSpeed's default
keeps each parameter under 100k elements whole on every rank)."""
DEEPSPEED: dict[str, dict[str, Any]] = {
    "deepspeed-zero3": {"zero_optimization": WHOLE},
    "deepspeed-zero3-persist": {"zero_optimization": {"stage": 3}},  # its default threshold
    "deepspeed-zeropp": {
        "zero_optimization": {
            **WHOLE,
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": NPROC_PER_NODE,
            "zero_quantized_gradients": True,
        }
    },
    "deepspeed-onebit-adam": {
        "zero_optimization": {"stage": 0},
        "optimizer": {
            "type": "OneBitAdam",
            "params": {
                "lr": LR,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY,
                "freeze_step": ONEBIT_FREEZE,
                "cuda_aware": False,
                "comm_backend_name": "compressed",
            },
        },
    },
    "deepspeed-zero-one-adam": {
        "zero_optimization": {"stage": 0},
        "optimizer": {
            "type": "ZeroOneAdam",
            "params": {
                "lr": LR,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY,
                **ZERO_ONE,
                "cuda_aware": False,
                "comm_backend_name": "compressed",
            },
        },
    },
}
"""DeepSpeed's configs for its layouts (over ``train.py``'s base config)."""
INEXACT_DEEPSPEED = {"deepspeed-zeropp", "deepspeed-onebit-adam", "deepspeed-zero-one-adam"}
COUNTERPARTS = {
    "zero3": "deepspeed-zero3",
    "zero3-persist": "deepspeed-zero3-persist",
    "zero3-keep": "deepspeed-zero3",  # which gathers once a step here (benchmarks/README.md)
    "zeropp": "deepspeed-zeropp",
    "onebit-adam": "deepspeed-onebit-adam",
    "zero-one-adam": "deepspeed-zero-one-adam",
}
"""Each shardax layout's DeepSpeed anchor: the summary's ``tokens_per_s_vs_<anchor>``."""
ALL_LAYOUTS = [*LAYOUTS, *DEEPSPEED]

CROSSING: dict[tuple[str, tuple[str, ...]], float] = {
    ("all_gather", BOTH): 0.75,  # gloo's ring over 4 ranks: 2 of its 4 hops cross, 3 pieces of 4
    ("psum_scatter", BOTH): 1.0,  # gloo's all-to-all: each rank sends its 2 rows for the other node
    **{(op, axes): 1.0 for op in ("psum", "pmean") for axes in (BOTH, ("replicate", "fsdp"))},
    # ^ over every rank: each node sums within itself, then its leader's all-reduce sends it once
    ("psum", ("replicate",)): float(NPROC_PER_NODE),  # each of the node's ranks with its replica
    **{(op, (axis,)): 0.0 for op in ("all_gather", "psum_scatter", "psum", "ragged_all_to_all")
       for axis in ("local", "fsdp")},  # within a node: shared memory
    # qgZ: the log counts what this rank sends; both of a node's ranks send across
    ("ragged_all_to_all", ("node",)): float(NPROC_PER_NODE),
    # over dp = 4 ranks (zero0, 1-bit and 0/1 Adam): an all-reduce as over both axes; the 1-bit
    # all-to-all sends 2 of its 4 rows across from each rank; its all-gather is gloo's ring
    **{(op, ("dp",)): 1.0 for op in ("psum", "pmean", "all_to_all")},
    ("all_gather", ("dp",)): 0.75,
}  # fmt: skip
"""What a node sends across the link per byte of the traffic log's size
(one rank's), by (op, axes), on 2 nodes of 2 ranks."""


def across_formula(traffic: dict[str, float]) -> float | None:
    """The bytes a node should send across per step, by :data:`CROSSING`,
    from one rank's traffic log (``{"op:axis,axis": bytes}``); None if it
    holds a collective the table does not know."""
    total = 0.0
    for key, size in traffic.items():
        op, axes = key.split(":", 1)
        share = CROSSING.get((op, tuple(axes.split(","))))
        if share is None:
            return None
        total += share * size
    return total


# ---------------------------------------------------------------- one run, on every rank


def setup_deepspeed(layout: str, cfg: GPTConfig, seed: int, micro_batch: int) -> Step:
    """DeepSpeed with :data:`DEEPSPEED`'s config for ``layout`` over
    ``train.py``'s (fp32, no clipping), with ``torch.optim.AdamW`` as its
    client optimizer unless the config names its own."""
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = _dense_model(cfg, seed)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
        **DEEPSPEED[layout],
    }
    client = None if "optimizer" in config else _torch_adamw(model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=client, config=config
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


TORCH_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather",
                     "reduce_scatter", "broadcast", "all_to_all_single")  # fmt: skip


def count_torch_collectives() -> collections.Counter:
    """From now on, count this process's ``torch.distributed`` collectives
    (what ``deepspeed.comm`` calls; installed before DeepSpeed starts, as it
    keeps references to them): a counter of bytes by ``"op:group size"``
    (the largest buffer: the gathered output, the reduce-scatter's input; a
    list counts as its sum, as shardax's traffic log counts its own), and of
    calls by ``"op:group size:calls"``."""
    counts: collections.Counter = collections.Counter()

    def counted(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            sizes = [0]
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    sizes.append(a.numel() * a.element_size())
                elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                    sizes.append(sum(t.numel() * t.element_size() for t in a))
            key = f"{name}:{dist.get_world_size(kwargs.get('group'))}"
            counts[key] += max(sizes)
            counts[f"{key}:calls"] += 1
            return fn(*args, **kwargs)

        return call

    for name in TORCH_COLLECTIVES:
        setattr(dist, name, counted(name, getattr(dist, name)))
    return counts


def setup(layout: str, cfg: GPTConfig, args: argparse.Namespace) -> Step:
    """Build ``layout``'s model and optimizer on this rank; its step."""
    if layout in DEEPSPEED:
        return setup_deepspeed(layout, cfg, args.seed, args.micro)
    spec = LAYOUTS[layout]
    return spec.setup(cfg, args.seed, sx.Mesh(dict(spec.mesh)), spec.rules())


def last_line(e: BaseException) -> str:
    """An exception as its traceback's last line: ``Type: message``'s first line."""
    text = traceback.format_exception_only(type(e), e)[-1].strip()
    return text.splitlines()[0] if text else type(e).__name__


def where(e: BaseException) -> str:
    """Where ``e`` was raised from: its traceback's last two frames, innermost last."""
    frames = traceback.extract_tb(e.__traceback__)[-2:]
    return " <- ".join(
        f"{Path(f.filename).name}:{f.lineno} {f.name}: {(f.line or '').strip()}"
        for f in reversed(frames)
    )


def run_layout(layout: str, cfg: GPTConfig, tokens: torch.Tensor, args: argparse.Namespace) -> dict:
    """One layout on this rank: build, warm up, time, count the bytes; its
    result, the same on every rank (or, for DeepSpeed, why it could not
    start)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch_at = functools.partial(
        batch, tokens, seed=args.seed, seq_len=cfg.seq_len, micro_batch=args.micro
    )
    started = time.perf_counter()
    failed = None
    torch_counts = None if layout in LAYOUTS else count_torch_collectives()
    try:  # a DeepSpeed layout that cannot start (build or first step) is a skipped row
        step = setup(layout, cfg, args)
        losses = [step(*batch_at(0))]
    except Exception as e:
        if layout in LAYOUTS:
            raise
        failed = {"skipped": last_line(e), "raised_at": where(e)}
        print(f"rank {rank}: {layout} failed to start:\n{traceback.format_exc()}", file=sys.stderr)
    reasons: list = [None] * world
    dist.all_gather_object(reasons, failed)
    if any(reasons):
        return next(r for r in reasons if r)
    build_s = time.perf_counter() - started
    losses += [step(*batch_at(i)) for i in range(1, args.warmup)]
    times = []
    dist.barrier()  # every rank's sends so far received: the counters are settled
    before = link_bytes_sent()
    torch_before = collections.Counter(torch_counts)
    with sx.collectives.traffic() as traffic:
        for i in range(args.warmup, args.warmup + args.steps):
            x, y = batch_at(i)
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(step(x, y))
            dist.barrier()
            times.append(time.perf_counter() - t0)
    sent = link_bytes_sent() - before
    counted = collections.Counter(torch_counts)  # before the collectives below
    counted.subtract(torch_before)
    seconds = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's
    loss = torch.stack(losses).double()
    dist.all_reduce(loss)  # the global loss: the mean of the ranks' (shardax's is already global)
    loss /= world
    node = rank // int(os.environ.get("LOCAL_WORLD_SIZE", NPROC_PER_NODE))
    sent_by: list = [None] * world
    dist.all_gather_object(sent_by, (node, sent))
    per_node = [max(s for n, s in sent_by if n == k) / args.steps for k in range(NODES)]
    result: dict[str, Any] = {
        "tokens_per_s": args.micro * world * cfg.seq_len * args.steps / float(seconds.sum()),
        "step_s": statistics.median(seconds.tolist()),
        "step_s_all": seconds.tolist(),
        "build_s": build_s,
        "bytes_across": max(per_node),
        "bytes_across_per_node": per_node,
        "losses": loss.tolist(),
        "first_loss": loss[0].item(),
        "last_loss": loss[-1].item(),
    }
    if layout in LAYOUTS:
        per_step = lambda counts: {  # noqa: E731
            f"{op}:{','.join(axes)}": n / args.steps for (op, axes), n in counts.items()
        }
        logged = per_step(traffic.bytes)
        formula = across_formula(logged)
        result.update(traffic_bytes=logged, traffic_calls=per_step(traffic.calls))
        result["across_formula"] = formula
        if formula:
            result["across_vs_formula"] = result["bytes_across"] / formula
        if layout in SENDS:
            result["sends"] = SENDS[layout](args.warmup + args.steps)[args.warmup :]
    elif torch_counts is not None:  # torch.distributed's calls, by op and group size
        calls = {k: n for k, n in counted.items() if n and k.endswith(":calls")}
        result["traffic_bytes"] = {k: n / args.steps for k, n in counted.items()
                                   if n and k not in calls}  # fmt: skip
        result["traffic_calls"] = {k.removesuffix(":calls"): n / args.steps
                                   for k, n in calls.items()}  # fmt: skip
    return result


def worker(args: argparse.Namespace) -> int:
    """One launch's ranks: each of ``--worker``'s layouts in turn (shardax's
    in one set of processes, a DeepSpeed layout alone); rank 0 writes the
    results."""
    torch.set_num_threads(args.threads)
    layouts = args.worker.split(",")
    if any(m in DEEPSPEED for m in layouts):
        if len(layouts) > 1:
            raise SystemExit(f"--worker {args.worker}: a DeepSpeed layout runs alone")
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    else:
        sx.init(timeout=TIMEOUT_S)
    cfg = config_from(args)
    tokens = load_tokens(Path(args.data), cfg.vocab_size)
    results = {}
    for layout in layouts:
        results[layout] = run_layout(layout, cfg, tokens, args)
        gc.collect()  # the last layout's parameters and state go before the next builds
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the driver


def config_from(args: argparse.Namespace) -> GPTConfig:
    """The preset with the command line's size overrides."""
    return PRESETS[args.preset].replace(
        d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, seq_len=args.seq_len
    )


def run_once(
    cluster: EmulatedCluster, group: list[str], speed: str, repeat: int, args: argparse.Namespace
) -> list[dict]:
    """One launch of ``group``'s layouts, one after the other, on
    ``cluster``'s fresh ranks; a JSON row for each."""
    rows = [{"layout": m, "speed": speed, "repeat": repeat, "position": k, "launch": group}
            for k, m in enumerate(group)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="shardax-comm-bench-") as tmp:
        result = Path(tmp) / "result.json"
        argv = [str(Path(__file__).resolve()), "--worker", ",".join(group), "--result", str(result)]
        argv += ["--threads", str(args.threads), "--data", args.data, "--preset", args.preset]
        argv += ["--micro-batch", str(args.micro), "--steps", str(args.steps)]
        argv += ["--warmup", str(args.warmup), "--seed", str(args.seed)]
        for flag in ["d_model", "n_layers", "n_heads", "seq_len"]:
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        env = {
            "OMP_NUM_THREADS": str(args.threads),
            "DS_ACCELERATOR": "cpu",
            # train.py's allocator setting, for every layout (sx.init() makes it otherwise)
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20)),
        }
        started = time.perf_counter()
        error = None
        try:
            port = 29500 + next(_PORTS) % 500  # a fresh one: no TIME_WAIT from the last run
            outs = cluster.launch(argv, NPROC_PER_NODE, env=env, timeout=args.timeout, port=port)
        except Exception as e:  # the run took too long: failed rows, the others go on
            outs, error = [], last_line(e)
        wall_s = time.perf_counter() - started
        if args.verbose:
            for k, done in enumerate(outs):
                print(f"--- node {k}\n{done.stdout}{done.stderr}", file=sys.stderr)
        if error is None and (any(done.returncode for done in outs) or not result.exists()):
            codes = [done.returncode for done in outs]
            tail = "".join(done.stderr[-1500:] for done in outs if done.returncode)
            error = f"ranks exited with codes {codes}: {tail.strip()[-3000:]}"
        results = {} if error else json.loads(result.read_text())
    for row in rows:
        row["wall_s"] = wall_s  # the launch's, all its layouts together
        if error:
            row["error"] = error
        else:
            row.update(results[row["layout"]])
    return rows


_PORTS = iter(range(10**9))


def launches(layouts: list[str], repeat: int, fresh: bool) -> list[list[str]]:
    """The launches of one repeat at one speed: shardax's layouts together
    (rotated by ``repeat``, so each runs first, second, … in turn) unless
    ``fresh``, every DeepSpeed layout alone."""
    ours = [m for m in layouts if m in LAYOUTS]
    if ours:
        k = repeat % len(ours)
        ours = ours[k:] + ours[:k]
    groups = [[m] for m in ours] if fresh else [ours] if ours else []
    return groups + [[m] for m in layouts if m in DEEPSPEED]


def run_all(layouts: list[str], args: argparse.Namespace) -> list[dict]:
    """Every layout at every speed, ``--repeats`` times, interleaved (for
    each repeat, for each speed — a fresh cluster — , each launch: the
    host is noisy), each row printed as it comes. A layout skipped once
    (DeepSpeed that cannot start) is not launched again: its row at the
    other speeds carries the reason and ``tried_at``, the speed it failed at."""
    rows: list[dict] = []
    skipped: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for speed in args.speeds:
            with EmulatedCluster(speed) as cluster:
                for group in launches(layouts, repeat, args.fresh):
                    if group[0] in skipped:
                        if repeat == 0:
                            first = skipped[group[0]]
                            rows.append({"layout": group[0], "speed": speed, "repeat": 0,
                                         "skipped": first["skipped"], "tried_at": first["speed"],
                                         "raised_at": first["raised_at"]})  # fmt: skip
                            print(json.dumps(rows[-1]), flush=True)
                        continue
                    for row in run_once(cluster, group, speed, repeat, args):
                        if "skipped" in row:
                            skipped[row["layout"]] = row
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict], layouts: Sequence[str], speeds: Sequence[str]) -> dict:
    """Per speed and layout: medians over repeats, ratios against ``zero3``
    and the DeepSpeed counterparts, and the loss check."""
    table: dict[str, dict[str, dict]] = {}
    warnings = []
    for speed in speeds:
        per: dict[str, dict] = {}
        for layout in layouts:
            ok = [r for r in rows if r["layout"] == layout and r["speed"] == speed
                  and "error" not in r and "skipped" not in r]  # fmt: skip
            if ok:
                per[layout] = medians(ok)
        base = per.get("zero3")
        for layout, stats in per.items():
            if base:
                stats["tokens_per_s_vs_zero3"] = stats["tokens_per_s"] / base["tokens_per_s"]
                stats["bytes_across_vs_zero3"] = stats["bytes_across"] / base["bytes_across"]
                stats["last_loss_vs_zero3"] = stats["last_loss"] - base["last_loss"]
            anchor = COUNTERPARTS.get(layout)
            if anchor in per:
                stats[f"tokens_per_s_vs_{anchor}"] = (
                    stats["tokens_per_s"] / per[anchor]["tokens_per_s"]
                )
                stats[f"bytes_across_vs_{anchor}"] = (
                    stats["bytes_across"] / per[anchor]["bytes_across"]
                )
        warnings += loss_warnings(per, speed)
        table[speed] = per
    summary: dict[str, Any] = {"summary": table}
    skipped = {r["layout"]: r["skipped"] for r in rows if "skipped" in r}
    summary["skipped"] = skipped
    failed = sorted({r["layout"] for r in rows if "error" in r})
    if failed:
        summary["failed"] = failed
    if warnings:
        summary["warning"] = "; ".join(warnings)
    return summary


def exact(layout: str) -> bool:
    """Whether ``layout`` computes what one process would (no quantization)."""
    return LAYOUTS[layout].exact if layout in LAYOUTS else layout not in INEXACT_DEEPSPEED


def loss_warnings(per: dict[str, dict], speed: str) -> list[str]:
    """The layouts whose losses are off ``zero3``'s by more than they may be."""
    base = per.get("zero3")
    if base is None:
        return []
    out = []
    for layout, stats in per.items():
        first = abs(stats["first_loss"] - base["first_loss"])
        last = abs(stats["last_loss"] - base["last_loss"])
        if exact(layout):
            bad = first > EXACT_FIRST or last > EXACT_LAST
        elif layout in OTHER_OPTIMIZER:  # the same first step; then another algorithm's path
            bad = first > EXACT_FIRST or not math.isfinite(stats["last_loss"])
        else:
            bad = max(first, last) > QUANTIZED * abs(base["last_loss"])
        if bad:
            out.append(
                f"{layout} at {speed}: first loss {stats['first_loss']:.6f}, last "
                f"{stats['last_loss']:.6f}; zero3's {base['first_loss']:.6f}, "
                f"{base['last_loss']:.6f}"
            )
    return out


def medians(ok: list[dict]) -> dict:
    """One (speed, layout)'s runs summed up: medians of tokens/s, step time,
    bytes across and the last loss; the first run's first loss, traffic and
    sends."""
    stats = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
        "step_s": statistics.median(r["step_s"] for r in ok),
        "bytes_across": statistics.median(r["bytes_across"] for r in ok),
        "first_loss": ok[0]["first_loss"],
        "last_loss": statistics.median(r["last_loss"] for r in ok),
        "repeats": len(ok),
    }
    if "traffic_bytes" in ok[0]:
        stats["traffic_bytes"] = ok[0]["traffic_bytes"]
    if "sends" in ok[0]:
        stats["sends"] = ok[0]["sends"]
    if "across_formula" in ok[0]:
        stats["across_formula"] = ok[0]["across_formula"]
        if ok[0]["across_formula"]:
            stats["across_vs_formula"] = stats["bytes_across"] / ok[0]["across_formula"]
    return stats


def print_table(summary: dict, file=sys.stderr) -> None:
    """The summary, readable."""
    print(f"{'speed':<9}{'layout':<24}{'tokens/s':>10}{'step s':>9}{'MB across':>11}"
          f"{'÷ formula':>10}{'last loss':>11}{'tok/s ÷ zero3':>15}{'MB ÷ zero3':>12}",
          file=file)  # fmt: skip
    for speed, per in summary["summary"].items():
        for layout, s in per.items():
            formula = s.get("across_vs_formula")
            line = f"{speed:<9}{layout:<24}{s['tokens_per_s']:>10.0f}{s['step_s']:>9.3f}"
            line += f"{s['bytes_across'] / 1e6:>11.2f}"
            line += f"{formula:>10.3f}" if formula else f"{'-':>10}"
            line += f"{s['last_loss']:>11.5f}"
            line += f"{s.get('tokens_per_s_vs_zero3', float('nan')):>15.2f}"
            line += f"{s.get('bytes_across_vs_zero3', float('nan')):>12.2f}"
            for anchor in dict.fromkeys(COUNTERPARTS.values()):
                if f"tokens_per_s_vs_{anchor}" in s:
                    line += f"  tok/s ÷ {anchor} {s[f'tokens_per_s_vs_{anchor}']:.2f}"
            print(line, file=file)
    for layout, reason in summary["skipped"].items():
        print(f"skipped {layout}: {reason}", file=file)
    if "warning" in summary:
        print(f"WARNING: {summary['warning']}", file=file)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", help=f"comma list (default: all): {','.join(ALL_LAYOUTS)}")
    parser.add_argument("--speeds", help=f"comma list of tc rates (default: {','.join(SPEEDS)})")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (>= 1)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per (speed, layout), interleaved"
    )
    parser.add_argument("--json", help="also write every row and the summary here")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--d-model", dest="d_model", type=int)
    parser.add_argument("--n-layers", dest="n_layers", type=int)
    parser.add_argument("--n-heads", dest="n_heads", type=int)
    parser.add_argument("--seq-len", dest="seq_len", type=int)
    parser.add_argument(
        "--micro-batch", dest="micro", type=int, help="per rank (default: preset's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--data", default=str(DATA), help="a text file, read as bytes")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny GPT, 1gbit only, 1 + 3 steps, 1 repeat")  # fmt: skip
    parser.add_argument("--fresh", action="store_true",
                        help="each shardax layout in processes of its own (default: one launch "
                        "runs them all in turn, as each DeepSpeed layout runs alone)")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--summarize", metavar="FROM.json",
                        help="summarize an earlier run's rows again (to --json, or in place)")  # fmt: skip
    parser.add_argument("--worker", metavar="LAYOUT", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        # 3 timed steps: 0/1 Adam's (2..4) send fp32, 1 bit, then nothing (a local step)
        args.preset, args.steps, args.warmup, args.repeats = "tiny", 3, 1, 1
        args.speeds = args.speeds or "1gbit"
    args.speeds = args.speeds.split(",") if args.speeds else list(SPEEDS)
    args.layouts = args.layouts.split(",") if args.layouts else list(ALL_LAYOUTS)
    unknown = [m for m in args.layouts if m not in ALL_LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; layouts: {','.join(ALL_LAYOUTS)}")
    if args.micro is None:
        args.micro = MICRO_BATCH[args.preset]
    for name in ["steps", "warmup", "repeats", "micro", "threads"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('micro', 'micro-batch')} must be at least 1")
    return args


def resummarize(path: str, out: str | None) -> int:
    """The summary of an earlier run's rows, computed again (after a change
    to what the summary checks), written to ``out`` (default: ``path``)."""
    run = json.loads(Path(path).read_text())
    header = {k: v for k, v in run.items() if k not in ("runs", "summary", "skipped", "failed",
                                                         "warning")}  # fmt: skip
    layouts = [*run["layouts"], *run["skipped"]]
    summary = summarize(run["runs"], [m for m in ALL_LAYOUTS if m in layouts], run["speeds"])
    print(json.dumps(summary), flush=True)
    print_table(summary)
    Path(out or path).write_text(
        json.dumps({**header, "runs": run["runs"], **summary}, indent=2) + "\n"
    )
    return 1 if summary.get("failed") or summary.get("warning") else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        return resummarize(args.summarize, args.json)
    if args.worker:
        code = worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # torch 2.13's gloo may abort in finalization (benchmarks/train.py)
    if not Path(args.data).is_file():
        print(f"no data file {args.data}; pass --data PATH", file=sys.stderr)
        return 2
    why = unavailable()
    skipped: dict[str, str] = {}
    if importlib.util.find_spec("deepspeed") is None:  # a broken one: its rows say why
        reason = "deepspeed is not installed (pip install 'shardax[bench]')"
        skipped = {m: reason for m in args.layouts if m in DEEPSPEED}
    layouts = [m for m in args.layouts if m not in skipped]
    cfg = config_from(args)
    world = NODES * NPROC_PER_NODE
    header = {
        "benchmark": "comm",
        "preset": args.preset,
        "model": model_facts(cfg, param_count(cfg)),
        "nodes": NODES,
        "nproc_per_node": NPROC_PER_NODE,
        "micro_batch": args.micro,
        "global_batch": args.micro * world,
        "tokens_per_step": args.micro * world * cfg.seq_len,
        "threads_per_rank": args.threads,
        "speeds": args.speeds,
        "link": "EmulatedCluster: two network namespaces joined by a veth, tc tbf at each speed "
        "(burst 256kb, latency 100ms), no added delay; shm within a node, gloo across",
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "fresh": args.fresh,
        "layouts": layouts,
        "skipped": skipped,
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "torch": torch.__version__,
    }
    if why:
        header["unavailable"] = why
    print(json.dumps(header), flush=True)
    if why:
        print(f"the emulated cluster cannot run here: {why}", file=sys.stderr)
        print(json.dumps({"summary": {}, "skipped": {}, "unavailable": why}), flush=True)
        return 0
    rows = [{"layout": m, "speed": s, "repeat": 0, "skipped": reason}
            for s in args.speeds for m, reason in skipped.items()]  # fmt: skip
    for row in rows:
        print(json.dumps(row), flush=True)
    rows += run_all(layouts, args)
    summary = summarize(rows, args.layouts, args.speeds)
    print(json.dumps(summary), flush=True)
    print_table(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**header, "runs": rows, **summary}, indent=2) + "\n")
    return 1 if summary.get("failed") or summary.get("warning") or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
