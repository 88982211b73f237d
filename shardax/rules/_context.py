"""Context parallelism (ring attention) as rules."""

from __future__ import annotations

from typing import Literal

from ..errors import ShardingError
from ..shard._matching import Rules
from ..shard._modules import ModuleRule
from ..shard._ring import Order
from ..shard._ring_modes import GlobalPositions, Ring, SequencePiece
from ._names import GPT_NAMES, TransformerNames, auto

__all__ = ["context_parallel"]


def context_parallel(
    cp: str = "cp",
    *,
    names: TransformerNames | Literal["auto"] = GPT_NAMES,
    order: Order = "zigzag",
) -> Rules:
    """Context parallelism over the axis ``cp``: the sequence of every
    activation split over ``cp`` from the input on, attention computed by
    ring attention (:func:`shardax.ring_attention`) — key/value blocks
    passed around the ranks of ``cp``, each transfer overlapped with a
    block's compute, partial results merged by their log-sum-exp, and the
    backward the same ring — so no rank ever holds the whole sequence.

    The batch arrives split: each rank gets its piece of the sequence
    (dim 1) of the token ids, labels and any position ids or padding mask,
    from :mod:`shardax.data` with the batch spec ``P(<data axes>,
    zigzag(cp))`` (``order="zigzag"``, the default: for causal attention
    the head–tail split gives every rank the same work) or ``P(<data
    axes>, cp)`` (``order="contiguous"``). The model runs on its piece and
    returns the logits of its piece — as under data parallelism, the
    output of the input it was given — so a plain loss of those logits and
    the labels' same piece is this rank's part of the loss
    (:func:`shardax.value_and_grad` averages over ranks). Labels are
    shifted in the batch (``y[t] = x[t+1]``, as :class:`shardax.data.TextDataset`
    gives them): a loss that shifts by itself (Hugging Face's ``labels=``)
    would pair the last token of a piece with nothing.

    What the rules do, all by module name (``names``, as for
    :func:`megatron`; ``"auto"`` picks them by the parameter paths):

    - the attention modules (``names.attention``) run their
      ``F.scaled_dot_product_attention`` calls as ring attention
      (:class:`shardax.Ring`): causal or not, grouped-query attention kept
      compact on the ring, and a padding mask the model builds (Hugging
      Face's causal-with-padding mask over the piece) read as the key
      padding mask it stands for; other masks and attention dropout are
      refused by name;
    - the token embedding (``names.vocab``) checks that a batch
      :mod:`shardax.data` cut was cut this way (:class:`shardax.SequencePiece`):
      one cut another way, or not along the sequence, is an error;
    - the learned position embedding (``names.positions``) and the rotary
      embedding (``names.rotary``) get the global positions of the piece
      where the model numbers the tokens it sees ``0..T-1``
      (:class:`shardax.GlobalPositions`), so rotary and learned positions
      are those of the whole sequence.

    Parameters are untouched (replicated over ``cp``; compose
    ``rules.zero(3, ("dp", "cp"))`` to shard them over both). It composes
    with ``rules.megatron`` (heads over ``tp``, the ring over ``cp``) and
    ``rules.ulysses`` (USP: the piece split again over ``sp``, heads
    all-to-all'd over ``sp``, the ring over ``cp``). To sample one token
    at a time, apply the same params without these rules.

    >>> import shardax as sx
    >>> rules = sx.rules.context_parallel("cp")
    >>> rules.modules[1]
    ModuleRule('wpe', inputs=(GlobalPositions('cp'),))
    >>> rules.modules[2]
    ModuleRule('blocks\\\\.\\\\d+\\\\.attn', within=Ring('cp'))
    >>> sx.rules.context_parallel("cp", names="auto")
    Rules(context_parallel('cp', names='auto'))
    """
    if isinstance(names, str) and names == "auto":
        label = f"context_parallel({cp!r}, names='auto'" + (
            ")" if order == "zigzag" else f", order={order!r})"
        )
        return auto(lambda n: context_parallel(cp, names=n, order=order), label)
    if not isinstance(names, TransformerNames):
        raise ShardingError(f"names is a TransformerNames or 'auto'; got {names!r}")
    if not isinstance(cp, str) or not cp:
        raise ShardingError(f"context_parallel needs the name of a mesh axis; got {cp!r}")
    if names.attention is None:
        raise ShardingError(
            "rules.context_parallel needs names.attention: the attention modules, whose "
            "scaled_dot_product_attention calls run as ring attention"
        )
    positions = GlobalPositions(cp, order=order)
    entries: list[ModuleRule] = []
    if names.vocab is not None:  # the ids: a batch shardax.data cut says how
        entries.append(ModuleRule(names.vocab, inputs=[SequencePiece(cp, order=order)]))
    if names.positions is not None:
        entries.append(ModuleRule(names.positions, inputs=[positions]))
    if names.rotary is not None:  # rotary_emb(hidden_states, position_ids)
        entries.append(ModuleRule(names.rotary, inputs=[None, positions]))
    entries.append(ModuleRule(names.attention, within=Ring(cp, order=order)))
    return Rules(*entries)
