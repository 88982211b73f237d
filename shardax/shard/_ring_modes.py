"""Ring attention where a model calls ``F.scaled_dot_product_attention``:
the ``TorchFunctionMode`` that runs those calls as :func:`ring_attention`
(:class:`RingAttention`, made by :class:`Ring`, a module rule's
``within``), and the position ids of a rank's piece of the sequence made
global (:class:`GlobalPositions`) — what ``rules.context_parallel`` puts on
a model's modules."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ShardingError
from ..mesh._mesh import AbstractMesh, normalize_axes
from ._ring import _ORDERS, Order, _axis_place, local_positions, ring_attention

__all__ = ["SEQUENCE_SPLIT", "GlobalPositions", "Ring", "RingAttention", "SequencePiece"]

SEQUENCE_SPLIT = "_shardax_sequence_split"
"""The attribute :mod:`shardax.data` sets on each tensor of two dims or
more it cuts: ``(axes, order)`` of its sequence split (``((), None)``: not
split), which :class:`SequencePiece` checks against the rules' own — a
batch cut another way than the rules say is an error, not a wrong answer."""

_ACTIVATION_BYTES = 17
"""Bytes per token per layer per unit of width and of element size that a
transformer layer keeps for backward: Korthikanti et al. (2022), "Reducing
Activation Recomputation in Large Transformer Models", eq. 1 — 34·s·b·h
bytes in 16-bit without the attention scores (a flash kernel keeps none)."""
_SEQUENCES = (4096, 16384, 131072)


def _read_mask(
    attn_mask: torch.Tensor, b: int, t: int, is_causal: bool
) -> tuple[torch.Tensor | None, bool]:
    """``(key_mask, causal)`` that ``attn_mask`` stands for — built by the
    model from this rank's piece alone, it is a causal mask over the local
    positions with padding (``[B, 1, T, T]``, as Hugging Face builds), or a
    key padding mask (``[B, 1, 1, T]``) — or a :class:`ShardingError` when it
    is anything else, which ring attention cannot honour."""
    allowed = None
    if attn_mask.dtype == torch.bool:
        allowed = attn_mask
    elif attn_mask.is_floating_point():
        blocked = attn_mask <= torch.finfo(attn_mask.dtype).min / 2
        if bool(((attn_mask == 0) | blocked).all()):
            allowed = ~blocked
    if allowed is not None:
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        fits = allowed.dim() == 4 and allowed.shape[1] == 1 and allowed.shape[0] in (1, b)
        if not fits or allowed.shape[2:] not in ((t, t), (1, t)):
            allowed = None
    if allowed is not None:
        allowed = allowed[:, 0].expand(b, allowed.shape[2], t)
        keys = allowed[:, -1, :]  # the last query sees every key (under causality too)
        causal = is_causal
        if allowed.shape[1] == t:
            tril = torch.ones(t, t, dtype=torch.bool, device=keys.device).tril()
            if torch.equal(allowed, tril[None] & keys[:, None, :]):
                causal = True
            elif not torch.equal(allowed, keys[:, None, :].expand(b, t, t)):
                allowed = None
    if allowed is not None:
        return (None if bool(keys.all()) else keys.contiguous()), causal
    raise ShardingError(
        f"ring attention takes causal or full attention with a key padding mask; the model "
        f"passed an attention mask of shape {tuple(attn_mask.shape)} ({attn_mask.dtype}) that "
        "is neither: other masks (sliding windows, documents packed with block-diagonal masks, "
        "prefixes) are not split over the ring"
    )


class RingAttention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` calls run as
    :func:`ring_attention` over ``axis`` (every other torch function as
    it is). The model's own causal mask with padding (a ``[B, 1, T, T]``
    mask over this rank's piece, as Hugging Face builds) is read as the
    key padding mask it stands for; other masks, dropout in attention and
    a key/value cache are refused by name.

    >>> import torch, torch.nn.functional as F, shardax as sx
    >>> q = torch.randn(1, 2, 4, 8)
    >>> with RingAttention("cp", sx.Mesh({"cp": 1})):
    ...     out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> out.shape
    torch.Size([1, 2, 4, 8])
    """

    def __init__(self, axis: str | tuple[str, ...], mesh: AbstractMesh, order: Order = "zigzag"):
        super().__init__()
        self.axis, self.mesh, self.order = normalize_axes(axis), mesh, order

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.sdpa(*args, **kwargs)

    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if dropout_p:
            raise ShardingError(
                f"ring attention over {self.axis!r} has no attention dropout; the model asked for "
                f"dropout_p={dropout_p} (set the attention dropout to 0, or attention_dropout=0.0 "
                "in a Hugging Face config)"
            )
        if query.dim() != 4:
            raise ShardingError(
                f"ring attention over {self.axis!r} takes [batch, heads, sequence, head_dim] "
                f"queries; got shape {tuple(query.shape)}"
            )
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ShardingError(
                f"scaled_dot_product_attention: {query.shape[1]} query heads and {key.shape[1]} "
                "key/value heads need enable_gqa=True"
            )
        b, t = query.shape[0], query.shape[2]
        key_mask, causal = None, is_causal
        if attn_mask is not None:
            key_mask, causal = _read_mask(attn_mask, b, t, is_causal)
        return ring_attention(
            query, key, value, self.axis, mesh=self.mesh, order=self.order, is_causal=causal,
            scale=scale, key_mask=key_mask,
        )  # fmt: skip


