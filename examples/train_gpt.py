"""Train a small GPT on Tiny Shakespeare with shardax: an explicit,
functional train step under ZeRO-3.

    shardax launch --nproc-per-node 2 examples/train_gpt.py     # 2 CPU ranks, about 2 minutes
    python examples/train_gpt.py --steps 5                      # one process, no launcher

The model is the plain PyTorch GPT of ``examples/gpt.py``, built on the
``meta`` device; ``sx.init_params`` creates its parameters straight into
their shards (each rank holds 1/N of every tensor under ZeRO-3), with the
same values ``torch.manual_seed(seed); GPT(cfg)`` would give. Each step,
``sx.value_and_grad`` runs the model through ``sx.apply`` — which gathers a
block's parameters just before it runs and frees them after — and returns
the loss (averaged over ranks) and the gradients, reduce-scattered into
shards; the optimizer updates each rank's shards. The loop is yours.

Rank 0 prints the unigram baseline (the loss of a model that ignores
context), the loss and throughput every ``--log-every`` steps, the
validation loss at the end and a sample of generated text.

Checkpoints are sharded (``sx.ckpt``): every ``--save-every`` steps and at
the end, each rank writes its own shards of the parameters and optimizer
state, with the step and every rank's RNG state, into
``--out/step-NNNNNNNN`` — in the background, while training goes on.
``--resume`` continues from the latest one (``--resume PATH`` from that
one), bit for bit as if the run had not stopped when the number of ranks is
the same; on another number of ranks the values load all the same (each
rank reads its new shards) and ``--rng reseed`` (or ``skip``) says what
becomes of the RNG states, which cannot be split or merged. Turn one into a plain safetensors file of the weights with

    shardax ckpt consolidate checkpoints/train_gpt/step-00000300 gpt.safetensors --only params

A run config (``--config run.hjson``, see ``docs/config.md``; ``shardax
config from-deepspeed ds_config.json`` converts a DeepSpeed one) sets the
mesh, ZeRO stage, optimizer, schedule, precision (fp16 with dynamic loss
scaling too), batch sizes with gradient accumulation, checkpointing and
logging; flags given on the command line override it. Without one, the
flags make the config.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import GPT, PRESETS, generate, param_count

import shardax as sx
from shardax import P

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


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over ``[B, T]`` targets (computed in fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def evaluate(logits_of: Callable, params: dict, batches: list[dict], mesh: sx.Mesh) -> float:
    """Mean loss on ``batches`` (each rank its own), averaged over the dp axis."""
    with torch.no_grad():
        total = sum(cross_entropy(logits_of(params, b["x"]), b["y"]) for b in batches)
    return float(sx.collectives.pmean(total / len(batches), "dp", mesh=mesh))


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; every option with its default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    parser.add_argument("--config", type=Path, help="a run config (hjson); flags override it")
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
        default="restore",
        help="on --resume, each rank's RNG state: as saved (the same number of ranks: the run "
        "continues bit for bit), reseed (restored where the rank count matches, else seeded "
        "from the checkpoint and the rank) or skip",
    )
    parser.add_argument(
        "--metrics", type=Path, help="append each step's loss and lr as JSON lines (rank 0)"
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
}


def run_config(args: argparse.Namespace, given: set[str]) -> sx.config.RunConfig:
    """The run: the flags' own config, or ``--config``'s with the flags
    given on the command line written over it."""
    if args.config is None:
        data: dict = {
            "optimizer": {"betas": [0.9, 0.95], "momentum": 0.9 if args.optimizer == "sgd" else 0},
            "schedule": {"type": "warmup_cosine", "end_lr": args.lr / 10},
            "batch": {"accumulation": 1},
        }
        flags = CONFIG_FLAGS
    else:
        data = sx.config.load_config(args.config).to_dict()
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
    if args.tp > 1:
        if mesh.get("tp", args.tp) != args.tp:
            raise sx.config.ConfigError(f"--tp {args.tp} but the mesh says tp={mesh['tp']}")
        mesh["tp"] = args.tp
    if mesh.get("tp", 1) != 1 and not parallel.get("tp"):  # an axis named tp: tensor parallelism
        parallel["tp"] = "tp"
    if args.sp:
        parallel["sequence_parallel"] = True
    data["mesh"] = mesh
    return sx.config.RunConfig.from_dict(data, str(args.config or "the command line"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    probe = build_parser()
    probe.set_defaults(**dict.fromkeys(vars(args)))
    args.given = {k for k, v in vars(probe.parse_args(argv)).items() if v is not None}
    if args.steps < 1 or args.batch_size < 1 or args.log_every < 1 or args.eval_batches < 0:
        parser.error("--steps, --batch-size and --log-every must be positive")
    if args.save_every < 0 or args.keep < 1:
        parser.error("--save-every must be >= 0 and --keep >= 1")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    if args.warmup is None:
        args.warmup = min(30, args.steps // 10)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps={args.steps})")
    try:
        args.run = run_config(args, args.given)
    except sx.config.ConfigError as err:
        parser.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run = args.run
    info = sx.init()
    mesh = sx.Mesh(run.mesh)
    rank = info.rank

    def say(*lines: object) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    cfg = PRESETS[args.preset]
    batch = run.batch.resolve(run.dp_size(info.world_size))
    steps, accumulation = run.steps, batch.accumulation
    train = sx.data.TextDataset.tinyshakespeare(cfg.seq_len, split="train")
    val = sx.data.TextDataset.tinyshakespeare(cfg.seq_len, split="val")
    micro_global = batch.global_size // accumulation  # sequences per micro-step, all ranks
    sampler = sx.data.Sampler(len(train), micro_global, mesh, P("dp"), seed=run.seed)
    precision = run.precision.params
    say(
        f"{mesh} on {info.world_size} rank(s); GPT {args.preset}: "
        f"{param_count(cfg) / 1e6:.2f}M params; ZeRO-{run.parallel.zero}, {run.optimizer.type}, "
        f"{precision}, global batch {batch.global_size} x {cfg.seq_len} tokens"
        + (f" in {accumulation} micro-steps" if accumulation > 1 else "")
        + (f"; tensor parallel over {run.parallel.tp}" if run.parallel.tp else "")
        + (" with sequence parallelism" if run.parallel.sequence_parallel else ""),
        f"unigram baseline (a model that ignores context): {train.unigram_entropy():.3f} nats/byte",
    )

    if precision == "fp16" and info.device.type == "cpu":
        say(
            "warning: fp16 on CPU has no fast matmul kernels (about 3.5x slower than fp32 on "
            "the 2-core test host); bf16 is the CPU half precision (--precision bf16)"
        )
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(run.seed)
    params = sx.init_params(model, mesh, run.make_rules())
    schedule = run.make_schedule()
    opt = run.make_optimizer(accumulation)
    dtype = DTYPES[precision]
    if dtype != torch.float32:  # compute in bf16/fp16; fp32 master weights in the optimizer state
        params = {k: v.with_local(v.local.to(dtype)) for k, v in params.items()}
    loss_scale = run.make_loss_scale()  # fp16: dynamic loss scaling
    opt_state = opt.init(params)

    ckpt = run.checkpoint
    manager = sx.ckpt.CheckpointManager(
        ckpt.dir, every=ckpt.every or steps, keep=ckpt.keep, async_save=ckpt.async_save
    )
    meta = {"preset": args.preset, "config": attrs.asdict(cfg), "seed": run.seed}
    meta.update(sx.ckpt.model_metadata(model))  # tied names: the consolidated file loads strictly
    start = 0
    if args.resume:
        target = {"params": params, "opt_state": opt_state, "step": 0}
        latest = args.resume is True
        where = manager.path(manager.latest() or 0) if latest else args.resume
        try:
            if latest:
                restored = manager.restore(target, rng=args.rng)
            else:
                state = sx.ckpt.load(args.resume, target, rng=args.rng)
                restored = int(state["step"]), state
        except sx.CheckpointError as err:
            if "rng='restore'" not in str(err):
                raise
            raise sx.CheckpointError(f"{err} (the flags: --rng reseed or --rng skip)") from None
        if restored is None:
            say(f"no checkpoint in {ckpt.dir}: starting from step 0")
        else:
            start, state = restored
            params, opt_state = state["params"], state["opt_state"]
            say(f"resumed from {where} at step {start} (rng: {args.rng})")
    metrics = open(args.metrics, "a") if args.metrics and rank == 0 else None  # noqa: SIM115

    tp = run.parallel.tp  # tensor parallelism: the head's logits are this rank's vocabulary piece

    def loss_fn(params: dict, batch: dict, scale: float) -> torch.Tensor:
        logits = sx.apply(model, params, batch["x"])
        if tp is not None:
            return (
                sx.vocab_parallel_cross_entropy(logits.float(), batch["y"], tp, mesh=mesh) * scale
            )
        return cross_entropy(logits, batch["y"]) * scale

    def logits_of(params: dict, x: torch.Tensor, rules: sx.Rules | None = None) -> torch.Tensor:
        """The whole vocabulary's logits (gathered over tp)."""
        logits = sx.apply(model, params, x, rules=rules)
        return logits if tp is None else sx.collectives.all_gather(logits, tp, -1, mesh=mesh)

    grad_fn = sx.value_and_grad(loss_fn, bucket_bytes=run.parallel.bucket_bytes)
    tokens_per_step = batch.global_size * cfg.seq_len
    monitor = sx.monitor.Monitor.from_config(
        run.monitor,
        mesh=mesh,
        samples_per_step=batch.global_size,
        tokens_per_step=tokens_per_step,
        flops_per_token=sx.monitor.transformer_flops_per_token(
            param_count(cfg), cfg.n_layers, cfg.seq_len, cfg.d_model
        ),
        total_steps=steps,
    )
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
        with monitor.step(step):
            for micro in itertools.islice(micro_steps, accumulation):
                scale = loss_scale.scale if loss_scale is not None else 1.0
                loss, grads = grad_fn(params, micro, scale)
                loss = loss / scale
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
                        # update + apply, in one native pass where the optimizer has one
                        params, opt_state = sx.optim.step(opt, grads, opt_state, params)
            monitor.log(loss=loss, lr=schedule(step - 1))
            if loss_scale is not None:
                monitor.log(loss_scale=loss_scale.scale)
        state = {"params": params, "opt_state": opt_state, "step": step}
        manager.save(step, state, metadata=meta, force=step == steps)
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "loss": float(loss), "lr": schedule(step - 1)}))
            metrics.write("\n")
            metrics.flush()
    monitor.close()
    elapsed = time.perf_counter() - started
    if metrics is not None:
        metrics.close()

    val_sampler = sx.data.Sampler(len(val), micro_global, mesh, P("dp"), shuffle=False)
    val_batches = list(sx.data.batches(val, val_sampler, num_steps=args.eval_batches))
    val_loss = evaluate(logits_of, params, val_batches, mesh) if val_batches else float("nan")
    say(f"val loss {val_loss:.4f} after {steps} steps in {elapsed:.0f} s")

    manager.wait()
    if manager.latest() is not None:
        say(f"saved {manager.path(manager.latest())}")

    if args.sample_tokens > 0:
        prompt = sx.data.TextDataset.encode(args.prompt)[None]
        # Prompts grow one token at a time: sequence parallelism, which splits the
        # sequence over tp, gives way to plain tensor parallelism (same parameters).
        plain = sx.rules.megatron(tp) if tp is not None and run.parallel.sequence_parallel else None
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
