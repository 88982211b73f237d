"""Tiny Hugging Face MoE models, their batches and loss, for tests/moe/."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from _tiny import SEQ, VOCAB

import shardax as sx

STEPS, BATCH = 5, 4
HYPER = (1e-2, (0.9, 0.95), 1e-4, 0.1)


def _model(family: str) -> torch.nn.Module:
    """A tiny Mixtral, or Qwen2-MoE (its shared expert dense, top-k weights
    not renormalised), 4 experts, top-2."""
    import transformers as tf

    torch.manual_seed(0)
    sizes = {
        "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": SEQ, "num_experts_per_tok": 2,
    }  # fmt: skip
    if family == "mixtral":
        return tf.MixtralForCausalLM(
            tf.MixtralConfig(**sizes, intermediate_size=24, num_local_experts=4)
        )
    config = tf.Qwen2MoeConfig(
        **sizes, num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        intermediate_size=32, norm_topk_prob=False,
    )  # fmt: skip
    return tf.Qwen2MoeForCausalLM(config)


def _loss(output, y: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
         torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip


def on_mesh(
    family: str, shape: dict[str, int], zero: int, capacity_factor: float | None = None
) -> tuple[list[float], dict, dict[str, str], list[sx.moe.ExpertLoad]]:
    """One rank of the model trained on a mesh of ``shape`` by
    ``rules.experts("ep")`` (with ``tp``: inside each expert too, and
    Megatron for the rest) and ZeRO ``zero`` over the data axes — every
    axis but ``tp`` — 5 AdamW steps, each rank its rows of each batch:
    ``(losses, gathered params, the experts' specs, each step's expert load)``."""
    mesh = sx.Mesh(shape)
    data = tuple(a for a in shape if a != "tp")  # ep ranks are data-parallel too
    n, me = mesh.size(data), mesh.axis_index(data)
    model = _model(family)
    moe = {"capacity_factor": capacity_factor, "batch": data}
    if "tp" in shape:
        # every weight matrix split over tp or whole on purpose (the router): no warning
        warnings.simplefilter("error", sx.UnshardedWeightWarning)
        rules = sx.rules.experts("ep", tp="tp", **moe) + sx.rules.megatron(
            "tp", names="auto", logits="vocab_parallel"
        )

        def loss(p, x, y):
            logits = sx.apply(model, p, x).logits  # this rank's piece of the vocabulary, marked
            return sx.vocab_parallel_cross_entropy(logits, y)

    else:
        rules = sx.rules.experts("ep", **moe)

        def loss(p, x, y):
            return _loss(sx.apply(model, p, x), y)

    params = sx.shard(sx.params_of(model), mesh, rules + sx.rules.zero(zero, data))
    specs = {k: repr(v.layout.spec) for k, v in params.items() if "experts" in k}
    lr, (b1, b2), eps, wd = HYPER
    opt = sx.optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    state = opt.init(params)
    grad_fn = sx.value_and_grad(loss)
    losses, loads = [], []
    for x, y in _batches():
        rows = slice(me * BATCH // n, (me + 1) * BATCH // n)  # each rank its rows of the batch
        with sx.moe.expert_load() as seen:
            value, grads = grad_fn(params, x[rows], y[rows])
        params, state = sx.optim.step(opt, grads, state, params)
        losses.append(value.item())
        loads.append(seen.total())
    return losses, {k: sx.gather(v) for k, v in params.items()}, specs, loads
