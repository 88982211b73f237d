"""``ModelShape``: what the planner needs to know of a transformer, read off
the model itself (on ``meta``): its blocks, widths, heads, vocabulary, the
matmul weights a token passes through, and from them the FLOPs and the
memory traffic of a token.

The FLOPs are counted from the weights, not from a formula typed by hand:
every ``nn.Linear``-like weight of a block (and the head) costs 2 FLOPs per
element per token forward; attention adds ``4·s·d_attn`` per layer
(``Q·Kᵀ`` and ``P·V`` over the whole sequence, as Megatron-LM counts it);
experts count ``top_k / experts`` of their weights. Backward is twice the
forward; rematerialisation adds a forward.
"""

from __future__ import annotations

from typing import Any

import attrs
from torch import nn

from ..errors import PlanError, ScheduleError

__all__ = ["ModelShape"]

# Elements an elementwise kernel reads or writes per token and layer, forward
# (norms, residual adds, the activation, q/k/v reshapes): 16 per model width
# and 2 per MLP width; backward moves twice as many. With attention scores
# materialised (no flash kernel), 6 per score (written by Q·Kᵀ, scaled,
# masked, softmaxed, read by P·V). The head: 4 per vocabulary entry (logits,
# softmax, its gradient).
WIDTH_TRAFFIC = 16
MLP_TRAFFIC = 2
SCORE_TRAFFIC = 6
VOCAB_TRAFFIC = 4

# Elements a layer keeps for backward per token (after Korthikanti et al.
# 2022, "Reducing Activation Recomputation in Large Transformer Models",
# §4.1, counted in elements rather than fp16 bytes): 9 per model width (the
# norms' inputs, q, k, v, the attention output, the MLP's input), 2 per MLP
# width (the activation's input and output) and, where attention
# materialises its scores, 2.5 per score (the softmax output, its dropout
# mask and output).
SAVED_WIDTH = 9
SAVED_MLP = 2
SAVED_SCORES = 2.5


def _positive(_: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"ModelShape.{attribute.name} is a positive integer; got {value!r}")


