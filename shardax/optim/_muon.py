"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM
Training"): momentum orthogonalized by a Newton–Schulz iteration, for the
matrices; AdamW for the rest.

The orthogonalization needs each matrix whole. Sharded matrices (ZeRO's
state shards, tensor-parallel pieces, experts) are relaid for it — a
layout choice, not a special case: the matrices of one shape and layout
are stacked, the stack is transferred to a layout that splits it over the
ranks (each rank whole matrices, the work spread evenly), orthogonalized
there, and transferred back (:func:`orthogonalize`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from .._tree import flatten_with_paths
from ..errors import ShardingError
from ..mesh._mesh import Mesh
from ..shard._layout import Layout
from ..shard._sharded import Sharded
from ..shard._spec import P
from ..shard._transfer import transfer
from ._base import (
    Flat,
    GradientTransformation,
    Schedule,
    chain,
    is_sharded,
    transformation,
    tree_zeros_state,
    validate,
)
from ._transforms import add_decayed_weights, scale_by_adam, scale_by_learning_rate
from ._wrappers import masked

__all__ = [
    "ScaleByMuonState",
    "muon",
    "muon_default",
    "muon_state_bytes",
    "newton_schulz",
    "orthogonalize",
    "scale_by_muon",
]

# Keller Jordan's quintic coefficients: the iteration's fixed point is not
# exactly 1 (singular values land in about [0.7, 1.2]), fast from small ones.
_NS = (3.4445, -4.7750, 2.0315)


class ScaleByMuonState(NamedTuple):
    """State of :func:`scale_by_muon`: the momentum buffer of each matrix
    (fp32, in its param's ``opt_state`` layout: 4 bytes a parameter)."""

    mu: Any


def newton_schulz(
    x: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The matrices of ``x`` (its last two dims; the others are a batch)
    orthogonalized by ``steps`` quintic Newton–Schulz iterations: ``U V^T``
    of each one's SVD, approximately, computed in ``dtype`` (bf16 as
    ``torch.optim.Muon``: faster on GPUs, about 1e-2 apart). Each is first
    divided by its Frobenius norm (plus ``eps``), and a tall one is worked on
    transposed.

    >>> import torch
    >>> o = newton_schulz(torch.tensor([[3.0, 0.0], [0.0, 0.5]]))
    >>> o.diagonal().round(decimals=1)        # both singular values near 1
    tensor([0.7000, 1.0000])
    """
    a, b, c = _NS
    x = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    fma = torch.addmm if x.ndim == 2 else torch.baddbmm  # beta * input + alpha * m1 @ m2
    for _ in range(steps):
        gram = x @ x.mT
        x = fma(x, fma(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _owners(mesh: Mesh, layout: Layout) -> tuple[str, ...]:
    """The axes a stack of matrices laid out ``layout`` is split over to
    orthogonalize it: each axis that splits them, then each one they are
    replicated over — every rank of the mesh gets whole matrices."""
    used = list(layout.spec.axes)
    return (*used, *[a for a in mesh.axis_names if a not in used and mesh.size(a) > 1])


def _head(axes: tuple[str, ...]) -> Any:
    """A spec entry splitting a dim over ``axes`` (None for none)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _stacked(layout: Layout) -> Layout:
    """``layout`` of each matrix with a stack dim in front."""
    return Layout(layout.mesh, P(None, *layout.spec))


def orthogonalize(
    tensors: list[Any], steps: int = 5, dtype: torch.dtype = torch.float32
) -> list[Any]:
    """:func:`newton_schulz` of each tensor (a plain tensor, or a Sharded
    one: 2-D, or 3-D as a batch of matrices over dim 0 — stacked experts),
    each Sharded one relaid so that whole matrices meet on one rank.

    The 2-D Sharded tensors of one global shape, layout and dtype are stacked
    and moved together: their stack, split like each matrix, is transferred
    to a layout that splits the stack over every rank of the mesh (an
    all-to-all where the matrices were split, a local slice where they were
    replicated), orthogonalized where it lands, and transferred back. A 3-D
    one is its own stack, its dim 0 split over those ranks. Unsplit
    matrices on one rank are orthogonalized where they are.
    """
    out: list[Any] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, Sharded) or t.mesh.world_size == 1:
            local = t.local if isinstance(t, Sharded) else t
            o = newton_schulz(local, steps, dtype=dtype).to(local.dtype)
            out[i] = t.with_local(o) if isinstance(t, Sharded) else o
        elif t.ndim == 2:
            groups.setdefault((t.shape, t.layout, t.dtype), []).append(i)
        else:
            out[i] = _orthogonalize_stack(t, steps, dtype)
    for (shape, layout, _), idx in groups.items():
        local = torch.stack([tensors[i].local for i in idx])
        stack = Sharded(local, _stacked(layout), (len(idx), *shape))
        done = _orthogonalize_stack(stack, steps, dtype)
        for j, i in enumerate(idx):
            out[i] = tensors[i].with_local(done.local[j])
    return out


