"""A small GPT in plain PyTorch: the model the training example and the
training benchmark share.

GPT-2's shape (Radford et al., 2019): token and learned position
embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a
final LayerNorm and a language-model head tied to the token embedding. It
is deliberately ordinary:

- every parameter is created and initialised by the constructors of
  ``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm`` (their own
  ``reset_parameters``; no custom init pass), so ``torch.manual_seed(s);
  GPT(cfg)`` *is* the dense reference initialisation;
- no dropout and no registered buffers, so the model can be built on the
  ``meta`` device and its parameters created shard by shard;
- the head's weight *is* the embedding's (``lm_head.weight is
  wte.weight``), so ``named_parameters`` lists it once, as ``wte.weight``.

>>> import torch
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> cfg = PRESETS["tiny"]
>>> model = GPT(cfg)
>>> model(torch.zeros(2, 5, dtype=torch.long)).shape
torch.Size([2, 5, 256])
>>> param_count(cfg) == sum(p.numel() for p in model.parameters())
True
>>> "lm_head.weight" in dict(model.named_parameters())
False
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "MLP",
    "MoE",
    "Experts",
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "generate",
    "param_count",
]


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class GPTConfig:
    """The shape of a :class:`GPT`.

    Args:
        vocab_size: Number of token ids (256 for raw bytes).
        seq_len: Longest context, the number of learned positions.
        d_model: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads; must divide ``d_model``.
        mlp_ratio: MLP hidden width over ``d_model``.
        tie_embeddings: Whether the LM head reuses the token embedding.
        experts: 0 — a dense MLP in every block; else a mixture of that many
            SwiGLU experts (:class:`MoE`), each ``mlp_ratio · d_model / 2``
            wide, so that top-2 costs about 1.5 dense MLPs per token.
        top_k: Experts per token.
        capacity_factor: Each expert takes ``capacity_factor · tokens · k /
            experts`` of a batch's (token, choice) pairs, the rest dropped
            (the residual carries them); None: dropless.
        router_aux_loss: Weight of the Switch/GShard load-balancing loss,
            added to the gradient (not to the reported loss).

    >>> GPTConfig(vocab_size=256, seq_len=64, d_model=60, n_layers=2, n_heads=8)
    Traceback (most recent call last):
    ...
    ValueError: GPTConfig: n_heads=8 does not divide d_model=60; pick a d_model that is a multiple of n_heads
    """

    vocab_size: int = attrs.field(validator=_positive)
    seq_len: int = attrs.field(validator=_positive)
    d_model: int = attrs.field(validator=_positive)
    n_layers: int = attrs.field(validator=_positive)
    n_heads: int = attrs.field(validator=_positive)
    mlp_ratio: int = attrs.field(default=4, validator=_positive)
    tie_embeddings: bool = True
    experts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    top_k: int = attrs.field(default=2, validator=_positive)
    capacity_factor: float | None = None
    router_aux_loss: float = 0.01

    def __attrs_post_init__(self) -> None:
        if self.experts and self.top_k > self.experts:
            raise ValueError(
                f"GPTConfig: top_k={self.top_k} is more than experts={self.experts}; "
                "choose top_k <= experts"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"GPTConfig: capacity_factor must be > 0 (or None: dropless); "
                f"got {self.capacity_factor!r}"
            )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                "pick a d_model that is a multiple of n_heads"
            )

    def replace(self, **changes: object) -> GPTConfig:
        """A copy with some fields changed (``None`` values are ignored).

        >>> PRESETS["tiny"].replace(n_layers=4, d_model=None).n_layers
        4
        """
        return attrs.evolve(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, GPTConfig] = {
    # for tests and --smoke: a forward/backward takes milliseconds
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4),
    # the README's main job: byte-level, trains on 2 CPU ranks in about two minutes
    "small": GPTConfig(vocab_size=256, seq_len=128, d_model=192, n_layers=4, n_heads=6),
    # the training benchmark: about 23M parameters
    "bench": GPTConfig(vocab_size=8192, seq_len=256, d_model=512, n_layers=6, n_heads=8),
    # memory benchmark: about 134M parameters, most of them in the embedding
    "wide": GPTConfig(vocab_size=32768, seq_len=64, d_model=1024, n_layers=8, n_heads=16),
}
"""Named configurations: ``tiny``, ``small``, ``bench`` and ``wide``."""


def small() -> GPT:
    """The README's model (``PRESETS["small"]``), e.g. for ``shardax config
    check run.hjson --model examples/gpt.py:small``."""
    return GPT(PRESETS["small"])


def param_count(cfg: GPTConfig, *, active: bool = False) -> int:
    """Number of distinct parameters of ``GPT(cfg)`` (a tied head counted
    once); ``active``: those one token runs through (its ``top_k`` experts
    of each mixture, not all of them), for FLOPs.

    >>> moe = PRESETS["tiny"].replace(experts=8)
    >>> param_count(moe) > param_count(moe, active=True) > param_count(PRESETS["tiny"])
    True

    >>> param_count(PRESETS["bench"]) / 1e6, param_count(PRESETS["wide"]) / 1e6
    (23.240704, 134.391808)
    """
    d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    layer_norms = 2 * 2 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)  # qkv, proj
    mlp = (d * hidden + hidden) + (hidden * d + d)  # fc, proj
    if cfg.experts:  # router, then each expert's gate, up and down
        used = cfg.top_k if active else cfg.experts
        mlp = d * cfg.experts + used * 3 * d * (hidden // 2)
    block = layer_norms + attention + mlp
    embeddings = (cfg.vocab_size + cfg.seq_len) * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return embeddings + cfg.n_layers * block + 2 * d + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused ``qkv`` projection, scaled
    dot-product attention with a causal mask, an output ``proj``.

    ``qkv``'s output features are laid out head-major — ``[head, (q, k, v),
    head_dim]``, as Megatron-LM lays them out — and the head count is read
    from the width ``qkv`` returns (and the sequence length from its
    output): split ``qkv`` by rows over a tensor-parallel axis and each rank
    runs whole heads of its own (``rules.megatron``, with or without
    sequence parallelism), with no change here."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, T, d_model]`` → ``[B, T, d_model]``."""
        qkv = self.qkv(x)
        b, t, _ = qkv.shape  # its input may be a piece of the sequence, gathered by qkv
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).unbind(3)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """``fc`` → GELU → ``proj``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, T, d_model]`` → ``[B, T, d_model]``."""
        return self.proj(F.gelu(self.fc(x)))