@attrs.frozen(kw_only=True)
class ModelShape:
    """A decoder-only transformer as the planner sees it.

    Build it from a model (:meth:`of`, on ``meta`` is enough) or by hand:

    >>> m = ModelShape(layers=24, width=2304, heads=24, mlp=9216, vocab=51200,
    ...                block_matmul=12 * 2304**2, head_matmul=51200 * 2304,
    ...                params=1_700_000_000, block_params=12 * 2304**2, blocks="h")
    >>> f"{m.flops_per_token(seq=2048) / 1e9:.2f} GFLOP"
    '11.24 GFLOP'
    """

    layers: int = attrs.field(validator=_positive)
    width: int = attrs.field(validator=_positive)  # d_model
    heads: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    head_dim: int = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    mlp: int = attrs.field(validator=_positive)  # the MLP's hidden width
    vocab: int = attrs.field(validator=_positive)
    block_matmul: int = attrs.field(validator=_positive)  # weight elements a token meets per block
    head_matmul: int = attrs.field(validator=attrs.validators.ge(0))
    params: int = attrs.field(validator=_positive)
    block_params: int = attrs.field(validator=_positive)
    blocks: str = "blocks"  # the path of the nn.ModuleList of blocks
    experts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    top_k: int = attrs.field(default=1, validator=_positive)  # experts a token meets
    expert_params: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # per block
    block_tensors: tuple[int, ...] = attrs.field(default=(), converter=tuple, kw_only=True)
    """The elements of each of a block's tensors (:meth:`of` reads them;
    by hand: ``()``, a block's matrices and norms estimated from its widths)."""
    outer_tensors: tuple[int, ...] = attrs.field(default=(), converter=tuple, kw_only=True)
    """The elements of each tensor outside the blocks (embeddings, the final
    norm, an untied head); ``()``: estimated."""

    def __attrs_post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.width // self.heads)

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    def kept_whole(self, below: int) -> tuple[int, int]:
        """The elements of one block, and outside the blocks, in tensors of
        fewer than ``below`` elements: what ZeRO-3's ``persist_below``
        keeps whole. By hand (no tensor sizes), a block's are its q, k, v
        and output projections, its MLP's two matrices and two norms'
        weights and biases; outside, the token embedding and a norm.

        >>> m = ModelShape(layers=2, width=256, heads=4, mlp=1024, vocab=512,
        ...                block_matmul=12 * 256**2, head_matmul=512 * 256,
        ...                params=1_000_000, block_params=12 * 256**2)
        >>> m.kept_whole(100_000)   # the four 256 x 256 projections and the norms
        (263168, 512)
        """
        kv = self.kv_heads * self.head_dim
        block = self.block_tensors or (
            self.width * self.attention_width, self.width * kv, self.width * kv,
            self.attention_width * self.width, self.width * self.mlp, self.mlp * self.width,
            *(self.width,) * 4,
        )  # fmt: skip
        outer = self.outer_tensors or (self.vocab * self.width, self.width, self.width)
        return sum(n for n in block if n < below), sum(n for n in outer if n < below)

    def layer_flops(self, seq: int) -> float:
        """Forward FLOPs of one block per token: its matmuls and attention."""
        return 2.0 * self.block_matmul + 4.0 * seq * self.attention_width

    def flops_per_token(self, seq: int, *, remat: bool = False) -> float:
        """FLOPs of a training step per token: forward, backward (twice the
        forward) and, with ``remat``, the forward again — the hardware
        FLOPs; the model's are ``remat=False``."""
        passes = 4.0 if remat else 3.0  # the head is never recomputed
        return passes * self.layers * self.layer_flops(seq) + 3.0 * 2.0 * self.head_matmul

    def layer_traffic(
        self, seq: int, *, flash: bool, tp: int = 1, split_width: bool = False
    ) -> float:
        """Elements elementwise kernels move per token per block, forward, on
        one of ``tp`` tensor-parallel ranks: the MLP's and the heads' share
        split, the model width's too with ``split_width`` (sequence
        parallelism), else repeated on each rank."""
        scores = 0 if flash else SCORE_TRAFFIC * self.heads * seq
        width = WIDTH_TRAFFIC * self.width / (tp if split_width else 1)
        return width + (MLP_TRAFFIC * self.mlp + scores) / tp

    def layer_saved_parts(
        self, seq: int, *, flash: bool, tp: int = 1, split_width: bool = False
    ) -> list[tuple[float, float]]:
        """:meth:`layer_saved` by kind of tensor: ``(elements per token, of
        them per tensor)`` for the model-width tensors, the MLP's and the
        attention scores (where materialised)."""
        width = self.width / (tp if split_width else 1)
        parts = [(SAVED_WIDTH * width, width), (SAVED_MLP * self.mlp / tp, self.mlp / tp)]
        if not flash:
            scores = self.heads * seq / tp
            parts.append((SAVED_SCORES * scores, scores))
        return parts

    def layer_saved(
        self, seq: int, *, flash: bool, tp: int = 1, split_width: bool = False
    ) -> float:
        """Elements a block keeps per token for its backward, on one of
        ``tp`` tensor-parallel ranks (split as :meth:`layer_traffic`)."""
        scores = 0 if flash else SAVED_SCORES * self.heads * seq
        width = SAVED_WIDTH * self.width / (tp if split_width else 1)
        return width + (SAVED_MLP * self.mlp + scores) / tp

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """Read a model's shape (its tensors may be on ``meta``): the blocks
        are its longest ``nn.ModuleList``; the width and vocabulary its
        token embedding's (the config's ``vocab_size``, else the largest embedding); the heads from its config (Hugging Face's
        ``config``, the example GPT's ``cfg``) or its attention modules.

        >>> import torch, shardax as sx
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> with torch.device("meta"):
        ...     gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
        ...                                       bos_token_id=0, eos_token_id=0))
        >>> shape = sx.plan.ModelShape.of(gpt2)
        >>> shape.layers, shape.width, shape.heads, shape.mlp, shape.vocab, shape.blocks
        (2, 64, 4, 256, 128, 'transformer.h')
        """
        from ..pipeline._stages import find_blocks

        try:
            blocks_path = find_blocks(model)
        except ScheduleError as err:
            raise PlanError(f"the planner needs a transformer's blocks: {err}") from None
        blocks = model.get_submodule(blocks_path)
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        if not embeddings:
            raise PlanError(
                f"{type(model).__name__} has no nn.Embedding: the planner reads the vocabulary "
                "and the width from the token embedding; give a ModelShape by hand"
            )
        configs = [getattr(model, "config", None), getattr(model, "cfg", None)]
        vocab = _config_int(configs, "vocab_size") or max(m.num_embeddings for m in embeddings)
        tokens = [m for m in embeddings if m.num_embeddings == vocab] or embeddings
        width = tokens[0].embedding_dim
        block = blocks[0]
        top_k = _top_k(model, block)
        matmul, expert_count = _matmul_weights(block, top_k)
        heads, kv_heads, head_dim = _attention(model, block, width)
        head = _head_matmul(model, blocks, vocab)
        return cls(
            layers=len(blocks),
            width=width,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            mlp=_mlp_width(model, block, width),
            vocab=vocab,
            block_matmul=matmul,
            head_matmul=head,
            params=sum(p.numel() for p in model.parameters()),
            block_params=sum(p.numel() for p in block.parameters()),
            blocks=blocks_path,
            experts=expert_count,
            top_k=top_k if expert_count else 1,
            expert_params=sum(p.numel() for p in block.parameters() if p.dim() == 3),
            block_tensors=tuple(p.numel() for p in block.parameters()),
            outer_tensors=tuple(
                p.numel() for name, p in model.named_parameters()
                if not name.startswith(f"{blocks_path}.")
            ),
        )  # fmt: skip


