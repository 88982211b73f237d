"""Tiny models for the tests, built offline (random init, nothing
downloaded): the example GPT and Hugging Face GPT-2 and Llama-family models
of the same size — vocabulary 32, 8 positions, width 16, 2 layers, 4 heads
(Llama's 2 key/value heads). Keyword arguments override the config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch import nn

VOCAB, SEQ = 32, 8

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def example_gpt(**overrides: Any) -> nn.Module:
    from gpt import GPT, GPTConfig

    sizes = {"vocab_size": VOCAB, "seq_len": SEQ, "d_model": 16, "n_layers": 2, "n_heads": 4}
    return GPT(GPTConfig(**{**sizes, **overrides}))


def gpt2(**overrides: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"vocab_size": VOCAB, "n_positions": SEQ, "n_embd": 16, "n_layer": 2, "n_head": 4}
    tokens = {"bos_token_id": 0, "eos_token_id": 0}  # inside the tiny vocabulary
    return GPT2LMHeadModel(GPT2Config(**{**sizes, **tokens, **overrides}))


def llama(family: str = "llama", **overrides: Any) -> nn.Module:
    """A Llama-family model: ``family`` is llama, mistral or qwen2 (whose
    q, k and v have biases)."""
    import transformers as tf

    config_class, model_class = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[family]
    sizes = {
        "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ,
    }  # fmt: skip
    return model_class(config_class(**{**sizes, **overrides}))
