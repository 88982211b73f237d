"""Sharding rules, and the namespace where parallelism presets live.

A rule maps key paths (``"blocks.3.attn.qkv.weight"``) to a spec; rule sets
compose with ``+``, first match wins. Presets are functions that return
:class:`Rules`, nothing more: ``zero`` splits params, grads and optimizer
state over the data axes with :class:`ShardOver` entries.

>>> import shardax as sx
>>> rules = sx.rules.Rule(r".*\\.weight", sx.P("dp")) + sx.rules.Rule(".*", sx.P())
>>> rules.match("mlp.bias").spec
P()
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Literal

import attrs

from .errors import ShardingError
from .shard._modules import ModuleRule as ModuleRule
from .shard._modules import Relayout as Relayout
from .shard._placement import ShardOver as ShardOver
from .shard._matching import Deferred
from .shard._matching import Rule as Rule
from .shard._matching import Rules as Rules
from .shard._spec import P, blocks
from .shard._tensor_parallel import local_sizes, ulysses_attention, vocab_parallel_embedding

__all__ = [
    "GPT2_NAMES",
    "GPT_NAMES",
    "LLAMA_NAMES",
    "ModuleRule",
    "Relayout",
    "Rule",
    "Rules",
    "ShardOver",
    "TransformerNames",
    "megatron",
    "ulysses",
    "zero",
]

_STAGES = {
    0: (),
    1: ("opt_state",),
    2: ("grads", "opt_state"),
    3: ("params", "grads", "opt_state"),
}


def zero(stage: int, axis: str | Iterable[str] = "dp") -> Rules:
    """ZeRO (Rajbhandari et al., 2020) as rules: stage 1 splits the optimizer
    state over ``axis``, stage 2 also the gradients (reduced with
    ``psum_scatter``, never a full replicated gradient), stage 3 also the
    parameters (gathered module by module in :func:`shardax.apply`). Stage 0
    is plain data parallelism. Compose with rules on other axes with ``+``.

    >>> import shardax as sx
    >>> sx.rules.zero(2)
    Rules(ShardOver('dp', roles=('grads', 'opt_state')))
    >>> rules = sx.rules.zero(3)
    >>> mesh = sx.AbstractMesh({"dp": 4})
    >>> [rules.spec_for("w", (8, 3), mesh, role) for role in ("params", "compute")]
    [P('dp'), P()]
    """
    if isinstance(stage, bool) or stage not in _STAGES:
        raise ShardingError(f"ZeRO stage is 0, 1, 2 or 3; got {stage!r}")
    roles = _STAGES[stage]
    return Rules(ShardOver(axis, roles=roles)) if roles else Rules()


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
    embedding, split over the vocabulary; ``head`` — the LM head, its logits
    split over the vocabulary (a head tied to the embedding shares its
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
    (:func:`shardax.local_sizes`); ``column_sizes`` — the same for the
    column modules (``Conv1D``'s output width ``nf``); ``packed`` — column modules whose output
    packs q, k and v side by side (GPT-2's ``c_attn``): split block by
    block (:func:`shardax.blocks`), each rank keeping its heads of each;
    ``final`` — the module after the blocks whose output the model
    reshapes by the input's shape (GPT-2's ``ln_f``, followed by a
    ``.view``): under sequence parallelism and Ulysses the sequence is
    gathered at its output instead of at the head's input;
    ``transposed`` — the linears store ``[in, out]`` weights
    (``transformers``' ``Conv1D``), not ``nn.Linear``'s ``[out, in]``;
    ``replicated`` — modules whose parameters stay whole under tensor
    parallelism on purpose (a learned position embedding): they get an
    explicit ``P()`` rule, so :class:`shardax.UnshardedWeightWarning`,
    which names the weight matrices ``rules.megatron`` leaves whole, does
    not name them.

    >>> TransformerNames(column=r"layers\\.\\d+\\.fc1", row=r"layers\\.\\d+\\.fc2")
    TransformerNames(column='layers\\\\.\\\\d+\\\\.fc1', row='layers\\\\.\\\\d+\\\\.fc2', vocab=None, head=None, positions=None, attention_in=None, attention_out=None, regions=None, attention=None, attention_sizes=(), column_sizes=(), packed=None, final=None, transposed=False, replicated=None)
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
    replicated=r"wpe",
)
"""The module names of the example GPT (``examples/gpt.py``, GPT-2's); its
position embedding stays whole."""

LLAMA_NAMES = TransformerNames(
    column=r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)",
    row=r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)",
    vocab=r"model\.embed_tokens",
    head=r"lm_head",
    regions=r"model\.layers\.\d+\.(self_attn|mlp)",
    attention=r"model\.layers\.\d+\.self_attn",
)
"""Hugging Face ``transformers``' ``LlamaForCausalLM`` (and the models that
share its layout: Mistral, Qwen2): q/k/v, gate and up column-parallel, o and
down row-parallel. Key/value heads split too, so ``num_key_value_heads``
must divide by the ``tp`` size. With ``sequence_parallel=True`` the
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