def _is_matmul(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D") and getattr(
        w, "dim", lambda: 0
    )() == 2


def _matmul_weights(block: nn.Module, top_k: int) -> tuple[int, int]:
    """Weight elements of one block a token passes through, and the experts
    of its mixture (0: dense): 3-D parameters are stacked experts, of which
    a token meets ``top_k``."""
    total, experts = 0, 0
    for module in block.modules():
        if _is_matmul(module):
            total += module.weight.numel()
    for p in block.parameters():
        if p.dim() == 3:  # [experts, out, in]
            experts = max(experts, p.shape[0])
            total += p.numel() * top_k // p.shape[0]
    return total, experts


def _top_k(model: nn.Module, block: nn.Module) -> int:
    for source in (getattr(model, "config", None), getattr(model, "cfg", None)):
        for name in ("num_experts_per_tok", "top_k"):
            k = getattr(source, name, None)
            if isinstance(k, int) and k > 0:
                return k
    for m in block.modules():
        k = getattr(m, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k
    return 1


def _config_int(sources: list[Any], *names: str) -> int | None:
    for source in sources:
        for name in names:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _attention(model: nn.Module, block: nn.Module, width: int) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) from the config or the attention modules."""
    configs = [getattr(model, "config", None), getattr(model, "cfg", None)]
    modules = list(block.modules())
    heads = _config_int(configs, "num_attention_heads", "n_head", "n_heads")
    heads = heads or _config_int(modules, "num_heads", "n_heads", "num_attention_heads")
    head_dim = _config_int(configs, "head_dim") or _config_int(modules, "head_dim")
    if heads is None and head_dim is not None:
        heads = width // head_dim
    if heads is None:
        raise PlanError(
            f"{type(model).__name__}: no head count found (config num_attention_heads / n_head "
            "/ n_heads, or an attention module's num_heads); give a ModelShape by hand"
        )
    kv = _config_int(configs, "num_key_value_heads", "n_kv_heads") or heads
    return heads, kv, head_dim or width // heads


def _mlp_width(model: nn.Module, block: nn.Module, width: int) -> int:
    configs = [getattr(model, "config", None)]
    found = _config_int(configs, "intermediate_size", "n_inner", "moe_intermediate_size")
    if found:
        return found
    cfg = getattr(model, "cfg", None)
    ratio = getattr(cfg, "mlp_ratio", None)
    if isinstance(ratio, int):
        return ratio * width
    return 4 * width  # GPT-2's default (n_inner None)


def _head_matmul(model: nn.Module, blocks: nn.Module, vocab: int) -> int:
    """The head's weight elements: a matmul outside the blocks whose output
    is the vocabulary."""
    inside = {id(m) for m in blocks.modules()}
    for module in model.modules():
        if id(module) in inside or not _is_matmul(module):
            continue
        if vocab in tuple(module.weight.shape):
            return module.weight.numel()
    return 0
