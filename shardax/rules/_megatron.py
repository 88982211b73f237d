"""Megatron-LM tensor (and sequence) parallelism as rules."""

from __future__ import annotations

from typing import Literal

from ..errors import ShardingError
from ..shard._matching import Rule, Rules
from ..shard._modules import ModuleRule, Relayout, SplitOutput
from ..shard._spec import P, blocks
from ..shard._tensor_parallel import local_sizes, vocab_parallel_embedding
from ._names import GPT_NAMES, TransformerNames, auto

__all__ = ["megatron"]


def megatron(
    tp: str = "tp",
    *,
    sequence_parallel: bool = False,
    names: TransformerNames | Literal["auto"] = GPT_NAMES,
    logits: Literal["gather", "vocab_parallel"] = "gather",
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
    head            ``P(tp, None)``     ``P(tp)``       gathered (``logits``)
    ==============  ==================  ==============  ====================

    Everything else (norms, position embeddings) stays replicated. Dropout
    inside the ``regions`` (attention, MLP) draws differently on each ``tp``
    rank up to the row-parallel output, elsewhere identically (seed every
    rank alike, or with :func:`shardax.manual_seed` varying over the data
    axes only). Two all-reduces per block forward (after attention and
    after the MLP) and their transposes in backward — Megatron's four.
    Attention must take its head count from the width it is given (``qkv``
    laid out head-major, see ``examples/gpt.py``; or ``names.packed`` and
    ``attention_sizes``, as for GPT-2). Split dims must divide
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

    ``logits``: what the head's output, split over the vocabulary, becomes.
    ``"gather"`` (the default) all-gathers it, so what the model returns
    has its own shape on every rank: a plain ``F.cross_entropy``, Hugging
    Face's ``labels=``, sampling and ``generate()`` give the single-process
    values (Hugging Face's ``colwise_rep`` head, Megatron's
    ``gather_output``). ``"vocab_parallel"`` hands back this rank's piece
    *marked* — a :class:`shardax.Sharded` split over ``tp`` on the last
    dim — for :func:`shardax.vocab_parallel_cross_entropy`, which never
    builds the whole logits (``1/tp`` of their memory); any plain torch op
    on it is a :class:`shardax.SplitTensorError`, never a number.

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
    >>> [r.output for r in rules.modules if r.pattern == "lm_head"]
    [SplitOutput('tp')]
    >>> fast = sx.rules.megatron("tp", logits="vocab_parallel")
    >>> [r.output for r in fast.modules if r.pattern == "lm_head"]
    [SplitOutput('tp', gather=False)]
    >>> auto = sx.rules.megatron("tp", names="auto")
    >>> paths = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
    ...          "model.layers.0.self_attn.o_proj.weight", "lm_head.weight"]
    >>> auto.resolve(paths).match("model.layers.0.self_attn.o_proj.weight").spec
    P(None, 'tp')
    """
    if logits not in ("gather", "vocab_parallel"):
        raise ShardingError(
            f"rules.megatron(logits={logits!r}): 'gather' (whole logits on every rank) or "
            "'vocab_parallel' (a marked piece for shardax.vocab_parallel_cross_entropy)"
        )
    if isinstance(names, str) and names == "auto":
        sp = ", sequence_parallel=True" if sequence_parallel else ""
        fast = f", logits={logits!r}" if logits != "gather" else ""
        return auto(
            lambda n: megatron(tp, sequence_parallel=sequence_parallel, names=n, logits=logits),
            f"megatron({tp!r}{sp}, names='auto'{fast})",
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
        entries.append(ModuleRule(names.head, output=SplitOutput(tp, gather=logits == "gather")))
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
