"""``Sharded``: this rank's piece of a global tensor, with its layout."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ..errors import ShardingError, SplitTensorError
from ..mesh._mesh import Mesh
from ._layout import Layout
from ._placement import Placement
from ._spec import PartitionSpec

__all__ = ["Sharded"]


def _check(instance: Sharded, attribute: object, value: object) -> None:
    layout, shape, local = instance.layout, instance.shape, instance.local
    if not isinstance(layout.mesh, Mesh):
        raise ShardingError(
            f"a Sharded value lives on a live Mesh; {layout.mesh!r} is abstract (use explain() to plan)"
        )
    expected = layout.local_shape(shape, layout.mesh.rank)
    if tuple(local.shape) != expected:
        raise ShardingError(
            f"rank {layout.mesh.rank}'s piece of a {shape} tensor under {layout!r} must have shape "
            f"{expected}; got {tuple(local.shape)}"
        )


_TENSOR_NAMES = frozenset(n for n in dir(torch.Tensor) if not n.startswith("__"))
_OPERATORS = (
    "__getitem__", "__setitem__", "__iter__", "__len__", "__float__", "__int__", "__index__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__matmul__", "__rmatmul__", "__pow__", "__rpow__",
    "__neg__", "__abs__", "__lt__", "__le__", "__gt__", "__ge__",
)  # fmt: skip


class _Piece:
    """What makes a :class:`Sharded` refuse to pass for a whole tensor:
    torch functions (``__torch_function__``), tensor methods, indexing and
    arithmetic raise :class:`shardax.SplitTensorError`, naming the call and
    the fix — never a number computed from one rank's piece."""

    __slots__ = ()

    @classmethod
    def __torch_function__(
        cls, func: object, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        values = [*args, *(kwargs or {}).values()]
        values += [b for a in values if isinstance(a, (list, tuple)) for b in a]
        piece = next((a for a in values if isinstance(a, Sharded)), None)
        raise _refusal(piece, _call_name(func))

    def __bool__(self) -> bool:  # an object, as any (not a tensor's truth value)
        return True

    def __getattr__(self, name: str) -> object:
        if name in _TENSOR_NAMES:
            raise _refusal(self, f".{name}")  # type: ignore[arg-type]
        raise AttributeError(f"'Sharded' object has no attribute {name!r}")


def _call_name(func: object) -> str:
    """``torch.nn.functional.cross_entropy``, ``torch.softmax``, ``Tensor.mul``."""
    name = getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch") and not module.startswith("torch._"):
        return f"{module}.{name}"
    qualname = getattr(func, "__qualname__", "")
    return f"Tensor.{name}" if "Tensor" in qualname else f"torch.{name}"


def _operator(name: str) -> object:
    def refuse(self: Sharded, *args: object) -> object:
        raise _refusal(self, f"Sharded.{name}")

    refuse.__name__ = name
    return refuse


for _name in _OPERATORS:
    setattr(_Piece, _name, _operator(_name))


def _refusal(x: Sharded | None, what: str) -> SplitTensorError:
    if x is None:
        return SplitTensorError(
            f"{what} got a Sharded value, not a tensor; shardax.gather it first"
        )
    layout = x.layout
    split = [d for d, axes in enumerate(layout.spec.dim_axes(len(x.shape))) if axes]
    hint = ""
    if split == [len(x.shape) - 1]:
        hint = (
            " Logits split over the vocabulary (rules.megatron(..., logits='vocab_parallel')) "
            "go to shardax.vocab_parallel_cross_entropy(logits, targets) as they are."
        )
    return SplitTensorError(
        f"{what} got a Sharded value: rank {x.mesh.rank}'s piece {tuple(x.local.shape)} of a "
        f"{x.shape} tensor laid out {layout.spec!r}"
        + (f" (partial over {layout.partial!r})" if layout.partial else "")
        + f" on {x.mesh!r}, not the whole tensor. Take the whole tensor with shardax.gather(x), "
        "or this rank's piece with x.local where you mean the piece." + hint
    )


@attrs.frozen(eq=False, repr=False)
class Sharded(_Piece):
    """A pytree leaf: this rank's local tensor, the global shape and the layout.

    Build them with :func:`shardax.shard`; take them back with
    :func:`shardax.gather`; move them with :func:`shardax.transfer`.
    A parameter sharded by rules also carries its ``placement``: the layouts
    it is computed with, reduced to and optimised in (see ``rules.zero``).

    >>> import torch, shardax as sx
    >>> x = sx.shard(torch.arange(6.0).reshape(2, 3), sx.Mesh({"dp": 1}), sx.P("dp"))
    >>> x
    Sharded(shape=(2, 3), dtype=torch.float32, layout=Layout(Mesh({'dp': 1}), P('dp')), local_shape=(2, 3))
    """

    local: torch.Tensor
    layout: Layout
    shape: tuple[int, ...] = attrs.field(
        converter=lambda s: tuple(int(d) for d in s), validator=_check
    )
    placement: Placement | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        p = self.placement
        if p is not None and p.compute.mesh != self.layout.mesh:
            raise ShardingError(
                f"a Sharded value's placement {p!r} lives on {p.compute.mesh!r}, its layout on "
                f"{self.layout.mesh!r}; they must share the mesh"
            )

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh  # type: ignore[return-value]

    @property
    def spec(self) -> PartitionSpec:
        return self.layout.spec

    @property
    def partial(self) -> tuple[str, ...]:
        return self.layout.partial

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.local.shape)

    def astype(self, dtype: torch.dtype) -> Sharded:
        """The same value in ``dtype``, its local tensor in the memory kind it
        lives in (a shard on disk stays on disk: ``rules.offload``).

        >>> import torch, shardax as sx
        >>> x = sx.shard(torch.ones(4), sx.Mesh({"dp": 1}), sx.P("dp"))
        >>> x.astype(torch.bfloat16).local
        tensor([1., 1., 1., 1.], dtype=torch.bfloat16)
        """
        from ._memory import kind_of, placed

        return self.with_local(placed(self.local.to(dtype), kind_of(self.local)))

    def with_local(self, local: torch.Tensor) -> Sharded:
        """The same layout, shape and placement around another local tensor."""
        return Sharded(local, self.layout, self.shape, placement=self.placement)

    def bounds(self, rank: int | None = None) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` per dim of ``rank``'s piece (default: this rank's);
        a layout with blocked dims has several boxes instead (:meth:`boxes`)."""
        return self.layout.local_bounds(self.shape, self.mesh.rank if rank is None else rank)

    def boxes(self, rank: int | None = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of each box of ``rank``'s piece (default: this
        rank's), in the order the local tensor holds them: one, or one per
        block where a dim is blocked (:func:`shardax.blocks`)."""
        return self.layout.local_boxes(self.shape, self.mesh.rank if rank is None else rank)

    def __repr__(self) -> str:
        return (
            f"Sharded(shape={self.shape}, dtype={self.dtype}, layout={self.layout!r}, "
            f"local_shape={self.local_shape})"
        )


def local_piece(x: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``rank``'s piece of the full tensor ``x`` under ``layout``: a view,
    or, where a dim is blocked, its boxes side by side (a copy)."""
    parts = []
    for offsets, sizes in layout.local_boxes(tuple(x.shape), rank):
        out = x
        for d, (a, n) in enumerate(zip(offsets, sizes, strict=True)):
            if n != x.size(d):
                out = out.narrow(d, a, n)
        parts.append(out)
    if len(parts) == 1:
        return parts[0]
    shape = tuple(x.shape)
    out = x.new_empty(layout.local_shape(shape, rank))
    for (_, _, view), part in zip(layout.box_views(out, shape, rank), parts, strict=True):
        view.copy_(part)
    return out


def shape_of(x: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)
