"""Tiny Hugging Face MoE models, their batches and loss, for tests/moe/."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _tiny import SEQ, VOCAB

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
