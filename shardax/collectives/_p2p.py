"""Point to point: :func:`send` and :func:`recv` between two members of a
mesh axis — what a pipeline moves between its stages.

Unlike the collectives, only the two ranks take part, so neither counts as
a collective of the group (the group's collective numbers stay in step on
every member) and no signature is agreed. Messages between two members
match per ``tag`` in the order they were sent (on NCCL, which has no tags,
in order); a pipeline gives each message its own tag. Not differentiable:
a pipeline sends activations forward and their gradients back itself.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CollectiveError, CollectiveTimeoutError
from ..mesh._groups import Group
from ..mesh._mesh import Mesh
from ._api import Axis, _group
from ._backend import Handle, comm_of
from ._failures import _is_timeout
from ._traffic import counting, timed

__all__ = ["recv", "send"]


class _Work:
    """One backend work of a send or receive, its failure named."""

    __slots__ = ("what", "work")

    def __init__(self, work: Any, what: str) -> None:
        self.work, self.what = work, what

    def is_completed(self) -> bool:
        done = getattr(self.work, "is_completed", None)
        return True if done is None else bool(done())

    def wait(self) -> None:
        try:
            self.work.wait()
        except CollectiveError:
            raise
        except Exception as err:
            if _is_timeout(err):
                raise CollectiveTimeoutError(
                    f"{self.what} did not complete within the timeout ({err}). The peer never "
                    "posted the matching receive or send: it died, is stuck elsewhere, or runs "
                    "another order (for a pipeline: pipeline.validate the schedule)."
                ) from err
            raise CollectiveError(f"{self.what} failed: {err}") from err


def _p2p(
    x: torch.Tensor, axis: Axis, peer: int, tag: int, mesh: Mesh | None, sending: bool
) -> Handle:
    what = "send" if sending else "recv"
    group: Group = _group(axis, mesh, what)
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise CollectiveError(f"{what} over {group.label}: tag is an int >= 0; got {tag!r}")
    if not 0 <= peer < group.size or peer == group.index:
        raise CollectiveError(
            f"{what} over {group.label}: the peer is another member's index in "
            f"0..{group.size - 1} (this rank is member {group.index}); got {peer!r}"
        )
    if not x.is_contiguous():
        raise CollectiveError(f"{what} over {group.label}: the tensor must be contiguous")
    label = (
        f"{what} {'to' if sending else 'from'} member {peer} (rank {group.members[peer]}) over "
        f"{group.label}, tag {tag}, {x.dtype} {tuple(x.shape)}, on rank {group.rank}"
    )
    comm = comm_of(group)
    backend = counting(comm.backend, group, what)
    pairs = [(peer, x.detach())]
    try:
        pending = backend.send_recv(pairs if sending else [], [] if sending else pairs, group, tag)
    except CollectiveError:
        raise
    except Exception as err:
        raise CollectiveError(f"{label} failed: {err}") from err
    pending.works = [_Work(w, label) for w in pending.works]  # its loans stay as they are
    return Handle(group, what, comm.seq, pending, timed(lambda: x, group, what))


def send(
    x: torch.Tensor,
    axis: Axis,
    dst: int,
    *,
    tag: int = 0,
    mesh: Mesh | None = None,
    async_op: bool = False,
) -> Any:
    """Send ``x`` to member ``dst`` along ``axis``, which receives it with
    :func:`recv` (same ``tag``). Returns None when sent (``async_op=True``:
    a :class:`Handle`; keep ``x`` unchanged until its ``wait()``). Only the
    two ranks take part.

    >>> import torch, shardax as sx
    >>> sx.collectives.send(torch.ones(2), "pp", 1, mesh=sx.Mesh({"pp": 1}))
    Traceback (most recent call last):
    ...
    shardax.errors.CollectiveError: send over axis 'pp' of Mesh({'pp': 1}): the peer is another member's index in 0..0 (this rank is member 0); got 1
    """
    handle = _p2p(x, axis, dst, tag, mesh, sending=True)
    if async_op:
        return handle
    handle.wait()
    return None


def recv(
    out: torch.Tensor,
    axis: Axis,
    src: int,
    *,
    tag: int = 0,
    mesh: Mesh | None = None,
    async_op: bool = False,
) -> Any:
    """Receive into ``out`` what member ``src`` along ``axis`` sends with
    :func:`send` (same ``tag``; ``out`` shaped and typed as the sent
    tensor). Returns ``out`` (``async_op=True``: a :class:`Handle` whose
    ``wait()`` returns it).

    >>> import torch, shardax as sx
    >>> sx.collectives.recv(torch.empty(2), "pp", 0, tag=-1, mesh=sx.Mesh({"pp": 1}))
    Traceback (most recent call last):
    ...
    shardax.errors.CollectiveError: recv over axis 'pp' of Mesh({'pp': 1}): tag is an int >= 0; got -1
    """
    handle = _p2p(out, axis, src, tag, mesh, sending=False)
    return handle if async_op else handle.wait()
