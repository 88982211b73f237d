"""The module names tensor- and sequence-parallel presets act on: :class:`TransformerNames`, the known models' names, and ``names="auto"``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import attrs

from ..errors import ShardingError
from ..shard._matching import Deferred, Rule, Rules
from ..shard._spec import P

__all__ = ["GPT2_NAMES", "GPT_NAMES", "LLAMA_NAMES", "TransformerNames", "auto"]


def _is_regex(_: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None:
        Rule(value, P())  # a clear error for a bad regex, naming it


@attrs.frozen
class TransformerNames:
    """Where a transformer's tensor-parallel roles live, as regexes over
    module paths: ``column`` — linears whose output features split over
    ``tp`` (attention q/k/v or a fused qkv laid out head-major, MLP up and
    gate); ``row`` — linears whose input features split (attention output,
    MLP down), whose partial outputs are summed; ``vocab`` — the token
    embedding, split over the vocabulary; ``head`` — the LM head, its weight
    split over the vocabulary and its logits gathered whole (or marked:
    ``rules.megatron(..., logits=)``) (a head tied to the embedding shares its
    weight and split); ``positions`` — a learned position embedding whose
    output ``[1, T, d]`` (or ``[B, T, d]``: the sequence on dim 1) is added to the token embeddings (split over the
    sequence under sequence parallelism); ``attention_in`` — the
    projections whose outputs feed attention (a head-major fused qkv, or
    q/k/v) and ``attention_out`` — the projection after it, for Ulysses'
    all-to-alls; ``regions`` — the modules that run split over ``tp``
    inside (attention, MLP), whose dropout draws differ per ``tp`` rank;
    ``attention`` — the attention modules: Llama-family ones Ulysses runs
    with :func:`shardax.ulysses_attention` (when ``attention_in``/``out``
    cannot say it: their forward reshapes by the input's length), and
    those whose ``attention_sizes`` (integer attributes counting all heads'
    features, GPT-2's ``split_size``) run divided by the axis size
    (:func:`shardax.local_sizes`), and whose
    ``scaled_dot_product_attention`` calls context parallelism runs as ring
    attention; ``column_sizes`` — the same for the
    column modules (``Conv1D``'s output width ``nf``); ``packed`` — column modules whose output
    packs q, k and v side by side (GPT-2's ``c_attn``): split block by
    block (:func:`shardax.blocks`), each rank keeping its heads of each;
    ``final`` — the module after the blocks whose output the model
    reshapes by the input's shape (GPT-2's ``ln_f``, followed by a
    ``.view``): under sequence parallelism and Ulysses the sequence is
    gathered at its output instead of at the head's input;
    ``transposed`` — the linears store ``[in, out]`` weights
    (``transformers``' ``Conv1D``), not ``nn.Linear``'s ``[out, in]``;
    ``rotary`` — the rotary position embedding module called with the
    position ids (Llama's ``model.rotary_emb``), which context parallelism
    gives the global positions of each rank's piece of the sequence (as
    ``positions``' input); ``replicated`` — modules whose parameters stay whole under tensor
    parallelism on purpose (a learned position embedding): they get an
    explicit ``P()`` rule, so :class:`shardax.UnshardedWeightWarning`,
    which names the weight matrices ``rules.megatron`` leaves whole, does
    not name them.

    >>> TransformerNames(column=r"layers\\.\\d+\\.fc1", row=r"layers\\.\\d+\\.fc2")
    TransformerNames(column='layers\\\\.\\\\d+\\\\.fc1', row='layers\\\\.\\\\d+\\\\.fc2', vocab=None, head=None, positions=None, attention_in=None, attention_out=None, regions=None, attention=None, attention_sizes=(), column_sizes=(), packed=None, final=None, transposed=False, replicated=None, rotary=None)
    """

    column: str = attrs.field(validator=_is_regex)
    row: str = attrs.field(validator=_is_regex)
    vocab: str | None = attrs.field(default=None, validator=_is_regex)
    head: str | None = attrs.field(default=None, validator=_is_regex)
    positions: str | None = attrs.field(default=None, validator=_is_regex)
    attention_in: str | None = attrs.field(default=None, validator=_is_regex)
    attention_out: str | None = attrs.field(default=None, validator=_is_regex)
    regions: str | None = attrs.field(default=None, validator=_is_regex)
    attention: str | None = attrs.field(default=None, validator=_is_regex)
    attention_sizes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    column_sizes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    packed: str | None = attrs.field(default=None, validator=_is_regex)
    final: str | None = attrs.field(default=None, validator=_is_regex)
    transposed: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    replicated: str | None = attrs.field(default=None, validator=_is_regex)
    rotary: str | None = attrs.field(default=None, validator=_is_regex)

    def __attrs_post_init__(self) -> None:
        if self.attention_sizes and self.attention is None:
            raise ShardingError(
                f"TransformerNames(attention_sizes={self.attention_sizes!r}) names attributes of "
                "the attention modules; give attention=<regex of their paths> too"
            )

    def fits(self, paths: Iterable[str]) -> bool:
        """Whether a model with these tensor paths uses these names: a
        parameter of some ``column``, some ``row`` and (when named) the
        ``vocab`` module is among them — what ``names="auto"`` checks.

        >>> GPT2_NAMES.fits(["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
        ...                  "transformer.h.0.attn.c_proj.weight"])
        True
        >>> LLAMA_NAMES.fits(["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"])
        False
        """
        paths = list(paths)
        roles = [r for r in (self.column, self.row, self.vocab) if r is not None]
        return all(any(re.fullmatch(rf"({r})\.[^.]+", p) for p in paths) for r in roles)


GPT_NAMES = TransformerNames(
    column=r"blocks\.\d+\.(attn\.qkv|mlp\.fc)",
    row=r"blocks\.\d+\.(attn\.proj|mlp\.proj)",
    vocab=r"wte",
    head=r"lm_head",
    positions=r"wpe",
    attention_in=r"blocks\.\d+\.attn\.qkv",
    attention_out=r"blocks\.\d+\.attn\.proj",
    regions=r"blocks\.\d+\.(attn|mlp)",
    attention=r"blocks\.\d+\.attn",
    replicated=r"wpe|blocks\.\d+\.mlp\.router",
)
"""The module names of the example GPT (``examples/gpt.py``, GPT-2's); its
position embedding stays whole, and so does a mixture-of-experts block's
router (its experts are ``rules.experts``')."""

LLAMA_NAMES = TransformerNames(
    column=r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(shared_expert\.)?(gate|up)_proj)",
    row=r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(shared_expert\.)?down_proj)",
    vocab=r"model\.embed_tokens",
    head=r"lm_head",
    regions=r"model\.layers\.\d+\.(self_attn|mlp)",
    attention=r"model\.layers\.\d+\.self_attn",
    replicated=r"model\.layers\.\d+\.mlp\.(gate|shared_expert_gate)",
    rotary=r"model\.rotary_emb",
)
"""Hugging Face ``transformers``' ``LlamaForCausalLM`` (and the models that
share its layout: Mistral, Qwen2): q/k/v, gate and up column-parallel, o and
down row-parallel. Key/value heads split too, so ``num_key_value_heads``
must divide by the ``tp`` size. Mixture-of-experts models of that layout
(Mixtral, Qwen2-MoE) fit too: a shared expert splits as the MLP does, the
router (``mlp.gate``, ``mlp.shared_expert_gate``) stays whole, and the
experts are left to ``rules.experts(ep, tp=...)``. With ``sequence_parallel=True`` the
sequence is gathered where attention and the MLP start (``regions``); pass
the whole sequence's ``position_ids`` and ``cache_position`` to the model,
since it would otherwise number only this rank's piece of the sequence.
``rules.ulysses`` runs its attention with :func:`shardax.ulysses_attention`
(same positions needed)."""

GPT2_NAMES = TransformerNames(
    column=r"transformer\.h\.\d+\.(attn\.c_attn|mlp\.c_fc)",
    row=r"transformer\.h\.\d+\.(attn|mlp)\.c_proj",
    vocab=r"transformer\.wte",
    head=r"lm_head",
    positions=r"transformer\.wpe",
    attention_in=r"transformer\.h\.\d+\.attn\.c_attn",
    attention_out=r"transformer\.h\.\d+\.attn\.c_proj",
    regions=r"transformer\.h\.\d+\.(attn|mlp)",
    attention=r"transformer\.h\.\d+\.attn",
    attention_sizes=("split_size",),
    column_sizes=("nf",),
    packed=r"transformer\.h\.\d+\.attn\.c_attn",
    final=r"transformer\.ln_f",
    transposed=True,
    replicated=r"transformer\.wpe",
)
"""Hugging Face ``transformers``' ``GPT2LMHeadModel``: ``Conv1D`` linears
(``[in, out]`` weights), the packed ``c_attn`` split block by block
(``P(None, blocks(3, "tp"))``: each rank its heads of q, k and v, the
weight keeping its ``[d, 3·d]`` shape), the head tied to ``wte``, ``split_size`` (and the column linears'
``nf``) divided while they run, and the position embedding ``wpe`` whole.
Pass ``use_cache=False`` when training, and with sequence parallelism or
Ulysses the whole sequence's ``position_ids``."""


_KNOWN_NAMES = {
    "GPT_NAMES": (GPT_NAMES, "examples/gpt.py"),
    "GPT2_NAMES": (GPT2_NAMES, "GPT2LMHeadModel"),
    "LLAMA_NAMES": (LLAMA_NAMES, "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
}


def _names_for(paths: tuple[str, ...]) -> TransformerNames:
    """The known names that the tensor paths of a model fit (exactly one),
    for ``names="auto"``."""
    fit = [name for name, (names, _) in _KNOWN_NAMES.items() if names.fits(paths)]
    if len(fit) == 1:
        return _KNOWN_NAMES[fit[0]][0]
    shown = ", ".join(repr(p) for p in paths[:4]) + (", ..." if len(paths) > 4 else "")
    seen = f"{len(paths)} tensors (paths such as {shown})" if paths else "a tree with no tensors"
    if fit:
        raise ShardingError(
            f"names='auto': the {seen} fit the names of {' and of '.join(fit)}; pass the right "
            f"one explicitly (names=sx.rules.{fit[0]})"
        )
    known = "; ".join(
        f"{name} ({models}; column modules such as {names.column!r})"
        for name, (names, models) in _KNOWN_NAMES.items()
    )
    raise ShardingError(
        f"names='auto' found no known module names in the {seen}; it knows {known}. Name this "
        "model's modules explicitly: names=sx.rules.TransformerNames(column=..., row=..., "
        "vocab=..., head=...), regexes over its module paths (the linears whose output features "
        "split, those whose input features split, the token embedding, the LM head)"
    )


def auto(preset: Callable[[TransformerNames], Rules], label: str) -> Rules:
    """Rules that are ``preset(names)`` for the known names the paths of
    the tree they lay out fit (a :class:`Deferred` entry)."""
    return Rules(Deferred(lambda paths: preset(_names_for(paths)), label))