def _auto(preset: Callable[[TransformerNames], Rules], label: str) -> Rules:
    """Rules that are ``preset(names)`` for the known names the paths of
    the tree they lay out fit (a :class:`Deferred` entry)."""
    return Rules(Deferred(lambda paths: preset(_names_for(paths)), label))


def megatron(
    tp: str = "tp",
    *,
    sequence_parallel: bool = False,
    names: TransformerNames | Literal["auto"] = GPT_NAMES,
) -> Rules:
    """Megatron-LM's tensor parallelism (Shoeybi et al., 2019, "Megatron-LM:
    Training Multi-Billion Parameter Language Models Using Model
    Parallelism") as rules over the axis ``tp``:

    ==============  ==================  ==============  ====================
    module          weight              bias            output
    ==============  ==================  ==============  ====================
    column          ``P(tp, None)``     ``P(tp)``       split on features
    row             ``P(None, tp)``     added once      ``psum`` over tp
    vocab (embed)   ``P(tp, None)``     —               ``psum`` over tp
    head            ``P(tp, None)``     ``P(tp)``       split on vocabulary
    ==============  ==================  ==============  ====================

    Everything else (norms, position embeddings) stays replicated. Dropout
    inside the ``regions`` (attention, MLP) draws differently on each ``tp``
    rank up to the row-parallel output, elsewhere identically (seed every
    rank alike, or with :func:`shardax.manual_seed` varying over the data
    axes only). Two all-reduces per block forward (after attention and
    after the MLP) and their transposes in backward — Megatron's four.
    Attention must take its head count from the width it is given (``qkv``
    laid out head-major, see ``examples/gpt.py``; or ``names.packed`` and
    ``attention_sizes``, as for GPT-2); the loss of split logits is
    :func:`shardax.vocab_parallel_cross_entropy`. Split dims must divide
    evenly. ``names.transposed`` (``Conv1D``'s ``[in, out]`` weights) swaps
    the column and row weights' specs. Compose with ``rules.zero(stage,
    "dp")`` for dp × tp.

    ``names="auto"`` picks the names by the parameter paths when the rules
    meet them (``shard``, ``init_params``, ``explain``): :data:`GPT_NAMES`,
    :data:`GPT2_NAMES` or :data:`LLAMA_NAMES` (also Mistral's and Qwen2's),
    whichever :meth:`TransformerNames.fits` them — the same rules as passing
    those names; none or two fitting is an error naming some of the paths.
    The rules split every weight matrix over ``tp``: laying out a model
    whose 2-D ``.weight`` they leave whole (names that missed a module)
    warns with their paths (:class:`shardax.UnshardedWeightWarning`; an
    error with ``strict``), except those in ``names.replicated`` or an
    explicit rule of yours such as ``Rule(r"extra\\.weight", P()) +
    megatron(...)``.

    ``sequence_parallel`` (Korthikanti et al., 2022, "Reducing Activation
    Recomputation in Large Transformer Models"): between the tensor-parallel
    regions — norms, residual adds, dropout — activations ``[B, T, d]`` are
    split over ``tp`` on the sequence, so each rank holds ``1/tp`` of them:
    the input of each region (attention, MLP; without ``regions`` names, of
    each column-parallel linear) is all-gathered over the sequence, a row-parallel
    (or embedding) output reduce-scattered onto it instead of all-reduced —
    the same bytes on the wire, a fraction of the activation memory. The
    position embedding's output is split to match, and the head gathers the
    sequence back. Every dropout draws differently per ``tp`` rank (each
    holds other positions or other heads). ``T`` must divide by the ``tp``
    size.

    >>> import shardax as sx
    >>> rules = sx.rules.megatron("tp")
    >>> mesh = sx.AbstractMesh({"tp": 2})
    >>> [rules.spec_for(p, (8, 4), mesh) for p in ("blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight")]
    [P('tp', None), P(None, 'tp')]
    >>> rules.match("blocks.0.mlp.proj.bias").partial
    ('tp',)
    >>> auto = sx.rules.megatron("tp", names="auto")
    >>> paths = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
    ...          "model.layers.0.self_attn.o_proj.weight", "lm_head.weight"]
    >>> auto.resolve(paths).match("model.layers.0.self_attn.o_proj.weight").spec
    P(None, 'tp')
    """
    if isinstance(names, str) and names == "auto":
        sp = ", sequence_parallel=True" if sequence_parallel else ""
        return _auto(
            lambda n: megatron(tp, sequence_parallel=sequence_parallel, names=n),
            f"megatron({tp!r}{sp}, names='auto')",
        )
    if not isinstance(names, TransformerNames):
        raise ShardingError(f"names is a TransformerNames or 'auto'; got {names!r}")
    col, row = names.column, names.row
    seq = P(None, tp)  # [B, T, d] split on the sequence
    between = seq if sequence_parallel else P()  # activations outside the tp regions
    gather = [Relayout(seq, P())] if sequence_parallel else []
    # With sequence parallelism the sequence is gathered where a region (attention,
    # MLP) starts — it may read the sequence length before its first linear — or,
    # without region names, at each column-parallel linear.
    gather_at_regions = bool(gather) and names.regions is not None
    col_w, row_w = (P(None, tp), P(tp, None)) if names.transposed else (P(tp, None), P(None, tp))
    entries: list[Rule | ModuleRule] = []
    if names.packed is not None:  # [q | k | v]: each block split over tp, the shape kept
        dim = 1 if names.transposed else 0
        entries += [
            Rule(rf"({names.packed})\.weight", P(*[None] * dim, blocks(3, tp))),
            Rule(rf"({names.packed})\.bias", P(blocks(3, tp))),
        ]
    entries += [
        Rule(rf"({col})\.weight", col_w),
        Rule(rf"({col})\.bias", P(tp)),
        Rule(rf"({row})\.weight", row_w),
        Rule(rf"({row})\.bias", P(), partial=tp),
        # Without sequence parallelism the summed output is a replica: dropout
        # after it (GPT-2's, inside its region) draws from the shared stream.
        ModuleRule(row, output=Relayout(P(), between, partial=tp), rejoin=not sequence_parallel),
    ]
    if gather and not gather_at_regions:
        entries.append(ModuleRule(col, inputs=gather))
    if names.vocab is not None:
        entries.append(Rule(rf"({names.vocab})\.weight", P(tp, None)))
        entries.append(
            ModuleRule(
                names.vocab,
                forward=vocab_parallel_embedding(tp),
                output=Relayout(P(), between, partial=tp),
            )
        )
    if names.head is not None:
        entries.append(Rule(rf"({names.head})\.weight", P(tp, None)))
        entries.append(Rule(rf"({names.head})\.bias", P(tp)))
    if names.replicated is not None:  # whole on purpose: no UnshardedWeightWarning
        entries.append(Rule(rf"({names.replicated})\.[^.]+", P()))
    if gather and names.final is not None:
        entries.append(ModuleRule(names.final, output=gather[0]))
    elif gather and names.head is not None:
        entries.append(ModuleRule(names.head, inputs=gather))
    if names.positions is not None and sequence_parallel:
        entries.append(ModuleRule(names.positions, output=Relayout(P(), seq)))
    if names.regions is not None:
        entries.append(
            ModuleRule(names.regions, rng=tp, inputs=gather if gather_at_regions else ())
        )
    if names.attention_sizes:
        entries.append(ModuleRule(names.attention, forward=local_sizes(tp, *names.attention_sizes)))
    if names.column_sizes:
        entries.append(ModuleRule(col, forward=local_sizes(tp, *names.column_sizes)))
    if sequence_parallel:  # every activation is split: every draw differs per tp rank
        entries.append(ModuleRule("", rng=tp))
    return Rules(*entries, divisible=True, tensor_parallel=tp)


