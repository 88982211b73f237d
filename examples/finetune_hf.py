"""Fine-tune a Hugging Face GPT-2-style model with shardax: ZeRO-3 over dp,
tensor parallelism over tp with the rules found from the model's own module
names, then back to a Hugging Face folder that ``from_pretrained`` loads.

    shardax launch --nproc-per-node 4 examples/finetune_hf.py             # dp=2 x tp=2
    shardax launch --nproc-per-node 2 examples/finetune_hf.py --smoke     # seconds
    shardax launch --nproc-per-node 2 examples/finetune_hf.py --model ./my-gpt2

Without ``--model`` a small GPT-2 is built from a config, offline, on the
``meta`` device, and ``sx.init_params`` initialises it straight into its
shards exactly as ``GPT2LMHeadModel(config)`` would (Hugging Face's own
``_init_weights``); it reads Tiny Shakespeare byte by byte. With ``--model
DIR`` (a local Hugging Face folder: config.json and weights), the weights
are loaded and sharded, and the folder's tokenizer is used when it has one.

The steps, as a user writes them: ``rules.zero(3) + rules.megatron("tp",
names="auto", logits="vocab_parallel")`` (the head hands back its piece of
the vocabulary, marked, for ``sx.vocab_parallel_cross_entropy``; without
``logits=`` the logits come back whole); ``sx.shard``/``sx.init_params``; a train loop of
``value_and_grad`` and ``optim.fused_step`` (buffers need no handling); a sharded
checkpoint with the model's metadata; ``ckpt.consolidate(..., hf=True)``
into ``--out/hf``; and ``AutoModelForCausalLM.from_pretrained`` on it,
whose logits rank 0 compares with the sharded model's (``sx.gather``-ed).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import shardax as sx
from shardax import P

SIZES = {  # n_embd, n_layer, n_head, seq_len, global batch, steps
    "smoke": (32, 2, 4, 32, 4, 3),
    "small": (128, 4, 4, 128, 8, 200),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a local Hugging Face folder to fine-tune")
    parser.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel size (default: 2 on an even number of ranks, else 1)",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, help="sequences per step, all ranks together")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("checkpoints/finetune_hf"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 3 steps: seconds")
    return parser.parse_args(argv)


class Windows:
    """Next-token examples over one token sequence: ``x = t[i : i + L]``,
    ``y = t[i + 1 : i + L + 1]``, every ``L`` tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return {"x": window[:-1], "y": window[1:]}


def model_and_data(args: argparse.Namespace, seq_len: int, mesh: sx.Mesh, rules: sx.Rules) -> tuple:
    """``(model on meta, its sharded params, training examples)``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config

    text = sx.data.TextDataset.tinyshakespeare(seq_len, split="train")
    if args.model is None:
        n_embd, n_layer, n_head = SIZES["smoke" if args.smoke else "small"][:3]
        config = GPT2Config(
            vocab_size=256, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        torch.manual_seed(args.seed)
        return model, sx.init_params(model, mesh, rules), text
    config = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dense = AutoModelForCausalLM.from_pretrained(args.model)  # every rank: a small model
    params = sx.shard(sx.params_of(dense), mesh, rules)
    if not any((args.model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return model, params, text  # no tokenizer in the folder: bytes
    tokens = torch.tensor(AutoTokenizer.from_pretrained(args.model)(text.text)["input_ids"])
    return model, params, Windows(tokens, seq_len)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    info = sx.init()
    world = info.world_size
    tp = args.tp or (2 if world % 2 == 0 else 1)
    if world % tp:
        raise sx.ConfigError(f"--tp {tp} does not divide the {world} ranks")
    mesh = sx.Mesh({"dp": world // tp, "tp": tp})
    say = print if info.rank == 0 else (lambda *a, **k: None)
    _, _, _, seq_len, batch, steps = SIZES["smoke" if args.smoke else "small"]
    steps, batch = args.steps or steps, args.batch_size or batch

    rules = sx.rules.zero(3, "dp") + sx.rules.megatron("tp", names="auto", logits="vocab_parallel")
    model, params, data = model_and_data(args, seq_len, mesh, rules)
    n = sum(torch.Size(x.shape).numel() for x in params.values())
    say(f"{mesh}: {type(model).__name__}, {n / 1e6:.2f}M values, ZeRO-3 over dp, Megatron over tp")

    opt = sx.optim.adamw(args.lr, weight_decay=0.1)
    opt_state = opt.init(params)

    def loss_fn(p: dict, b: dict) -> torch.Tensor:
        logits = sx.apply(model, p, b["x"]).logits  # this rank's piece of the vocabulary, marked
        return sx.vocab_parallel_cross_entropy(logits, b["y"])

    grad_fn = sx.value_and_grad(loss_fn)
    sampler = sx.data.Sampler(len(data), batch, mesh, P("dp"), seed=args.seed)
    started = time.perf_counter()
    for step, b in enumerate(sx.data.batches(data, sampler, num_steps=steps), 1):
        loss, grads = grad_fn(params, b)
        params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
        if step == 1 or step % 10 == 0 or step == steps:
            rate = step * batch * seq_len / (time.perf_counter() - started)
            say(f"step {step:4d}  loss {float(loss):.4f}  {rate:.3g} tokens/s")

    saved = sx.ckpt.save(
        args.out / "ckpt", {"params": params}, metadata=sx.ckpt.model_metadata(model)
    )
    folder = args.out / "hf"
    if info.rank == 0:
        sx.ckpt.consolidate(saved, folder, only="params", hf=True)
    sx.collectives.barrier(mesh=mesh)

    x = next(iter(sx.data.batches(data, sx.data.Sampler(len(data), 2, mesh, P(), shuffle=False))))[
        "x"
    ]
    model.eval()  # no dropout: the same function as the reloaded model's
    with torch.no_grad():
        ours = sx.gather(sx.apply(model, params, x).logits)  # the whole vocabulary's
    if info.rank == 0:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            diff = (reloaded(x).logits - ours).abs().max().item()
        say(f"saved {saved}; consolidated to {folder}")
        say(
            f"AutoModelForCausalLM.from_pretrained({str(folder)!r}): max |logit difference| {diff:.2g}"
        )
        if diff > 1e-4:
            raise SystemExit(f"the reloaded model disagrees with the trained one (max {diff:.3g})")
    sx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