def _orthogonalize_stack(stack: Sharded, steps: int, dtype: torch.dtype) -> Sharded:
    """A Sharded stack of matrices (dim 0 the stack) orthogonalized where
    each lands whole, and returned in its own layout."""
    mesh = stack.mesh
    if stack.layout.partial or stack.layout.diverged:
        raise ShardingError(
            f"Muon orthogonalizes whole matrices; a stack laid out {stack.layout!r} is a pending "
            "sum or mean: transfer its gradients to a layout without partial axes first"
        )
    whole = Layout(mesh, P(_head(_owners(mesh, stack.layout)), None, None))
    moved = transfer(stack, whole)
    done = moved.with_local(newton_schulz(moved.local, steps, dtype=dtype).to(moved.dtype))
    return transfer(done, stack.layout)


SCALES = ("moonlight", "spectral")


def _factor(shape: tuple[int, ...], scale: str, rms_scale: float) -> float:
    """The orthogonalized update's factor for a matrix of ``shape``:
    Moonlight's ``rms_scale * sqrt(max(rows, cols))`` (AdamW's update RMS,
    so AdamW's learning rate carries over), or Keller Jordan's and
    DeepSpeed's ``sqrt(max(1, rows / cols))`` (``"spectral"``: the learning
    rate in units of spectral norm)."""
    rows, cols = shape[-2], shape[-1]
    if scale == "moonlight":
        return rms_scale * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def _check_matrices(tree: Any, what: str) -> None:
    paths, leaves, _ = flatten_with_paths(tree, is_leaf=is_sharded)
    for path, x in zip(paths, leaves, strict=True):
        if x is None:
            continue
        shape = tuple(x.shape)
        if len(shape) not in (2, 3):
            raise ShardingError(
                f"{what}: Muon orthogonalizes matrices, and {path!r} is {len(shape)}-D {shape}; "
                "give it to Adam (use_muon=... False there), or reshape it into a matrix (or "
                "a stack of them on dim 0) in the model"
            )


