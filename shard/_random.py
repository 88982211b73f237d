"""Randomness under sharding (dropout and the like).

Ranks that hold replicas of a value must draw the same random numbers for
it, or the replicas drift apart; ranks that hold different pieces of a
value must draw different ones, or the pieces' masks are copies of each
other. Two tools, both reproducible from one seed:

- :func:`manual_seed` seeds torch's generator so that ranks differing along
  ``vary`` (the data axes) get different streams and all others the same;
- a :class:`ModuleRule` with ``rng=axes`` runs its modules (the regions a
  tensor-parallel axis splits) on a stream forked per index along ``axes``,
  then returns to the shared stream, advanced the same on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from ..mesh._mesh import AbstractMesh, normalize_axes

__all__ = ["fork_hooks", "manual_seed"]


def _mix(*values: int) -> int:
    digest = hashlib.sha256(repr(values).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def manual_seed(seed: int, mesh: AbstractMesh, vary: Any = ()) -> int:
    """Seed torch's generators (CPU and CUDA) so that ranks whose indices
    along the axes ``vary`` differ draw different numbers, and ranks that
    differ only along other axes (tensor-parallel replicas) the same —
    reproducibly from ``seed``. Returns the seed used on this rank.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> s = sx.manual_seed(0, mesh, vary="dp")
    >>> a = torch.rand(2); _ = sx.manual_seed(0, mesh, vary="dp"); torch.equal(a, torch.rand(2))
    True
    """
    axes = normalize_axes(vary)
    index = mesh.axis_index(axes) if axes else 0
    used = int(seed) if not axes else _mix(int(seed), index)
    torch.manual_seed(used)
    return used


def fork_hooks(
    mesh: AbstractMesh, axes: tuple[str, ...]
) -> tuple[Callable[..., None], Callable[..., None]]:
    """A forward pre-hook and post-hook that run a module on a stream of its
    own for this rank's index along ``axes``: the pre-hook draws one number
    from the shared stream (the same draw on every rank), keeps the shared
    state, and seeds from that draw and the index; the post-hook puts the
    shared state back."""
    stack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def pre(module: Any, args: Any) -> None:
        draw = int(torch.randint(0, 1 << 62, (1,)).item())
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        stack.append((torch.get_rng_state(), cuda))
        torch.manual_seed(_mix(draw, mesh.axis_index(axes)))

    def post(module: Any, args: Any, output: Any) -> None:
        state, cuda = stack.pop()
        torch.set_rng_state(state)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)

    return pre, post
