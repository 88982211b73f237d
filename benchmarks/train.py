"""Training: shardax ZeRO 0–3 against DDP, FSDP2 and DeepSpeed, side by side.

One invocation trains the same GPT (``examples/gpt.py``) on the same
tinyshakespeare bytes, from the same seed, with the same AdamW (lr 3e-4,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter, fp32),
once per mode:

- ``limit``: no communication at all — each rank trains its own replica
  with the same step (``torch.optim.AdamW``): the compute-only limit that
  every row's ``of_limit`` is a fraction of;
- ``ddp``: ``DistributedDataParallel`` over gloo;
- ``fsdp2``: ``fully_shard`` on every block, then on the root (a CPU
  ``DeviceMesh``);
- ``fsdp2-script``: ``benchmarks/fsdp2_script.py``, a plain FSDP2 script as
  its users write it (``torch.optim.AdamW``'s defaults but the learning
  rate, the loop timed whole, no shardax imported, only
  ``OMP_NUM_THREADS`` set): the check that the ``fsdp2`` anchor is not a
  slow baseline (its first loss agrees; later ones differ with the
  optimizer's defaults);
- ``deepspeed0`` … ``deepspeed3``: DeepSpeed's ZeRO stages on its CPU
  accelerator (``DS_ACCELERATOR=cpu``), with the same ``torch.optim.AdamW``
  as a client optimizer; skipped, with the reason, when ``import deepspeed``
  fails. ``pip install 'shardax[bench]'`` pins a DeepSpeed known to work
  here; it needs neither intel_extension_for_pytorch nor oneCCL: without
  ``oneccl_bindings_for_pytorch`` its CPU accelerator talks gloo, over the
  group the ranks already made. Its first run JIT-builds (g++, ninja) a
  shared-memory op DeepSpeed uses only for inference, about 30 s, untimed;
- ``shardax0`` … ``shardax3``: ``sx.rules.zero(stage)``, parameters
  initialised shard by shard from a ``meta`` model, ``sx.value_and_grad``
  and ``sx.optim.adamw``;
- ``shardax-tp``, ``shardax-tp-sp``: ``sx.rules.megatron`` over every rank
  (``tp`` = ``--nproc``), without and with sequence parallelism; the ranks
  share one global batch (the same tokens per step as the other modes) and
  the head hands back its marked piece of the vocabulary (``logits=
  "vocab_parallel"``) to ``sx.vocab_parallel_cross_entropy``;
  ``shardax-tp-whole``: the same with the default head, whose logits are
  gathered whole on every rank for a plain ``F.cross_entropy`` (one more
  all-gather, and the whole logits' memory). These rows also carry
  the communication of one step (``sx.collectives.traffic()``, by op) and
  check it against Megatron's formula: per layer and step, 4 all-reduces of
  ``b·s·h`` (2 forward, 2 backward), which sequence parallelism replaces by
  all-gathers and reduce-scatters moving the same bytes; the embedding adds
  2 more, and sequence parallelism's head gather 2. On CPU, tensor
  parallelism is not expected to be faster;
- ``shardax-ulysses``: ``sx.rules.ulysses`` over every rank (``sp`` =
  ``--nproc``): the shared global batch split over the sequence, all-to-alls
  around attention, the sequence gathered where the head starts and a plain
  loss on the whole logits;
- ``shardax3-unchecked``, ``shardax3-gloo``, ``shardax3-gloo-unchecked``:
  ``shardax3`` without the collectives' signature check
  (``SHARDAX_CHECK_COLLECTIVES=0``), on gloo instead of shared memory
  (``SHARDAX_BACKEND=torch``), and both: the summary's
  ``collective_check_cost`` is the step time the check costs on each
  backend (unchecked tokens/s over checked, minus 1);
- ``fsdp2-glibc``: ``fsdp2`` with glibc's own malloc settings (no
  ``MALLOC_MMAP_THRESHOLD_``), as a plain script runs: what the allocator
  setting every other mode gets is worth to FSDP2.

Every (mode, repeat) runs in fresh rank processes started by ``shardax
launch`` (peak RSS is a lifetime maximum), each with the same environment —
``OMP_NUM_THREADS`` and glibc's ``MALLOC_MMAP_THRESHOLD_`` (4 MiB, the
setting ``sx.init()`` otherwise makes for shardax's modes alone) — , and modes are interleaved across
repeats (A B C, A B C, …) because the host is noisy. Each run builds the
model, takes ``--warmup`` untimed steps, then times ``--steps`` steps, each
between two barriers. It prints one JSON line per run: global tokens/s,
median step time, peak RSS per rank and every step's loss (warm-up steps
first). A last JSON line summarises each mode (medians over repeats) and its
ratios against ``fsdp2`` and, when present, ``deepspeed3`` and
``deepspeed2``: a tokens/s ratio above 1 is faster than the anchor, a peak
RSS ratio below 1 uses less memory. As a sanity check, every mode's first
loss (same weights, same batch) must agree to 1e-4; the summary warns when
they do not. A readable table goes to stderr.

    python benchmarks/train.py --preset bench --repeats 3 --json train.json
    python benchmarks/train.py --preset wide --modes fsdp2,deepspeed3,shardax3 --steps 5
    python benchmarks/train.py --smoke        # tiny model, 2 steps: well under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from _data import (  # noqa: E402  (beside this file)
    MICRO_BATCH,
    batch,
    interleaved,
    launch_run,
    load_tokens,
    model_facts,
    peak_rss_mib,
    threads_per_rank,
    timed_steps,
)
from gpt import GPT, PRESETS, GPTConfig, param_count  # noqa: E402

import shardax as sx  # noqa: E402

DATA = ROOT / "examples" / "data" / "tinyshakespeare.txt"
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
# Modes that run another mode's step in another environment: the cost of the
# collectives' signature check (docs/failure_modes.md), on shm and on gloo.
# A None value removes the variable (``fsdp2-glibc``: glibc's own malloc
# settings, as a plain FSDP2 script runs).
VARIANTS: dict[str, tuple[str, dict[str, str | None]]] = {
    "shardax3-unchecked": ("shardax3", {"SHARDAX_CHECK_COLLECTIVES": "0"}),
    "shardax3-gloo": ("shardax3", {"SHARDAX_BACKEND": "torch"}),
    "shardax3-gloo-unchecked": (
        "shardax3",
        {"SHARDAX_BACKEND": "torch", "SHARDAX_CHECK_COLLECTIVES": "0"},
    ),
    "fsdp2-glibc": ("fsdp2", {"MALLOC_MMAP_THRESHOLD_": None}),
}
MEMORY_MODES: dict[str, dict[str, bool]] = {
    "shardax3-remat": {"remat": True},
    "shardax3-offload": {"offload": True},
    "shardax3-remat-offload": {"remat": True, "offload": True},
    "shardax3-remat-offload-params": {"remat": True, "offload": True, "params": True},
    "shardax3-offload-all": {"offload": True, "params": True, "grads": True},
}
"""ZeRO-3 with the blocks rematerialised (``rules.remat``), the optimizer
state on disk (``rules.offload``), both, the parameters' shards on disk too,
and parameters, gradients and state on disk (``benchmarks/memory.py``)."""
DEEPSPEED_OFFLOAD = {"deepspeed3-offload-cpu": "cpu", "deepspeed3-offload-nvme": "nvme"}
"""DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` to that device."""
SCRIPT = Path(__file__).resolve().parent / "fsdp2_script.py"
ALL_MODES = [
    "limit",
    "ddp",
    "fsdp2",
    "fsdp2-script",
    *(f"deepspeed{s}" for s in range(4)),
    *(f"shardax{s}" for s in range(4)),
    "shardax-tp",
    "shardax-tp-sp",
    "shardax-tp-whole",
    "shardax-ulysses",
    *VARIANTS,
    *MEMORY_MODES,
    *DEEPSPEED_OFFLOAD,
]
ANCHORS = ["fsdp2", "deepspeed3", "deepspeed2", "shardax3"]
TENSOR_PARALLEL = ("shardax-tp", "shardax-tp-sp", "shardax-tp-whole")
LOSS_TOLERANCE = 1e-4
TIMEOUT_S = 300.0

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""One optimizer step on this rank's micro-batch ``(x, y)``; returns the loss."""


# ---------------------------------------------------------------- the modes


def _torch_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def _dense_model(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def setup_ddp(cfg: GPTConfig, seed: int) -> Step:
    """PyTorch ``DistributedDataParallel``: replicated parameters, all-reduced gradients."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_dense_model(cfg, seed))
    return _torch_step(model, _torch_adamw(model.parameters()))


def setup_limit(cfg: GPTConfig, seed: int) -> Step:
    """The compute-only limit: the same model, batch and ``torch.optim.AdamW``
    step with no communication at all — each rank trains its own replica.
    No data-parallel mode can be faster; each row's ``of_limit`` is its
    fraction of this one."""
    model = _dense_model(cfg, seed)
    return _torch_step(model, _torch_adamw(model.parameters()))


def setup_fsdp2(cfg: GPTConfig, seed: int) -> Step:
    """PyTorch FSDP2: ``fully_shard`` on each block, then on the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _dense_model(cfg, seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _torch_step(model, _torch_adamw(model.parameters()))


def setup_deepspeed(
    stage: int, cfg: GPTConfig, seed: int, micro_batch: int, offload: str | None = None
) -> Step:
    """DeepSpeed ZeRO ``stage`` (0–3) in fp32, with ``torch.optim.AdamW`` as its client
    optimizer; ``offload``: its optimizer state and parameters on ``"cpu"`` or ``"nvme"``
    (files in a temporary folder)."""
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = _dense_model(cfg, seed)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
    }
    if offload is not None:
        where = {"device": offload}
        if offload == "nvme":
            where["nvme_path"] = offload_dir()
        config["zero_optimization"].update(offload_optimizer=where, offload_param=dict(where))
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=_torch_adamw(model.parameters()), config=config
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _shardax_step(
    cfg: GPTConfig,
    seed: int,
    mesh: sx.Mesh,
    rules: sx.Rules,
    loss: Callable[..., torch.Tensor],
    opt: Any = None,
    unreduced: tuple[str, ...] = (),
) -> Step:
    """The shardax train step: ``init_params`` from a meta model under
    ``rules``, ``value_and_grad`` of ``loss(logits, y)``, ``optim.adamw``
    (or ``opt``; gradients left partial over ``unreduced``, for the 1-bit
    optimizers)."""
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(seed)
    params = sx.init_params(model, mesh, rules)
    if opt is None:
        opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    opt_state = opt.init(params)

    def loss_fn(params, batch):
        return loss(sx.apply(model, params, batch["x"], rules=rules), batch["y"])

    grad_fn = sx.value_and_grad(loss_fn, unreduced=unreduced)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal params, opt_state
        value, grads = grad_fn(params, {"x": x, "y": y})
        # update and apply in place, in one pass where the kernels cover it (ZeRO-3)
        params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
        del grads
        return value.detach()

    return step


def offload_dir() -> str:
    """This rank's folder for state on disk: ``$SHARDAX_BENCH_OFFLOAD_DIR`` (a
    local disk, not tmpfs) or the temporary folder."""
    root = os.environ.get("SHARDAX_BENCH_OFFLOAD_DIR") or tempfile.gettempdir()
    return tempfile.mkdtemp(prefix=f"shardax-offload-{dist.get_rank()}-", dir=root)


def setup_memory(
    cfg: GPTConfig,
    seed: int,
    remat: bool = False,
    offload: bool = False,
    params: bool = False,
    grads: bool = False,
) -> Step:
    """shardax ZeRO-3 with ``rules.remat`` over the blocks and/or
    ``rules.offload`` of the optimizer state (and the parameters' shards, the
    gradients) to disk."""
    rules = sx.rules.zero(3, axis="dp")
    if remat:
        rules += sx.rules.remat(r"blocks\.\d+")
    if offload:
        roles = ("params",) * params + ("grads",) * grads + ("opt_state",)
        rules += sx.rules.offload(roles, "disk", path=offload_dir())
    return _shardax_step(cfg, seed, sx.Mesh({"dp": -1}), rules, _loss)


def setup_shardax(stage: int, cfg: GPTConfig, seed: int) -> Step:
    """shardax ZeRO ``stage`` (0–3): ``rules.zero``, ``init_params`` from a meta model,
    ``value_and_grad``, ``optim.adamw``."""
    return _shardax_step(cfg, seed, sx.Mesh({"dp": -1}), sx.rules.zero(stage, axis="dp"), _loss)


def setup_tensor_parallel(
    cfg: GPTConfig, seed: int, sequence_parallel: bool, whole: bool = False
) -> Step:
    """shardax ``rules.megatron`` over all ranks (``tp``): the vocab-parallel
    loss on the head's marked piece, or (``whole``) a plain loss on the
    whole logits the default head gathers."""
    mesh = sx.Mesh({"tp": -1})
    logits = "gather" if whole else "vocab_parallel"
    rules = sx.rules.megatron("tp", sequence_parallel=sequence_parallel, logits=logits)
    if whole:
        return _shardax_step(cfg, seed, mesh, rules, _loss)

    def loss(logits: sx.Sharded, y: torch.Tensor) -> torch.Tensor:
        return sx.vocab_parallel_cross_entropy(logits, y)

    return _shardax_step(cfg, seed, mesh, rules, loss)


def setup_ulysses(cfg: GPTConfig, seed: int) -> Step:
    """shardax ``rules.ulysses`` over all ranks (``sp``): the whole sequence's
    logits on every rank (gathered where the head starts), a plain loss."""
    return _shardax_step(cfg, seed, sx.Mesh({"sp": -1}), sx.rules.ulysses("sp"), _loss)


def megatron_check(traffic: Any, cfg: GPTConfig, tokens: int, world: int, sp: bool) -> dict:
    """One step's activation collectives over ``tp`` (buffers of ``b·s·h``
    elements) against Megatron's count and bytes."""
    size = tokens * cfg.d_model * 4  # b·s·h, fp32
    if sp:
        calls = traffic.count("all_gather", ("tp",), size) + traffic.count(
            "psum_scatter", ("tp",), size
        )
        wire = calls * (world - 1) / world * size
        expected_calls = 8 * cfg.n_layers + 4  # + the embedding's and the head's pairs
    else:
        calls = traffic.count("psum", ("tp",), size)
        wire = calls * 2 * (world - 1) / world * size
        expected_calls = 4 * cfg.n_layers + 2  # + the embedding's all-reduce and its transpose
    # an all-gather plus a reduce-scatter move the bytes of one all-reduce
    expected_wire = (4 * cfg.n_layers + 2) * 2 * (world - 1) / world * size
    return {
        "activation_calls": calls,
        "activation_wire_bytes": wire,
        "expected_calls": expected_calls,
        "expected_wire_bytes": expected_wire,
        "matches": calls == expected_calls and abs(wire - expected_wire) <= 1e-9 * expected_wire,
    }


def setup(mode: str, cfg: GPTConfig, seed: int, micro_batch: int) -> Step:
    """Build ``mode``'s model and optimizer on this rank; return its step."""
    if mode == "ddp":
        return setup_ddp(cfg, seed)
    if mode == "limit":
        return setup_limit(cfg, seed)
    if mode == "fsdp2":
        return setup_fsdp2(cfg, seed)
    if mode in DEEPSPEED_OFFLOAD:
        return setup_deepspeed(3, cfg, seed, micro_batch, DEEPSPEED_OFFLOAD[mode])
    if mode.startswith("deepspeed"):
        return setup_deepspeed(int(mode[-1]), cfg, seed, micro_batch)
    if mode in MEMORY_MODES:
        return setup_memory(cfg, seed, **MEMORY_MODES[mode])
    if mode in TENSOR_PARALLEL:
        return setup_tensor_parallel(
            cfg, seed, sequence_parallel=mode.endswith("-sp"), whole=mode.endswith("-whole")
        )
    if mode == "shardax-ulysses":
        return setup_ulysses(cfg, seed)
    if mode.startswith("shardax"):
        return setup_shardax(int(mode[-1]), cfg, seed)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(ALL_MODES)}")


def unavailable(modes: Sequence[str]) -> dict[str, str]:
    """The modes among ``modes`` that cannot run here, each with a one-line reason."""
    reasons: dict[str, str] = {}
    if any(m.startswith("deepspeed") for m in modes):
        reason = _deepspeed_missing()
        if reason:
            reasons.update({m: reason for m in modes if m.startswith("deepspeed")})
        elif "deepspeed3-offload-nvme" in modes and (aio := _deepspeed_aio_missing()):
            reasons["deepspeed3-offload-nvme"] = aio
    missing = [
        name
        for owner, name in [
            (sx, "init_params"),
            (sx, "apply"),
            (sx, "value_and_grad"),
            (sx.rules, "zero"),
            (getattr(sx, "optim", None), "adamw"),
            (getattr(sx, "optim", None), "step"),
        ]
        if not hasattr(owner, name)
    ]
    if missing:
        reason = f"this shardax has no {', '.join(missing)} yet"
        reasons.update({m: reason for m in modes if m.startswith("shardax")})
    return reasons


def _deepspeed_missing() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'shardax[bench]')"
    done = subprocess.run(
        [sys.executable, "-c", "import deepspeed"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        return f"import deepspeed failed: {lines[-1]}"
    return None


def _deepspeed_aio_missing() -> str | None:
    """Why DeepSpeed's NVMe offload cannot start here (its ``async_io`` op
    needs the system's libaio, headers and library), or None."""
    probe = (
        "from deepspeed.ops.op_builder import AsyncIOBuilder\n"
        "import sys\nsys.exit(0 if AsyncIOBuilder().is_compatible(verbose=False) else 3)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode == 0:
        return None
    return (
        "DeepSpeed's NVMe offload needs its async_io op, which needs the system libaio "
        "(libaio-dev: headers and library; pip cannot install it): AsyncIOBuilder is not "
        "compatible here"
    )


# ---------------------------------------------------------------- one run, on every rank


CGROUP_ROOTS = (
    ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
    ("/sys/fs/cgroup", "memory.max"),
)
CGROUP_PREFIX = "shardax-bench-"


def confine(limit_mib: int) -> None:
    """Put this process in a memory cgroup of its own capped at ``limit_mib``
    (cgroup v1 or v2): past it, the kernel reclaims the page cache and then
    kills the process, as a job's memory limit does."""
    for root, limit in CGROUP_ROOTS:
        if os.path.isfile(os.path.join(root, "cgroup.procs")) and os.access(root, os.W_OK):
            group = os.path.join(root, f"{CGROUP_PREFIX}{os.getpid()}")
            os.makedirs(group, exist_ok=True)
            Path(group, limit).write_text(str(limit_mib * 2**20))
            Path(group, "cgroup.procs").write_text(str(os.getpid()))
            return
    raise RuntimeError(
        "--memory-limit-mib needs a writable memory cgroup (/sys/fs/cgroup/memory or a cgroup v2 "
        "/sys/fs/cgroup with the memory controller): run as root, or in a container that "
        "delegates one"
    )


def unconfine() -> None:
    """Remove the memory cgroups of runs that are over."""
    for root, _ in CGROUP_ROOTS:
        for group in Path(root).glob(f"{CGROUP_PREFIX}*") if os.path.isdir(root) else ():
            with contextlib.suppress(OSError):  # a process still in it
                group.rmdir()


def worker(args: argparse.Namespace) -> int:
    """One rank of one run: build, warm up, time; rank 0 writes the result."""
    if args.memory_limit_mib:
        confine(args.memory_limit_mib)
    torch.set_num_threads(args.threads)
    mode = args.worker
    if mode.startswith("shardax"):
        sx.init(timeout=TIMEOUT_S)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = peak_rss_mib()
    cfg = config_from(args)
    tokens = load_tokens(Path(args.data), cfg.vocab_size)
    tensor_parallel = mode in TENSOR_PARALLEL
    shared = tensor_parallel or mode == "shardax-ulysses"  # the ranks split one batch's model work
    batch_at = partial(
        batch,
        tokens,
        seed=args.seed,
        seq_len=cfg.seq_len,
        micro_batch=args.micro,
        shared=shared,
    )
    started = time.perf_counter()
    step = setup(VARIANTS.get(mode, (mode, {}))[0], cfg, args.seed, args.micro)
    build_s = time.perf_counter() - started
    losses = [step(*batch_at(i)) for i in range(args.warmup - 1)]
    with sx.collectives.traffic() as traffic:  # the last warm-up step's communication
        if args.warmup:
            losses.append(step(*batch_at(args.warmup - 1)))
    timed, seconds = timed_steps(step, lambda i: batch_at(args.warmup + i), 0, args.steps)
    losses += timed  # the slowest rank's seconds of each timed step
    loss = torch.stack(losses).double()
    dist.all_reduce(loss)  # the global loss: the mean of the ranks' (shardax's is already global)
    loss /= world
    rss = [None] * world
    dist.all_gather_object(rss, (rss_start, peak_rss_mib()))
    if rank == 0:
        tokens_per_step = args.micro * world * cfg.seq_len
        result = {
            "tokens_per_s": tokens_per_step * args.steps / float(seconds.sum()),
            "step_s": statistics.median(seconds.tolist()),
            "step_s_all": seconds.tolist(),
            "build_s": build_s,
            "peak_rss_mib": max(peak for _, peak in rss),
            "peak_rss_mib_per_rank": [peak for _, peak in rss],
            "start_rss_mib_per_rank": [start for start, _ in rss],
            "losses": loss.tolist(),
        }
        if mode.startswith("shardax"):
            result["comm_per_step"] = traffic.summary()
        if tensor_parallel:
            tokens_global = args.micro * world * cfg.seq_len
            result["megatron"] = megatron_check(
                traffic, cfg, tokens_global, world, sp=mode.endswith("-sp")
            )
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the driver


def config_from(args: argparse.Namespace) -> GPTConfig:
    """The preset with the command line's size overrides."""
    return PRESETS[args.preset].replace(
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        vocab_size=args.vocab,
        seq_len=args.seq_len,
    )


def run_once(mode: str, repeat: int, args: argparse.Namespace) -> dict:
    """Launch one run of ``mode`` on fresh ranks; its JSON row."""
    row: dict = {"mode": mode, "repeat": repeat}
    with tempfile.TemporaryDirectory(prefix="shardax-train-bench-") as tmp:
        result = Path(tmp) / "result.json"
        plain = mode == "fsdp2-script"
        argv = [sys.executable, str(SCRIPT if plain else Path(__file__).resolve())]
        argv += [] if plain else ["--worker", mode, "--threads", str(args.threads)]
        argv += ["--result", str(result), "--data", args.data]
        argv += ["--preset", args.preset, "--micro-batch", str(args.micro)]
        argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
        if args.memory_limit_mib and not plain:
            argv += ["--memory-limit-mib", str(args.memory_limit_mib)]
        for flag in ["d_model", "n_layers", "n_heads", "vocab", "seq_len"]:
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        if not plain:  # the plain script gets what torchrun would give it
            env["DS_ACCELERATOR"] = "cpu"
            # The allocator setting sx.init() makes (tune_allocator: blocks from 4 MiB up
            # straight from mmap), given to every mode: the anchors run with it too.
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))
            for name, value in VARIANTS.get(mode, (mode, {}))[1].items():
                if value is None:
                    env.pop(name, None)
                else:
                    env[name] = value
        launch_run(argv, env, args, result, row)
        if args.memory_limit_mib:
            unconfine()
            if "error" in row:
                row["error"] += f" (under a memory limit of {args.memory_limit_mib} MiB per rank)"
    return row


def summarize(rows: list[dict], modes: Sequence[str], skipped: dict[str, str]) -> dict:
    """Per mode, medians over repeats, ratios against the anchors, and the loss check."""
    per_mode: dict[str, dict] = {}
    for mode in modes:
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        if not ok:
            continue
        per_mode[mode] = medians(ok)
        if "megatron" in ok[0]:
            per_mode[mode]["megatron"] = ok[0]["megatron"]
    for stats in per_mode.values():
        if "limit" in per_mode:  # the fraction of the compute-only limit
            stats["of_limit"] = stats["tokens_per_s"] / per_mode["limit"]["tokens_per_s"]
        add_ratios(stats, per_mode, ANCHORS)
    summary: dict = {"summary": per_mode, "skipped": skipped}
    costs = {}  # the signature check's share of a step, per backend
    pairs = [("shardax3", "shardax3-unchecked"), ("shardax3-gloo", "shardax3-gloo-unchecked")]
    for checked, unchecked in pairs:
        if checked in per_mode and unchecked in per_mode:
            ratio = per_mode[unchecked]["tokens_per_s"] / per_mode[checked]["tokens_per_s"]
            costs[checked] = {"step_time_cost": ratio - 1.0}
    if costs:
        summary["collective_check_cost"] = costs
    if "fsdp2" in per_mode and "fsdp2-script" in per_mode:  # is the anchor a slow baseline?
        summary["fsdp2_vs_plain_script"] = (
            per_mode["fsdp2"]["tokens_per_s"] / per_mode["fsdp2-script"]["tokens_per_s"]
        )
    failed = sorted({r["mode"] for r in rows if "error" in r})
    if failed:
        summary["failed"] = failed
    firsts = {m: s["first_loss"] for m, s in per_mode.items()}
    if firsts:
        spread = max(firsts.values()) - min(firsts.values())
        summary["first_loss_spread"] = spread
        if spread > LOSS_TOLERANCE:
            summary["warning"] = (
                f"first-step losses disagree by {spread:.2e} (> {LOSS_TOLERANCE:g}) although "
                f"every mode starts from the same weights and batch: {firsts}"
            )
    return summary


def medians(ok: list[dict]) -> dict:
    """One mode's successful runs summed up: medians of tokens/s, step time,
    peak RSS and the last loss, the first run's first loss, the count."""
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
        "step_s": statistics.median(r["step_s"] for r in ok),
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in ok),
        "first_loss": ok[0]["losses"][0],
        "last_loss": statistics.median(r["losses"][-1] for r in ok),
        "repeats": len(ok),
    }


def add_ratios(stats: dict, per_mode: dict[str, dict], anchors: Sequence[str]) -> None:
    """``stats``' tokens/s and peak RSS over each anchor's that ran."""
    for anchor in anchors:
        if anchor in per_mode:
            base = per_mode[anchor]
            stats[f"tokens_per_s_vs_{anchor}"] = stats["tokens_per_s"] / base["tokens_per_s"]
            stats[f"peak_rss_vs_{anchor}"] = stats["peak_rss_mib"] / base["peak_rss_mib"]


def print_table(summary: dict, file=sys.stderr) -> None:
    """The summary, readable."""
    anchors = [a for a in ANCHORS if a in summary["summary"]]
    short = {"fsdp2": "fsdp2", "deepspeed3": "ds3", "deepspeed2": "ds2", "shardax3": "sx3"}
    head = f"{'mode':<24}{'tokens/s':>10}{'step ms':>9}{'peak MiB':>10}{'first loss':>12}"
    head += f"{'of limit':>10}" if "limit" in summary["summary"] else ""
    head += "".join(f"{'tok/s/' + short[a]:>13}{'rss/' + short[a]:>11}" for a in anchors)
    print(head, file=file)
    for mode, s in summary["summary"].items():
        line = f"{mode:<24}{s['tokens_per_s']:>10.0f}{s['step_s'] * 1e3:>9.1f}"
        line += f"{s['peak_rss_mib']:>10.0f}{s['first_loss']:>12.5f}"
        line += f"{s['of_limit']:>10.2f}" if "of_limit" in s else ""
        for a in anchors:
            line += f"{s[f'tokens_per_s_vs_{a}']:>13.2f}{s[f'peak_rss_vs_{a}']:>11.2f}"
        print(line, file=file)
    for mode, reason in summary["skipped"].items():
        print(f"skipped {mode}: {reason}", file=file)
    if "warning" in summary:
        print(f"WARNING: {summary['warning']}", file=file)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--modes", help=f"comma list (default: all available): {','.join(ALL_MODES)}"
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    parser.add_argument("--json", help="also write every row and the summary here")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--d-model", dest="d_model", type=int)
    parser.add_argument("--n-layers", dest="n_layers", type=int)
    parser.add_argument("--n-heads", dest="n_heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq-len", dest="seq_len", type=int)
    parser.add_argument(
        "--micro-batch", dest="micro", type=int, help="per rank (default: preset's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--memory-limit-mib",
        type=int,
        help="run each rank in a memory cgroup capped at this many MiB (needs a writable one)",
    )
    parser.add_argument("--data", default=str(DATA), help="a text file, read as bytes")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, 1 repeat")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.steps, args.repeats, args.nproc = "tiny", 2, 1, 2
        if args.modes is None:
            args.modes = ",".join(m for m in ALL_MODES if not m.startswith("deepspeed"))
    if args.micro is None:
        args.micro = MICRO_BATCH[args.preset]
    if args.threads is None:
        args.threads = threads_per_rank(args.nproc)
    for name in ["nproc", "steps", "repeats", "micro", "threads"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('micro', 'micro-batch')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def main(argv: Sequence[str] | None = None, benchmark: str = "train") -> int:
    args = parse_args(argv)
    if args.worker:
        code = worker(args)
        # torch 2.13's gloo sometimes aborts in interpreter finalization ("terminate called
        # without an active exception", a few runs in a hundred, with or without
        # destroy_process_group): the run is over and its result written, so skip finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    requested = args.modes.split(",") if args.modes else ALL_MODES
    unknown = [m for m in requested if m not in ALL_MODES]
    if unknown:
        print(f"unknown mode(s) {unknown}; modes: {','.join(ALL_MODES)}", file=sys.stderr)
        return 2
    if not Path(args.data).is_file():
        print(f"no data file {args.data}; pass --data PATH", file=sys.stderr)
        return 2
    cfg = config_from(args)
    skipped = unavailable(requested)
    modes = [m for m in requested if m not in skipped]
    header = {
        "benchmark": benchmark,
        "preset": args.preset,
        "model": model_facts(cfg, param_count(cfg)),
        "nproc": args.nproc,
        "micro_batch": args.micro,
        "global_batch": args.micro * args.nproc,
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "modes": modes,
        "skipped": skipped,
    }
    print(json.dumps(header), flush=True)
    for mode, reason in skipped.items():
        print(f"skipping {mode}: {reason}", file=sys.stderr, flush=True)
    rows = interleaved(modes, args.repeats, partial(run_once, args=args))
    summary = summarize(rows, modes, skipped)
    print(json.dumps(summary), flush=True)
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({**header, "runs": rows, **summary}, indent=2))
    return 1 if summary.get("failed") or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