class Experts(nn.Module):
    """``experts`` SwiGLU MLPs, their weights stacked as Hugging Face's
    Mixtral stores them — ``gate_up_proj`` ``[E, 2f, d]`` (gate rows first)
    and ``down_proj`` ``[E, d, f]`` — and run as two batched matmuls over
    the tokens laid out by expert (:func:`shardax.moe.dispatch`): no loop
    over experts. Called with the hidden states and each token's chosen
    experts and weights, as Mixtral's experts module is, so
    ``rules.experts("ep")`` splits it over ranks unchanged. Each expert
    starts as ``nn.Linear`` would (uniform within ``1/sqrt(fan_in)``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model // 2
        self.num_experts, self.capacity_factor = cfg.experts, cfg.capacity_factor
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.experts, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(cfg.experts, d, f))
        self.act_fn = F.silu
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init, expert by expert."""
        for w in (self.gate_up_proj, self.down_proj):
            bound = w.shape[-1] ** -0.5
            nn.init.uniform_(w, -bound, bound)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` ``[..., d]``, the choices ``[tokens, k]`` → ``[..., d]``."""
        from shardax import moe  # pure tensor functions: no mesh, no collective here

        x = hidden.reshape(-1, hidden.shape[-1])
        routing = moe.Routing(top_k_index, top_k_weights, torch.empty(0))
        buffer, plan = moe.dispatch(
            x, routing, capacity_factor=self.capacity_factor, num_experts=self.num_experts,
            layout="rows",
        )  # fmt: skip
        y = moe.swiglu_experts(
            buffer, self.gate_up_proj, self.down_proj, self.act_fn, offsets=plan.offsets
        )
        return moe.combine(y, plan).view_as(hidden)


class _AuxLoss(torch.autograd.Function):
    """``y`` unchanged forward; backward, the auxiliary loss's gradient too."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_ones(ctx.aux_shape)


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: a linear ``router``
    (softmax over experts, the top ``k`` kept and renormalised, as Mixtral)
    and :class:`Experts`. In training, the load-balancing loss
    (:func:`shardax.moe.load_balancing_loss` of this call's tokens, times
    ``router_aux_loss``) joins the gradient without changing the loss the
    model reports — as GShard, per group of tokens: under data parallelism,
    per rank."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k, self.aux_weight = cfg.top_k, cfg.router_aux_loss
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, T, d_model]`` → ``[B, T, d_model]``."""
        from shardax import moe

        routing = moe.route(self.router(x).flatten(0, -2), self.top_k)
        y = self.experts(x, routing.experts, routing.weights)
        if self.aux_weight and torch.is_grad_enabled():
            y = _AuxLoss.apply(y, self.aux_weight * moe.load_balancing_loss(routing))
        return y


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then
    ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, T, d_model]`` → ``[B, T, d_model]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model.

    Args:
        cfg: Its shape (see :data:`PRESETS`).

    Parameter names are GPT-2's: ``wte``, ``wpe``, ``blocks.{i}.ln_1``,
    ``blocks.{i}.attn.qkv``, ``blocks.{i}.attn.proj``, ``blocks.{i}.ln_2``,
    ``blocks.{i}.mlp.fc``, ``blocks.{i}.mlp.proj``, ``ln_f`` and, untied,
    ``lm_head``; with experts, ``blocks.{i}.mlp.router`` and
    ``blocks.{i}.mlp.experts.gate_up_proj`` / ``.down_proj`` (Mixtral's).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        if cfg.tie_embeddings:
            # Its own weight would be replaced at once: create it on meta, so it
            # neither allocates nor draws from the random generator.
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.wte.weight
        else:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits.

        Args:
            idx: Token ids, ``LongTensor[B, T]`` with ``T <= cfg.seq_len``.

        Returns:
            Logits ``[B, T, vocab_size]``.
        """
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(
                f"GPT: sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}; "
                "crop the context (generate(..., context=seq_len) does)"
            )
        pos = torch.arange(t, device=idx.device).unsqueeze(0)  # [1, T]: positions on dim 1
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.cfg.tie_embeddings:  # T5's rescaling: logits of unit scale from a N(0, 1) embedding
            x = x * self.cfg.d_model**-0.5
        return self.lm_head(x)


@torch.no_grad()
def generate(
    model_call: Callable[[torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    n: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    *,
    context: int | None = None,
) -> torch.Tensor:
    """Sample ``n`` tokens after ``idx``, one at a time.

    ``model_call`` maps token ids ``[B, T]`` to logits ``[B, T, vocab]``:
    the module itself, or ``lambda idx: sx.apply(model, params, idx)`` for
    sharded parameters. Every call has the same batch size and, once the
    context is full, the same length, so ranks that sample in step with the
    same ``generator`` seed stay in step (ZeRO-3 gathers follow calls).

    Args:
        model_call: Token ids → logits.
        idx: The prompt, ``LongTensor[B, T]`` (``T >= 1``).
        n: Number of tokens to sample.
        temperature: Divides the logits; lower is greedier. Must be > 0.
        top_k: Sample only among the ``top_k`` most likely tokens.
        generator: The random generator to sample with.
        context: Feed only the last ``context`` tokens (the model's
            ``seq_len``); ``None`` feeds all.

    Returns:
        ``LongTensor[B, T + n]``: the prompt followed by the samples.

    >>> _ = torch.manual_seed(0)
    >>> model = GPT(PRESETS["tiny"])
    >>> out = generate(model, torch.zeros(1, 1, dtype=torch.long), 70, top_k=5, context=64)
    >>> out.shape
    torch.Size([1, 71])
    """
    if not temperature > 0:
        raise ValueError(f"generate: temperature must be > 0, got {temperature!r}")
    for _ in range(n):
        window = idx if context is None else idx[:, -context:]
        logits = model_call(window)[:, -1, :].float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
