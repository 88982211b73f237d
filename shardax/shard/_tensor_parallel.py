"""Functional helpers for the parts of a transformer that compute differently
when a tensor-parallel axis splits them: an embedding whose vocabulary is
split over ``tp``, and the cross-entropy of logits split over the vocabulary
(which never materialises the full logits on one rank).

Both follow the gradient convention of :mod:`shardax.collectives`: their
collectives are ``psum``/``pmax``, whose transposes keep gradients exact.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..collectives import _api as C
from ..collectives._api import Axis
from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, normalize_axes
from ._layout import Layout
from ._sharded import Sharded
from ._spec import P

__all__ = [
    "local_sizes",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]


def _piece(n: int, axis: Axis, mesh: Any) -> tuple[int, int]:
    """``[start, stop)`` of this rank's piece of ``n`` rows split over ``axis``."""
    rank = getattr(mesh, "rank", 0)
    return Layout(mesh, P(axis)).local_bounds((n,), rank)[0]


def vocab_parallel_embedding(axis: Axis = "tp") -> Any:
    """A ``forward`` for :class:`ModuleRule` that runs an ``nn.Embedding``
    whose weight rows (the vocabulary) are split over ``axis``: each rank
    looks up the ids in its rows and zeros the others — a partial sum over
    ``axis``, which the rule's ``output`` relayout completes (a ``psum``, or
    with sequence parallelism a ``psum_scatter``): Megatron-LM's
    vocab-parallel embedding.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"tp": 1})
    >>> emb = torch.nn.Embedding(5, 2)
    >>> forward = sx.vocab_parallel_embedding("tp")
    >>> torch.equal(forward(emb, mesh, torch.tensor([4, 0])), emb(torch.tensor([4, 0])))
    True
    """

    def forward(module: nn.Module, mesh: AbstractMesh, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(module, nn.Embedding):
            raise ShardingError(
                f"vocab_parallel_embedding runs nn.Embedding modules; got {type(module).__name__}"
            )
        start, stop = _piece(module.num_embeddings, axis, mesh)
        weight = module.weight
        if weight.shape[0] != stop - start:
            raise ShardingError(
                f"vocab_parallel_embedding over {axis!r}: the weight holds {weight.shape[0]} rows, "
                f"this rank's piece of {module.num_embeddings} is {stop - start}; shard the "
                f"embedding weight with P({axis!r}, None) (rules.megatron does)"
            )
        local = ids - start
        inside = (local >= 0) & (local < stop - start)
        rows = F.embedding(local.clamp(0, max(stop - start - 1, 0)), weight)
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    forward.__name__ = f"vocab_parallel_embedding({axis!r})"
    return forward


def local_sizes(axis: Axis, *attributes: str) -> Any:
    """A ``forward`` for :class:`ModuleRule` that runs the module's own
    forward with its integer ``attributes`` divided by the size of ``axis``
    while it runs: sizes that count the features of the whole layer, where
    the rank holds ``1/size`` of them — Hugging Face GPT-2 attention splits
    q, k and v off its packed ``c_attn`` output by ``split_size``, which
    under tensor parallelism (or Ulysses' head split) is this rank's share.

    >>> import torch, shardax as sx
    >>> class Halves(torch.nn.Module):
    ...     width = 4
    ...     def forward(self, x):
    ...         return x.split(self.width, dim=-1)[0]
    >>> forward = sx.local_sizes("tp", "width")
    >>> forward(Halves(), sx.Mesh({"tp": 1}), torch.arange(8.0)).shape
    torch.Size([4])
    """
    if not attributes or not all(isinstance(a, str) for a in attributes):
        raise ShardingError(f"local_sizes needs attribute names; got {attributes!r}")

    def forward(module: nn.Module, mesh: AbstractMesh, *args: Any, **kwargs: Any) -> Any:
        n = mesh.size(axis)
        saved: dict[str, Any] = {}
        for name in attributes:
            value = getattr(module, name, None)
            if isinstance(value, bool) or not isinstance(value, int) or value % n:
                raise ShardingError(
                    f"local_sizes({axis!r}): {type(module).__name__}.{name} is {value!r}; it must "
                    f"be an integer that the size of {axis!r} ({n}) divides"
                )
            saved[name] = module.__dict__.get(name, _UNSET)
        try:
            for name in attributes:
                setattr(module, name, getattr(module, name) // n)
            return type(module).forward(module, *args, **kwargs)
        finally:
            for name, value in saved.items():
                if value is _UNSET:
                    delattr(module, name)
                else:
                    setattr(module, name, value)

    forward.__name__ = f"local_sizes({axis!r}, {', '.join(map(repr, attributes))})"
    return forward


_UNSET = object()


def vocab_parallel_cross_entropy(
    logits: Sharded,
    targets: torch.Tensor,
    axis: Axis | None = None,
    *,
    mesh: Any = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` split over the
    vocabulary, against whole ``targets``: the same value on every rank of
    the split's axis. ``logits`` is the marked piece a vocabulary-parallel
    head returns (``rules.megatron(..., logits="vocab_parallel")``): a
    :class:`shardax.Sharded` whose last dim is split and whose layout says
    over which axes. Only this rank's piece of the logits, and a few
    per-position numbers, exist on any rank: memory is about ``1/size`` of
    the full logits' (Megatron-LM's vocab-parallel cross-entropy). Targets
    equal to ``ignore_index`` do not count.

    Computed in fp32: ``log Σ exp(z - max) + max - z[target]`` with the max,
    the sum and the target logit each completed by one collective over the
    axis. A plain tensor is refused: the logits ``shardax.apply`` returns by
    default are whole (``F.cross_entropy`` is their loss), and a piece
    that does not say it is one cannot be told from them.

    Args:
        logits: ``Sharded`` ``[..., vocab]``, split over the last dim only.
        targets: token ids ``[...]`` (the logits' leading shape).
        axis: optional; when given, must be the axis the layout splits.
        mesh: optional; when given, must be the logits' mesh.
        ignore_index: targets that do not count.

    >>> import torch, torch.nn.functional as F, shardax as sx
    >>> mesh = sx.Mesh({"tp": 1})
    >>> whole, y = torch.randn(3, 7), torch.tensor([1, 6, 0])
    >>> logits = sx.Sharded(whole, sx.Layout(mesh, sx.P(None, "tp")), whole.shape)  # a piece
    >>> loss = sx.vocab_parallel_cross_entropy(logits, y)
    >>> torch.allclose(loss, F.cross_entropy(whole, y))
    True
    """
    if not isinstance(logits, Sharded):
        what = f"a {type(logits).__name__}"
        if isinstance(logits, torch.Tensor):
            what = f"a plain tensor of shape {tuple(logits.shape)}"
        raise ShardingError(
            f"vocab_parallel_cross_entropy takes logits split over the vocabulary as a Sharded "
            f"value (what rules.megatron(..., logits='vocab_parallel') makes the head return); "
            f"got {what}. The logits shardax.apply returns by default are whole: their loss is "
            "F.cross_entropy. A piece you split yourself says what it is as "
            "shardax.Sharded(piece, shardax.Layout(mesh, P(None, ..., axis)), whole_shape)"
        )
    layout, shape = logits.layout, logits.shape
    dims = layout.spec.dim_axes(len(shape))
    split = dims[-1] if shape else ()
    if not shape or any(dims[:-1]) or layout.partial:
        raise ShardingError(
            f"vocab_parallel_cross_entropy: logits of shape {shape} laid out {layout!r}; it needs "
            "them split over the last dim (the vocabulary) only, with no pending sums"
        )
    if axis is not None and tuple(normalize_axes(axis)) != tuple(split):
        raise ShardingError(
            f"vocab_parallel_cross_entropy(axis={axis!r}): the logits are split over {split!r} "
            f"({layout!r}); leave axis out, the layout says it"
        )
    if mesh is not None and mesh is not logits.mesh and mesh != logits.mesh:
        raise ShardingError(
            f"vocab_parallel_cross_entropy(mesh={mesh!r}): the logits live on {logits.mesh!r}; "
            "leave mesh out, the layout says it"
        )
    if shape[:-1] != tuple(targets.shape):
        raise ShardingError(
            f"vocab_parallel_cross_entropy: logits {shape} need targets of shape "
            f"{shape[:-1]}; got {tuple(targets.shape)}"
        )
    m = logits.mesh
    start, stop = logits.bounds()[-1]
    n = stop - start
    z = logits.local.float()
    # an empty piece (a vocabulary smaller than the axis) adds nothing to the max
    mine = z.detach().amax(-1) if n else z.new_full(z.shape[:-1], float("-inf"))
    if split:
        pmax, psum = (functools.partial(op, axis=split, mesh=m) for op in (C.pmax, C.psum))
    else:  # a head kept whole by a rule of yours: the whole vocabulary here
        pmax = psum = _same
    top = pmax(mine)  # for stability only: no gradient
    z = z - top.unsqueeze(-1)
    sum_exp = psum(z.exp().sum(-1))
    local = targets - start
    inside = (local >= 0) & (local < n)
    # an empty piece: zeros that keep the graph
    picked = z.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) if n else z.sum(-1)
    target = psum(picked * inside.to(z.dtype))
    per_token = sum_exp.log() - target
    keep = targets != ignore_index
    return (per_token * keep).sum() / keep.sum().clamp(min=1)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _sliding_window(module: nn.Module) -> int | None:
    """The window a Hugging Face attention layer attends within (Mistral's
    ``config.sliding_window``; Qwen2's where its ``layer_types`` say
    so), or None for full attention."""
    config = getattr(module, "config", None)
    window = getattr(module, "sliding_window", None) or getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    kinds, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if kinds is not None and layer is not None and kinds[layer] != "sliding_attention":
        return None
    return int(window)


def ulysses_attention(axis: Axis = "sp") -> Any:
    """A ``forward`` for :class:`ModuleRule` that runs a Llama-family
    attention module (``q_proj``/``k_proj``/``v_proj``/``o_proj``, rotary
    positions, grouped key/value heads — Llama, Mistral, Qwen2 in Hugging
    Face ``transformers``) under DeepSpeed-Ulysses: the projections of this
    rank's piece of the sequence go through one all-to-all each to a head
    split over ``axis``, attention runs causally over the whole sequence for
    those heads, and one all-to-all brings the output back to the sequence
    split before ``o_proj``. The rotary ``position_embeddings`` must cover
    the whole sequence (pass the model ``position_ids`` for all of it).
    ``rules.ulysses(names=rules.LLAMA_NAMES)`` installs it.

    >>> import shardax as sx
    >>> sx.rules.ulysses("sp", names=sx.rules.LLAMA_NAMES).modules[-3]
    ModuleRule('model\\\\.layers\\\\.\\\\d+\\\\.self_attn', forward=ulysses_attention('sp'))
    """
    from ._modules import Relayout
    from ._spec import P

    to_heads = Relayout(P(None, axis), P(None, None, axis))
    to_sequence = Relayout(P(None, None, axis), P(None, axis))

    def forward(
        module: nn.Module,
        mesh: AbstractMesh,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        window, whole = _sliding_window(module), hidden_states.shape[1] * mesh.size(axis)
        if window is not None and whole > window:
            raise ShardingError(
                f"ulysses_attention runs full causal attention, and {type(module).__name__} "
                f"attends within a sliding window of {window} tokens, shorter than the sequence "
                f"({whole}): train on sequences of at most {window} tokens, or use "
                "rules.megatron (the model's own attention) for longer ones"
            )
        if attention_mask is not None:
            raise ShardingError(
                "ulysses_attention runs causal attention over whole sequences; the model passed "
                f"an attention mask of shape {tuple(attention_mask.shape)} (padding): pack the "
                "batch into full sequences, or leave Ulysses out for padded batches"
            )
        if position_embeddings is None:
            raise ShardingError("ulysses_attention needs the rotary position_embeddings")
        family = sys.modules[type(module).__module__]
        b = hidden_states.shape[0]
        hd = module.head_dim
        q, k, v = (
            to_heads(proj(hidden_states), mesh, "ulysses_attention")
            for proj in (module.q_proj, module.k_proj, module.v_proj)
        )
        t = q.shape[1]
        q, k, v = (x.view(b, t, -1, hd).transpose(1, 2) for x in (q, k, v))
        cos, sin = position_embeddings
        if cos.shape[-2] != t:
            raise ShardingError(
                f"ulysses_attention: rotary positions cover {cos.shape[-2]} tokens, the sequence "
                f"has {t}; pass position_ids (and cache_position) for the whole sequence"
            )
        q, k = family.apply_rotary_pos_emb(q, k, cos, sin)
        groups = module.num_key_value_groups
        k, v = family.repeat_kv(k, groups), family.repeat_kv(v, groups)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=module.scaling)
        out = to_sequence(out.transpose(1, 2).reshape(b, t, -1), mesh, "ulysses_attention")
        return module.o_proj(out), None

    forward.__name__ = f"ulysses_attention({axis!r})"
    return forward
