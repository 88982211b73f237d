"""DeepSpeed-Ulysses sequence parallelism as rules."""

from __future__ import annotations

from typing import Literal

from ..errors import ShardingError
from ..shard._matching import Rules
from ..shard._modules import ModuleRule, Relayout
from ..shard._spec import P, blocks
from ..shard._tensor_parallel import local_sizes, ulysses_attention
from ._names import GPT_NAMES, TransformerNames, auto

__all__ = ["ulysses"]


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

    What the model returns is whole on every rank: the sequence is gathered
    where the head starts (with ``names.final``, GPT-2's, after the final
    norm), so every rank computes the whole sequence's logits and a plain
    loss and Hugging Face's ``labels=`` work unchanged (sampling one token
    at a time cannot split the sequence: apply the same params without
    these rules, as ``examples/train_gpt.py`` does). The head
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
    (6, Relayout(P(None, 'sp'), P(None, None, 'sp')))
    >>> rules.modules[4]
    ModuleRule('lm_head', inputs=(Relayout(P(None, 'sp'), P()),))
    >>> sx.rules.ulysses("sp", names="auto")
    Rules(ulysses('sp', names='auto'))
    """
    if isinstance(names, str) and names == "auto":
        return auto(lambda n: ulysses(sp, names=n), f"ulysses({sp!r}, names='auto')")
    if not isinstance(names, TransformerNames):
        raise ShardingError(f"names is a TransformerNames or 'auto'; got {names!r}")
    relayouts = names.attention_in is not None and names.attention_out is not None
    if not relayouts and names.attention is None:
        raise ShardingError(
            "rules.ulysses needs names.attention_in and names.attention_out (the projections "
            "around attention: the all-to-alls go there), or names.attention (Llama-family "
            "modules, run by shardax.ulysses_attention)"
        )
    if names.final is None and names.head is None:
        raise ShardingError(
            "rules.ulysses needs names.head (the LM head) or names.final (the module after the "
            "blocks): the sequence is gathered there, so the model returns whole outputs"
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
    else:  # the whole sequence's logits on every rank: never a piece passing for them
        entries.append(ModuleRule(names.head, inputs=[Relayout(seq, P())]))
    entries.append(ModuleRule("", rng=sp))  # pieces of the sequence draw differently
    return Rules(*entries)