def scale_by_muon(
    momentum: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    scale: str = "moonlight",
    rms_scale: float = 0.2,
    ns_dtype: torch.dtype = torch.float32,
) -> GradientTransformation:
    """Muon's direction for matrices (Moonlight's): ``m = momentum * m + g``;
    with ``nesterov`` ``g + momentum * m``, else ``m``; orthogonalized
    (:func:`orthogonalize`) and scaled by ``rms_scale * sqrt(max(rows,
    cols))`` (``scale="moonlight"``) or ``sqrt(max(1, rows / cols))``
    (``"spectral"``: Keller Jordan's and DeepSpeed's, whose momentum is an
    average, ``(1 - momentum)`` times this one: the same direction once
    orthogonalized). 2-D leaves are matrices, 3-D ones stacks of them
    (experts); anything else is refused by name.

    >>> import torch
    >>> opt = scale_by_muon()
    >>> u, _ = opt.update({"w": torch.eye(2) * 4.0}, opt.init({"w": torch.zeros(2, 2)}))
    >>> u["w"].diagonal().round(decimals=3)   # 0.2 * sqrt(2) * (about 1: the quintic's 1.107)
    tensor([0.3130, 0.3130])
    """
    momentum = validate("momentum", momentum, high=1.0)
    rms_scale = validate("rms_scale", rms_scale, low_open=True)
    if scale not in SCALES:
        raise ValueError(f"scale is one of {SCALES}; got {scale!r}")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be an int >= 1; got {ns_steps!r}")

    def init(params: Any) -> ScaleByMuonState:
        _check_matrices(params, "muon")
        return ScaleByMuonState(tree_zeros_state(params, torch.float32))

    def update(updates: Any, state: ScaleByMuonState, params: Any = None) -> tuple[Any, Any]:
        flat = Flat(state.mu, "state.mu")
        g = [x.to(torch.float32) for x in flat.align(updates, "updates")]
        mu = torch._foreach_mul(flat.locals, momentum)
        torch._foreach_add_(mu, g)
        u = torch._foreach_add(g, mu, alpha=momentum) if nesterov else [m.clone() for m in mu]
        wrapped = [
            ref.with_local(x) if isinstance(ref, Sharded) else x
            for ref, x in zip(flat.leaves, u, strict=True)
        ]
        done = orthogonalize(wrapped, ns_steps, ns_dtype)
        scaled = [
            (d.local if isinstance(d, Sharded) else d) * _factor(tuple(ref.shape), scale, rms_scale)
            for d, ref in zip(done, flat.leaves, strict=True)
        ]
        return flat.build(scaled), ScaleByMuonState(flat.build(mu))

    return transformation(init, update)


_EMBEDDINGS = re.compile(
    r"(^|\.)(emb|embed|embedding|embeddings|embed_tokens|tok_embeddings|wte|wpe|lm_head|head|output)"
    r"(\.|$)"
)
_EXPERTS = re.compile(r"(^|\.)experts\.")


def muon_default(path: str, shape: tuple[int, ...]) -> bool:
    """Whether :func:`muon`'s default puts the leaf at ``path`` of ``shape``
    on Muon: a 2-D weight that is not an embedding or the output head (by
    name), or the 3-D stacked weights of an experts module; False for
    vectors and scalars (norms, biases) and embeddings. Any other leaf of
    more than 2 dims is refused by name (say what it is with ``use_muon``).

    >>> muon_default("blocks.0.attn.qkv.weight", (96, 32)), muon_default("wte.weight", (50, 32))
    (True, False)
    >>> muon_default("layers.0.mlp.experts.down_proj", (4, 32, 64)), muon_default("ln.bias", (32,))
    (True, False)
    """
    if len(shape) < 2 or _EMBEDDINGS.search(path):
        return False
    if len(shape) == 2 or (len(shape) == 3 and _EXPERTS.search(path)):
        return True
    raise ShardingError(
        f"muon: {path!r} is {len(shape)}-D {shape}, neither a matrix nor stacked experts; say "
        "whether it takes Muon: use_muon=lambda path, shape: ... (False gives it Adam; True "
        "treats dim 0 as a stack of matrices, and needs 3 dims)"
    )


def muon_state_bytes(path: str, shape: tuple[int, ...]) -> int:
    """Optimizer-state bytes per element of the leaf at ``path`` under
    :func:`muon`'s default: 4 (the momentum) where :func:`muon_default`
    puts it on Muon, 8 (Adam's moments) elsewhere — for
    ``sx.explain(..., opt_state_bytes=muon_state_bytes)``.

    >>> muon_state_bytes("blocks.0.mlp.up.weight", (64, 16)), muon_state_bytes("wte.weight", (50, 16))
    (4, 8)
    """
    return 4 if muon_default(path, shape) else 8


def _mask(use_muon: Callable[[str, tuple[int, ...]], bool] | None) -> Callable[[Any], Any]:
    choose = muon_default if use_muon is None else use_muon

    def flags(tree: Any) -> Any:
        paths, leaves, spec = flatten_with_paths(tree, is_leaf=is_sharded, none_is_leaf=True)
        return optree.tree_unflatten(
            spec,
            [
                False if x is None else bool(choose(p, tuple(x.shape)))
                for p, x in zip(paths, leaves, strict=True)
            ],
        )

    return flags


