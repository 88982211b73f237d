"""Randomness under sharding (dropout and the like).

Ranks that hold replicas of a value must draw the same random numbers for
it, or the replicas drift apart; ranks that hold different pieces of a
value must draw different ones, or the pieces' masks are copies of each
other. Two tools, both reproducible from one seed:

- :func:`manual_seed` seeds torch's generator so that ranks differing along
  ``vary`` (the data axes) get different streams and all others the same;
- a :class:`ModuleRule` with ``rng=axes`` runs its modules (the regions a
  tensor-parallel axis splits) on a stream forked per index along ``axes``,
  then returns to the shared stream, advanced the same on every rank; one
  with ``rejoin=True`` returns to the shared stream early, after its module
  (where a region's activations become replicas again).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from ..mesh._mesh import AbstractMesh, normalize_axes

__all__ = ["Streams", "manual_seed"]


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


class Streams:
    """The random streams of one :func:`shardax.apply` call: regions run on
    a stream forked per index along their axes (:meth:`fork` gives the
    forward pre- and post-hook), and a region may *rejoin* the shared stream
    before it ends (:meth:`rejoin`, a forward hook on the module after which
    its activations are replicas again — a row-parallel linear's summed
    output, say, that GPT-2's residual dropout follows inside its attention
    module).

    The pre-hook draws one number from the shared stream (the same draw on
    every rank), keeps the shared state and seeds from that draw and the
    index; the post-hook puts the shared state back — unless the region
    rejoined it, and then the shared stream simply goes on.
    """

    def __init__(self, mesh: AbstractMesh) -> None:
        self.mesh = mesh
        self.stack: list[list[Any]] = []  # [cpu state, cuda states, rejoined]

    def fork(self, axes: tuple[str, ...]) -> tuple[Callable[..., None], Callable[..., None]]:
        def pre(module: Any, args: Any) -> None:
            draw = int(torch.randint(0, 1 << 62, (1,)).item())
            cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
            self.stack.append([torch.get_rng_state(), cuda, False])
            torch.manual_seed(_mix(draw, self.mesh.axis_index(axes)))

        def post(module: Any, args: Any, output: Any) -> None:
            state, cuda, rejoined = self.stack.pop()
            if not rejoined:
                _restore(state, cuda)

        return pre, post

    def rejoin(self, module: Any, args: Any, output: Any) -> None:
        if self.stack and not self.stack[-1][2]:
            _restore(self.stack[-1][0], self.stack[-1][1])
            self.stack[-1][2] = True


def _restore(state: torch.Tensor, cuda: list[torch.Tensor]) -> None:
    torch.set_rng_state(state)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