@attrs.frozen(repr=False)
class GlobalPositions:
    """An input transform for :class:`shardax.rules.ModuleRule` ``inputs``
    (in place of a :class:`shardax.Relayout`): position ids of this rank's
    piece of a sequence split over ``axis`` in ``order``, made global. A
    model that numbers the tokens it sees ``0..T-1`` (GPT-2's learned
    position embedding, Llama's rotary embedding without ``position_ids``)
    gets the global positions of its piece instead; position ids that are
    already this piece's global ones (the batch's ``position_ids`` split
    with the same spec) pass unchanged; anything else is an error — a batch
    split another way than the rule says.

    >>> import torch, shardax as sx
    >>> GlobalPositions("cp")(torch.arange(4)[None], sx.Mesh({"cp": 1})).tolist()
    [[0, 1, 2, 3]]
    >>> GlobalPositions("cp")
    GlobalPositions('cp')
    """

    axis: tuple[str, ...] = attrs.field(converter=normalize_axes)
    order: Order = attrs.field(default="zigzag", kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.order not in _ORDERS:
            raise ShardingError(f"GlobalPositions: order is one of {_ORDERS}; got {self.order!r}")

    def __call__(self, t: Any, mesh: AbstractMesh, where: str = "") -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dim() == 0:
            raise ShardingError(
                f"{where}: {self!r} takes integer position ids [..., sequence]; got "
                f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}"
            )
        n, index = _axis_place(self.axis, mesh)
        length = t.shape[-1]
        positions = local_positions(length, n, index, self.order).to(t.device)
        if bool((t == positions).all()):
            return t
        if bool((t == torch.arange(length, device=t.device)).all()):
            return positions.to(t.dtype).expand(t.shape).contiguous()
        shown = t.reshape(-1, length)[0, :8].tolist()
        raise ShardingError(
            f"{where}: position ids {shown}... are neither this rank's own numbering 0..{length - 1} "
            f"nor the global positions of its {self.order} piece over {self.axis!r} "
            f"({positions[:8].tolist()}...): split the batch (position ids included) with the "
            f"spec that rules.context_parallel pairs with — {_batch_spec(self.axis, self.order)}"
        )

    def __repr__(self) -> str:
        return _repr("GlobalPositions", self.axis, self.order)