def muon(
    learning_rate: float | Schedule,
    momentum: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: float = 0.0,
    scale: str = "moonlight",
    rms_scale: float = 0.2,
    ns_dtype: torch.dtype = torch.float32,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_learning_rate: float | Schedule | None = None,
    use_muon: Callable[[str, tuple[int, ...]], bool] | None = None,
) -> GradientTransformation:
    """Muon as Moonlight trains with it: Newton–Schulz-orthogonalized
    momentum for the matrices, AdamW for the rest, one learning rate and
    decoupled weight decay for both.

    - Matrices (``use_muon(path, shape)`` True; by default
      :func:`muon_default`: 2-D weights but embeddings and the head, and
      stacked experts): ``m = momentum * m + g``; the update is the
      orthogonalized ``g + momentum * m`` (Nesterov; ``m`` without) times
      ``rms_scale * sqrt(max(rows, cols))``, which gives it AdamW's RMS
      (``scale="spectral"``: ``sqrt(max(1, rows / cols))``, Keller Jordan's
      and DeepSpeed's, for their learning rates). Their state is the
      momentum only: 4 bytes a parameter (:func:`muon_state_bytes`).
    - The rest (norms, biases, embeddings, the head): Adam with
      ``adam_b1``, ``adam_b2``, ``adam_eps`` and bias correction.
    - Then ``-lr * (update + weight_decay * param)`` for all, ``lr`` the
      ``learning_rate`` (the Adam part's: ``adam_learning_rate``, when given).

    **Sharded.** The orthogonalization needs each matrix whole: under ZeRO
    (the momentum split over the data axes), tensor parallelism (a matrix
    split over ``tp``) and expert parallelism, the step moves the matrices
    of one shape and layout, stacked, to a layout that gives each rank whole
    matrices — spread evenly over the ranks — orthogonalizes them there and
    moves them back (:func:`orthogonalize`: an all-to-all each way where
    they were split, nothing where they were replicated but an all-gather of
    the results). Each expert of a stack is its own matrix. The result
    equals one process's Muon. A leaf that is neither a matrix nor a stack
    of them is refused by name, never stepped by Adam in silence.

    Args:
        learning_rate: a number or a schedule (step -> value).
        momentum: Muon's momentum.
        nesterov: Nesterov momentum (Moonlight's default).
        ns_steps: Newton–Schulz iterations.
        weight_decay: decoupled weight decay, for every leaf.
        scale: ``"moonlight"`` or ``"spectral"`` (above).
        rms_scale: the update's RMS Muon is scaled to (Moonlight: 0.2).
        ns_dtype: the iteration's dtype (``torch.bfloat16`` as
            ``torch.optim.Muon`` and Keller Jordan's; fp32 by default).
        adam_b1, adam_b2, adam_eps: the Adam part's.
        adam_learning_rate: the Adam part's learning rate (default:
            ``learning_rate``), as DeepSpeed's ``adam_lr``.
        use_muon: ``(path, shape) -> bool``, which leaves take Muon.

    >>> import torch, shardax as sx
    >>> params = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
    >>> opt = sx.optim.muon(0.02)
    >>> updates, state = opt.update({"w": torch.ones(4, 3), "b": torch.ones(3)}, opt.init(params), params)
    >>> updates["b"]                       # Adam: -lr * sign(g) on the first step
    tensor([-0.0200, -0.0200, -0.0200])
    >>> torch.linalg.matrix_rank(updates["w"]).item()
    1
    """
    mask = _mask(use_muon)

    def adam_mask(tree: Any) -> Any:
        return optree.tree_map(lambda f: not f, mask(tree))

    core = scale_by_muon(
        momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        scale=scale,
        rms_scale=rms_scale,
        ns_dtype=ns_dtype,
    )
    adam_lr = learning_rate if adam_learning_rate is None else adam_learning_rate
    return chain(
        masked(chain(core, add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate)), mask),
        masked(chain(scale_by_adam(adam_b1, adam_b2, adam_eps), add_decayed_weights(weight_decay),
                     scale_by_learning_rate(adam_lr)), adam_mask),
    )  # fmt: skip
