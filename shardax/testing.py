"""Checking a parallel step against one process: :func:`check_parity`.

Every mixture-of-experts implementation among the libraries we compare
with has shipped a gradient-scaling bug at some point — expert gradients
off by 2× or by the expert-parallel size, router gradients wrong — that
trained on, silently worse. The cure is to compare: run the step on the
mesh, run it again as one process on the whole batch with the whole
parameters, and look at the worst differences by key path.

>>> import torch, shardax as sx
>>> mesh = sx.Mesh({"dp": 1})
>>> model = torch.nn.Linear(4, 2)
>>> params = sx.shard(sx.params_of(model), mesh, sx.rules.zero(3, "dp"))
>>> step = sx.value_and_grad(lambda p, x: sx.apply(model, p, x).square().mean())
>>> report = sx.testing.check_parity(step, params, (torch.ones(8, 4),), mesh)
>>> report.ok, sorted(d.path for d in report.worst)
(True, ['bias', 'loss', 'weight'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import optree
import torch

from ._tree import flatten_with_paths
from .errors import ShardingError
from .mesh._mesh import Mesh
from .shard import Sharded, gather

__all__ = ["Difference", "Parity", "ParityError", "check_parity"]


class ParityError(AssertionError):
    """A step whose loss or gradients on the mesh differ from one process's
    beyond the tolerance (:meth:`Parity.check`)."""


@attrs.frozen
class Difference:
    """How far one gradient (or the loss, path ``"loss"``) is from the
    one-process value: the largest absolute difference, and that relative to
    the largest magnitude of the reference."""

    path: str
    abs: float
    rel: float
    ok: bool

    def __str__(self) -> str:
        mark = "ok " if self.ok else "BAD"
        return f"{mark} {self.path}: max |Δ| {self.abs:.3g}, {100 * self.rel:.3g} % of max |ref|"


@attrs.frozen
class Parity:
    """The result of :func:`check_parity`: the mesh's and the one-process
    loss, and every gradient's :class:`Difference`, worst (relative) first.
    ``missing``: paths with a gradient on one side only."""

    loss: float
    reference_loss: float
    worst: tuple[Difference, ...]
    missing: tuple[str, ...] = ()
    rtol: float = 1e-5
    atol: float = 1e-5

    @property
    def ok(self) -> bool:
        """Whether the loss and every gradient are within the tolerance."""
        return not self.missing and all(d.ok for d in self.worst)

    def check(self) -> Parity:
        """``self`` when :attr:`ok`; else :class:`ParityError` with the report."""
        if not self.ok:
            raise ParityError(f"the step on the mesh differs from one process:\n{self}")
        return self

    def __str__(self) -> str:
        lines = [f"loss {self.loss:.8g} on the mesh, {self.reference_loss:.8g} in one process"]
        lines += [f"  {d}" for d in self.worst[:8]]
        if len(self.worst) > 8:
            lines.append(f"  … and {len(self.worst) - 8} more, each closer than these")
        lines += [f"  MISSING {p}: a gradient on one side only" for p in self.missing]
        lines.append(f"  (rtol {self.rtol:g}, atol {self.atol:g})")
        return "\n".join(lines)


def _difference(
    path: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float
) -> Difference:
    if got.shape != want.shape:
        return Difference(
            f"{path} (shape {tuple(got.shape)} vs {tuple(want.shape)})",
            float("inf"),
            float("inf"),
            False,
        )
    a, b = got.detach().double(), want.detach().double()
    delta = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    ok = bool(torch.allclose(a, b, rtol=rtol, atol=atol))
    return Difference(path, delta, delta / scale if scale else delta, ok)


def _rows(batch: Sequence[Any], index: int, n: int, data: tuple[str, ...]) -> tuple[Any, ...]:
    out = []
    for i, x in enumerate(batch):
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        if x.dim() == 0 or x.shape[0] % n:
            raise ShardingError(
                f"check_parity: batch[{i}] of shape {tuple(x.shape)} cannot be split into {n} "
                f"equal pieces of rows over the data axes {data}; give a batch whose dim 0 "
                f"divides by {n}, or name the data axes with data=(...)"
            )
        size = x.shape[0] // n
        out.append(x[index * size : (index + 1) * size])
    return tuple(out)


def check_parity(
    step: Callable[..., tuple[torch.Tensor, Any]],
    params: Any,
    batch: Sequence[Any],
    mesh: Mesh,
    *,
    data: str | Sequence[str] | None = None,
    reference: Callable[..., tuple[torch.Tensor, Any]] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> Parity:
    """Run ``step(params, *rows)`` on the mesh — each rank its rows of the
    global ``batch`` (dim 0 split over the ``data`` axes, in
    ``mesh.axis_index(data)`` order; default: every axis of the mesh) —
    and ``reference(whole params, *batch)`` as one process on every rank
    (default: ``step`` itself, given dense tensors: with
    :func:`shardax.apply` that is the plain model, no rule, no
    collective), and compare the losses and the gradients key path by key
    path. ``step`` returns ``(loss, grads)`` like
    :func:`shardax.value_and_grad`; sharded gradients are gathered.

    Call it on every rank (the step's collectives need them); each gets the
    same :class:`Parity`. ``.ok``, ``print(report)``, or ``.check()`` to
    raise :class:`ParityError` naming the worst paths. A ``reference`` of
    your own is for losses that only run split (Megatron's
    ``vocab_parallel_cross_entropy``: give the dense ``cross_entropy``).

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> model = torch.nn.Linear(4, 2)
    >>> params = sx.shard(sx.params_of(model), mesh, sx.rules.zero(1, "dp"))
    >>> wrong = sx.value_and_grad(lambda p, x: 2 * sx.apply(model, p, x).sum())
    >>> right = sx.value_and_grad(lambda p, x: sx.apply(model, p, x).sum())
    >>> report = sx.testing.check_parity(wrong, params, (torch.ones(2, 4),), mesh, reference=right)
    >>> report.ok, report.worst[0].rel
    (False, 1.0)
    """
    axes = (
        tuple(mesh.axis_names)
        if data is None
        else ((data,) if isinstance(data, str) else tuple(data))
    )
    if not isinstance(batch, (tuple, list)):
        raise ShardingError(
            f"check_parity: batch is a tuple of the step's arguments after params, e.g. (x, y); "
            f"got {type(batch).__name__}"
        )
    n, index = mesh.size(axes), mesh.axis_index(axes)
    loss, grads = step(params, *_rows(batch, index, n, axes))
    grads = gather(grads)
    whole = optree.tree_map(
        lambda v: v.detach() if isinstance(v, torch.Tensor) else v, gather(params)
    )
    ref_loss, ref_grads = (reference or step)(whole, *batch)
    got_paths, got_leaves, _ = flatten_with_paths(grads, is_leaf=lambda x: isinstance(x, Sharded))
    want_paths, want_leaves, _ = flatten_with_paths(ref_grads)
    got = {p: v for p, v in zip(got_paths, got_leaves, strict=True) if isinstance(v, torch.Tensor)}
    want = {
        p: v for p, v in zip(want_paths, want_leaves, strict=True) if isinstance(v, torch.Tensor)
    }
    diffs = [_difference("loss", torch.as_tensor(loss), torch.as_tensor(ref_loss), rtol, atol)]
    diffs += [_difference(p, got[p], want[p], rtol, atol) for p in want if p in got]
    diffs.sort(key=lambda d: (d.ok, -d.rel, -d.abs))
    missing = tuple(sorted(set(got) ^ set(want)))
    return Parity(float(loss), float(ref_loss), tuple(diffs), missing, rtol, atol)