@attrs.frozen(repr=False)
class Ring:
    """What :class:`shardax.rules.ModuleRule` ``within`` takes to run a
    module's ``scaled_dot_product_attention`` calls as ring attention over
    ``axis`` in ``order``: ``Ring(axis)(mesh)`` is the
    :class:`RingAttention` mode. ``rules.context_parallel`` puts it on the
    attention modules.

    >>> Ring("cp"), Ring("cp", order="contiguous")
    (Ring('cp'), Ring('cp', order='contiguous'))
    """

    axis: tuple[str, ...] = attrs.field(converter=normalize_axes)
    order: Order = attrs.field(default="zigzag", kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.axis:
            raise ShardingError("Ring needs the mesh axis the sequence is split over")
        if self.order not in _ORDERS:
            raise ShardingError(f"Ring: order is one of {_ORDERS}; got {self.order!r}")

    def __call__(self, mesh: AbstractMesh) -> RingAttention:
        return RingAttention(self.axis, mesh, self.order)

    def explain(
        self, pattern: str, tensors: dict[str, tuple[tuple[int, ...], int]], mesh: AbstractMesh
    ) -> list[str]:
        """What :func:`shardax.explain` prints of the attention modules
        matching ``pattern``: how the sequence splits, and the activation
        bytes a rank keeps for backward by sequence length, against one
        process's."""
        from ._explain import format_bytes

        regex = re.compile(pattern)
        layers: dict[str, list[tuple[int, ...]]] = {}
        for path, (shape, _) in tensors.items():
            parts = path.split(".")
            for i in range(len(parts) - 1, 0, -1):
                if regex.fullmatch(".".join(parts[:i])):
                    layers.setdefault(".".join(parts[:i]), []).append(shape)
                    break
        matrices = [s for shapes in layers.values() for s in shapes if len(s) == 2]
        if not matrices:
            return []
        d = max(min(s) for s in matrices)  # the model width: q or the output projection's
        itemsize = next(size for shape, size in tensors.values() if len(shape) == 2)
        n = mesh.size(self.axis) if all(a in mesh.axis_names for a in self.axis) else 1
        per_token = _ACTIVATION_BYTES * d * itemsize * len(layers)
        shown = " · ".join(
            f"{t:,} tokens {format_bytes(per_token * t // n)} (one process "
            f"{format_bytes(per_token * t)})"
            for t in _SEQUENCES
        )
        return [
            f"ring attention over {self.axis[0] if len(self.axis) == 1 else self.axis!r} "
            f"({n} ranks, {self.order}): {len(layers)} attention layers, each rank holds 1/{n} "
            f"of every sequence; each layer passes n−1 = {n - 1} key/value blocks around the ring "
            "forward (and back with their gradients in backward), two blocks held at a time",
            f"  activations kept for backward per rank, batch 1: ≈ {_ACTIVATION_BYTES}·d·"
            f"{itemsize} B = {_ACTIVATION_BYTES * d * itemsize:,} B per token per layer (d={d}; "
            "Korthikanti et al. 2022 with attention by a flash kernel: no score matrix; "
            f"logits besides) — {shown}",
        ]

    def __repr__(self) -> str:
        return _repr("Ring", self.axis, self.order)


@attrs.frozen(repr=False)
class SequencePiece:
    """An input check for :class:`shardax.rules.ModuleRule` ``inputs`` (in
    place of a :class:`shardax.Relayout`): the token ids reaching the
    embedding are this rank's piece of sequences split over ``axis`` in
    ``order``. A batch that :mod:`shardax.data` cut says how it was cut; one
    cut another way (or not along the sequence at all) is an error naming
    the spec to use, where it would otherwise train on a wrong attention
    pattern. Ids split by hand carry nothing and pass unchecked.

    >>> import torch, shardax as sx
    >>> ids = sx.data.shard_batch({"x": torch.zeros(2, 8, dtype=torch.long)},
    ...                           sx.AbstractMesh({"cp": 2}), sx.P(None, "cp"), rank=0)["x"]
    >>> SequencePiece("cp")(ids, sx.AbstractMesh({"cp": 2}), "wte input 0")
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: wte input 0: the batch was split by shardax.data with its sequence in contiguous chunks over ('cp',), and rules.context_parallel('cp') runs ring attention over pieces split zigzag over ('cp',): split the batch with P(<data axes>, zigzag('cp'))
    """

    axis: tuple[str, ...] = attrs.field(converter=normalize_axes)
    order: Order = attrs.field(default="zigzag", kw_only=True)

    def __call__(self, t: Any, mesh: AbstractMesh, where: str = "") -> Any:
        split = getattr(t, SEQUENCE_SPLIT, None)
        if split is None or mesh.size(self.axis) == 1 or split == (self.axis, self.order):
            return t
        axes, order = split
        said = (
            "without splitting its sequence"
            if not axes
            else f"with its sequence {'split zigzag' if order == 'zigzag' else 'in contiguous chunks'} over {axes!r}"
        )
        raise ShardingError(
            f"{where}: the batch was split by shardax.data {said}, and "
            f"rules.context_parallel({self.axis[0]!r}) runs ring attention over pieces split "
            f"{'zigzag' if self.order == 'zigzag' else 'in contiguous chunks'} over "
            f"{self.axis!r}: split the batch with {_batch_spec(self.axis, self.order)}"
        )

    def __repr__(self) -> str:
        return _repr("SequencePiece", self.axis, self.order)


def _repr(name: str, axis: tuple[str, ...], order: Order) -> str:
    """``Name('cp')``, or with its axes and a contiguous order spelled out."""
    shown = axis[0] if len(axis) == 1 else axis
    return f"{name}({shown!r}" + ("" if order == "zigzag" else f", order={order!r}") + ")"


def _batch_spec(axis: tuple[str, ...], order: Order) -> str:
    """The batch spec that splits the sequence over ``axis`` in ``order``, for messages."""
    shown = ", ".join(repr(a) for a in axis)
    entry = f"zigzag({shown})" if order == "zigzag" else (shown if len(axis) == 1 else f"({shown})")
    return f"P(<data axes>, {entry})"