def ulysses(sp: str = "sp", *, names: TransformerNames | Literal["auto"] = GPT_NAMES) -> Rules:
    """DeepSpeed-Ulysses sequence parallelism (Jacobs et al., 2023,
    "DeepSpeed Ulysses: System Optimizations for Enabling Training of
    Extreme Long Sequence Transformer Models") as rules over the axis ``sp``.

    Activations ``[B, T, d]`` are split over ``sp`` on the sequence from the
    embeddings on; parameters stay whole (compose ``rules.zero(stage, "dp")``
    to shard them over data axes). Around attention, one all-to-all turns
    the sequence split into a head split — each rank attends over the whole
    sequence for ``1/sp`` of the heads, so causal masks and
    ``scaled_dot_product_attention`` work unchanged — and one turns it back:

    ==================  =========================  ===========================
    boundary            arrives                    leaves
    ==================  =========================  ===========================
    token embedding     ``P()`` (every position)   ``P(None, sp)``: sliced
    position embedding  ``P()``                    ``P(None, sp)``: sliced
    ``attention_in``    out ``P(None, sp)``        ``P(None, None, sp)``: heads
    ``attention_out``   in ``P(None, None, sp)``   ``P(None, sp)``: sequence
    ==================  =========================  ===========================

    The logits come back split over the sequence: take this rank's piece of
    the targets the same way (``y.chunk(size, dim=1)[index]``), and
    :func:`shardax.value_and_grad` averages the ranks' losses — except with
    ``names.final`` (GPT-2), where the sequence is gathered after the final
    norm and every rank computes the whole sequence's logits and loss. The head
    count and the sequence length must divide by the ``sp`` size; the
    attention projections' features must be laid out head-major, or packed
    (``names.packed``: each of q, k and v split over heads, with
    ``attention_sizes`` divided while attention runs, as for GPT-2). Every
    dropout draws differently per ``sp`` rank: each holds other positions
    or other heads. ``names="auto"`` picks the names by the parameter paths,
    as for :func:`megatron`.

    >>> import shardax as sx
    >>> rules = sx.rules.ulysses("sp")
    >>> len(rules.modules), rules.modules[2].output
    (5, Relayout(P(None, 'sp'), P(None, None, 'sp')))
    >>> sx.rules.ulysses("sp", names="auto")
    Rules(ulysses('sp', names='auto'))
    """
    if isinstance(names, str) and names == "auto":
        return _auto(lambda n: ulysses(sp, names=n), f"ulysses({sp!r}, names='auto')")
    if not isinstance(names, TransformerNames):
        raise ShardingError(f"names is a TransformerNames or 'auto'; got {names!r}")
    relayouts = names.attention_in is not None and names.attention_out is not None
    if not relayouts and names.attention is None:
        raise ShardingError(
            "rules.ulysses needs names.attention_in and names.attention_out (the projections "
            "around attention: the all-to-alls go there), or names.attention (Llama-family "
            "modules, run by shardax.ulysses_attention)"
        )
    seq = P(None, sp)
    entries: list[ModuleRule] = []
    if names.vocab is not None:
        entries.append(ModuleRule(names.vocab, output=Relayout(P(), seq)))
    if names.positions is not None:
        entries.append(ModuleRule(names.positions, output=Relayout(P(), seq)))
    if relayouts:
        if names.packed is not None:  # [q | k | v] each split over heads
            heads = Relayout(seq, P(None, None, blocks(3, sp)))
            entries.append(ModuleRule(names.packed, output=heads))
        entries += [
            ModuleRule(names.attention_in, output=Relayout(seq, P(None, None, sp))),
            ModuleRule(names.attention_out, inputs=[Relayout(P(None, None, sp), seq)]),
        ]
        if names.attention_sizes:
            sizes = local_sizes(sp, *names.attention_sizes)
            entries.append(ModuleRule(names.attention, forward=sizes))
    else:
        entries.append(ModuleRule(names.attention, forward=ulysses_attention(sp)))
    if names.final is not None:  # the model reshapes by the input's shape after it
        entries.append(ModuleRule(names.final, output=Relayout(seq, P())))
    entries.append(ModuleRule("", rng=sp))  # pieces of the sequence draw differently
    return Rules(*entries)
