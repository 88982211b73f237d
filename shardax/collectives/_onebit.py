"""1-bit compressed averaging with error feedback: the collective of 1-bit
Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed"), as DeepSpeed's
``compressed_allreduce`` runs it.

Each rank adds its *worker error* to its tensor and sends it as one bit per
element (its sign) and one fp32 scale, the root mean square. The tensor is
cut in one chunk per rank; rank ``j`` is the "server" of chunk ``j``: an
all-to-all brings it everyone's compressed chunk ``j``, it averages them,
adds its *server error*, compresses the average the same way, and an
all-gather of the compressed chunks gives every rank the whole average.
What is lost to compression at each of the two stages is kept (the new
errors) and added back the next call, so it is delayed, not dropped.

Signs travel packed 8 to a byte (``uint8``, first element in the high bit,
as ``numpy.packbits``), each row followed by the four bytes of its scale: one
all-to-all and one all-gather of ``world * (chunk / 8 + 4)`` bytes each,
about 1/32 of the fp32 tensor, counted by
:func:`~shardax.collectives.traffic` as ``all_to_all`` and ``all_gather``
over the axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import CollectiveError
from ..mesh._groups import Group
from ..mesh._mesh import Mesh
from ._api import Axis, _group, all_gather, all_to_all

__all__ = ["onebit_chunk", "onebit_errors", "onebit_pmean", "onebit_pmean_many"]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def onebit_chunk(numel: int, size: int) -> int:
    """The length of each rank's chunk when ``numel`` elements are averaged
    over ``size`` ranks: ``numel / size`` rounded up to a multiple of 8 (whole
    bytes of signs). It is the server error's length.

    >>> onebit_chunk(10, 2), onebit_chunk(16, 2), onebit_chunk(17, 2), onebit_chunk(0, 4)
    (8, 8, 16, 0)
    """
    return 8 * math.ceil(numel / (8 * size)) if numel else 0


def onebit_errors(
    x: torch.Tensor, axis: Axis, *, mesh: Mesh | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero error buffers for :func:`onebit_pmean` of tensors like ``x`` over
    ``axis``: ``(worker_error, server_error)``, the worker error shaped like
    ``x``, the server error 1-d of :func:`onebit_chunk` elements (this rank's
    chunk), both fp32 on ``x``'s device.

    >>> import torch, shardax as sx
    >>> w, s = onebit_errors(torch.ones(3, 5), "dp", mesh=sx.Mesh({"dp": 1}))
    >>> w.shape, s.shape
    (torch.Size([3, 5]), torch.Size([16]))
    """
    group = _group(axis, mesh, "onebit_errors")
    server = torch.zeros(onebit_chunk(x.numel(), group.size), device=x.device)
    return torch.zeros(x.shape, device=x.device), server


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """``(rows, c)`` bools → ``(rows, c / 8)`` uint8, first element high."""
    rows = bits.shape[0]
    weights = _BITS.to(bits.device)
    return (bits.view(rows, -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def _signs(packed: torch.Tensor) -> torch.Tensor:
    """``(rows, c / 8)`` uint8 → ``(rows, c)`` fp32 of ±1."""
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(packed.shape[0], -1).to(torch.float32).mul_(2.0).sub_(1.0)


def _compress(v: torch.Tensor, real: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bits, scale, error)`` of 1-d ``v`` whose first ``real`` elements
    count: bit ``v >= 0`` (+1, zero included, as DeepSpeed), scale the RMS of
    the real elements, error ``v - scale * sign`` there and 0 on the rest."""
    head = v[:real]
    scale = torch.linalg.vector_norm(head) / math.sqrt(real) if real else v.new_zeros(())
    bits = v >= 0
    error = torch.zeros_like(v)
    error[:real] = head - scale * (bits[:real].to(v.dtype) * 2.0 - 1.0)
    return bits, scale, error


def _rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each row of packed signs followed by the four bytes of its scale."""
    tail = scales.reshape(-1, 1).contiguous().view(torch.uint8)
    return torch.cat([packed, tail.expand(packed.shape[0], 4)], dim=1)


def _unrow(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(signs (rows, c), scales (rows, 1))`` of what :func:`_rows` made."""
    scales = rows[:, -4:].contiguous().view(torch.float32)
    return _signs(rows[:, :-4]), scales


def _check(x: torch.Tensor, worker: torch.Tensor, server: torch.Tensor, group: Group) -> int:
    """The chunk length, once ``x`` and its error buffers are checked."""
    where = f"onebit_pmean over {group.label}"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
        raise CollectiveError(f"{where}: x is {got}; 1-bit averaging takes fp32 (pass x.float())")
    chunk = onebit_chunk(x.numel(), group.size)
    wants = {
        "worker_error": (worker, tuple(x.shape), "the worker error is shaped like x"),
        "server_error": (server, (chunk,), f"the server error is this rank's chunk of {chunk}"),
    }
    for name, (buf, shape, why) in wants.items():
        if isinstance(buf, torch.Tensor):
            got = f"{buf.dtype} of shape {tuple(buf.shape)} on {buf.device}"
            if (tuple(buf.shape), buf.dtype, buf.device) == (shape, torch.float32, x.device):
                continue
        else:
            got = type(buf).__name__
        raise CollectiveError(
            f"{where}: {name} is {got}; for x of shape {tuple(x.shape)} averaged over "
            f"{group.size} rank(s) it must be float32 of shape {shape} on {x.device} ({why}): "
            "make the buffers with onebit_errors(x, axis, mesh=mesh), then pass back the "
            "ones each call returns"
        )
    return chunk


@torch.no_grad()
def onebit_pmean(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    axis: Axis,
    *,
    mesh: Mesh | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean of ``x`` over the ranks along ``axis``, sent as signs and
    scales with error feedback: ``(mean, new_worker_error, new_server_error)``.

    Every rank passes a fp32 ``x`` of the same shape (any shape; it is read
    flat) and its own error buffers, and gets the same ``mean``, an
    approximation of ``pmean(x)`` whose error is carried in the new buffers
    to the next call (pass them back then). Algorithm (DeepSpeed's
    ``compressed_allreduce``, Tang et al. 2021):

    1. ``v = x + worker_error``; compress: ``scale = ||v||_2 / sqrt(n)``,
       ``c(v) = scale * sign(v)`` (zero counts as +); the new worker error is
       ``v - c(v)``.
    2. Cut the flat signs in ``size`` chunks of :func:`onebit_chunk`
       elements; an all-to-all sends chunk ``j`` (packed, with the scale) to
       rank ``j``, which averages the ``size`` decompressed chunks, adds its
       server error and compresses that the same way (its scale over the
       chunk); the new server error is what that loses.
    3. An all-gather of the compressed chunks; every rank decompresses them.

    **Padding.** The flat tensor is padded with zeros at its end to
    ``size * chunk`` elements, so the padding falls in the last chunks. The
    padded elements are exact zeros throughout: left out of every scale,
    decompressed as 0, carrying no error, and cut off the result.
    (DeepSpeed lets its padding take part — it decompresses to ``±scale`` and
    keeps an error — which changes the scales; for a tensor whose length
    divides by ``8 * size`` the two are the same.)

    **Error buffers** (:func:`onebit_errors` makes zero ones): the worker
    error is shaped like ``x`` and differs from rank to rank; the server error
    is 1-d, this rank's chunk (:func:`onebit_chunk` elements; zero where the
    chunk is padding). They belong to one tensor and one axis: keep a pair per
    tensor averaged.

    A size-1 axis moves nothing and compresses nothing: ``mean`` is a copy of
    ``x``, the errors come back as they were. Not differentiable (a sign has no
    useful gradient); runs under ``no_grad``.

    Args:
        x: this rank's fp32 tensor.
        worker_error: this rank's worker error, shaped like ``x``.
        server_error: this rank's server error, ``(onebit_chunk(x.numel(), size),)``.
        axis: a mesh axis or a tuple of axes (one axis of their combined size).
        mesh: the mesh (default: the one of the innermost ``with mesh:``).

    Raises:
        CollectiveError: ``x`` not fp32, or error buffers of the wrong shape,
            dtype or device (the message names the shape they need).

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> x = torch.tensor([0.5, -2.0, 1.0])
    >>> worker, server = onebit_errors(x, "dp", mesh=mesh)
    >>> mean, worker, server = onebit_pmean(x, worker, server, "dp", mesh=mesh)
    >>> mean                      # one rank: nothing to average, nothing lost
    tensor([ 0.5000, -2.0000,  1.0000])
    """
    group = _group(axis, mesh, "onebit_pmean")
    means, workers, servers = _pmean([x], [worker_error], [server_error], group, axis, mesh)
    return means[0], workers[0], servers[0]


@torch.no_grad()
def onebit_pmean_many(
    xs: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    axis: Axis,
    *,
    mesh: Mesh | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """:func:`onebit_pmean` of each tensor of ``xs`` — each with its own
    scales and error buffers, the same numbers as one call each — in one
    all-to-all and one all-gather for them all (their rows side by side):
    what an optimizer averaging every parameter's momentum wants, where the
    latency of two collectives per tensor would dominate.
    ``(means, worker_errors, server_errors)``, lists in the order of ``xs``.

    >>> import torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> xs = [torch.ones(3), torch.zeros(2, 2)]
    >>> workers, servers = zip(*(onebit_errors(x, "dp", mesh=mesh) for x in xs))
    >>> means, workers, servers = onebit_pmean_many(xs, workers, servers, "dp", mesh=mesh)
    >>> [m.shape for m in means]
    [torch.Size([3]), torch.Size([2, 2])]
    """
    if not len(xs) == len(worker_errors) == len(server_errors):
        raise CollectiveError(
            f"onebit_pmean_many: {len(xs)} tensors, {len(worker_errors)} worker errors and "
            f"{len(server_errors)} server errors; pass one of each per tensor"
        )
    group = _group(axis, mesh, "onebit_pmean_many")
    return _pmean(list(xs), list(worker_errors), list(server_errors), group, axis, mesh)


def _pmean(
    xs: list[torch.Tensor],
    workers: list[torch.Tensor],
    servers: list[torch.Tensor],
    group: Group,
    axis: Axis,
    mesh: Mesh | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The algorithm of :func:`onebit_pmean` for each of ``xs`` at once; the
    rows of the tensors (packed signs, then the scale) lie side by side in
    the two collectives."""
    chunks = [_check(x, w, s, group) for x, w, s in zip(xs, workers, servers, strict=True)]
    size = group.size
    moving = [i for i, x in enumerate(xs) if x.numel() and size > 1]
    means = [x if i in moving else x.clone() for i, x in enumerate(xs)]  # the moving ones: below
    if not moving:
        return means, list(workers), list(servers)
    # 1. each rank compresses its tensors; row j of each goes to rank j
    sent = []
    for i in moving:
        x, n, chunk = xs[i], xs[i].numel(), chunks[i]
        bits, scale, error = _compress(x.reshape(-1) + workers[i].reshape(-1), n)
        workers[i] = error.view(x.shape)
        padded = torch.zeros(size * chunk, dtype=torch.bool, device=x.device)
        padded[:n] = bits
        sent.append(_rows(_pack(padded.view(size, chunk)), scale.expand(size)))
    rows = torch.cat(sent, dim=1).unsqueeze(1)
    got = all_to_all(rows, axis, 0, 1, concat_sizes=(1,) * size, mesh=mesh).squeeze(0)
    # 2. this rank, the server of its chunk of each, averages and compresses again
    mine = []
    for i, piece in zip(moving, _split(got, [chunks[i] for i in moving]), strict=True):
        chunk, n = chunks[i], xs[i].numel()
        signs, scales = _unrow(piece)
        real = max(0, min(chunk, n - group.index * chunk))  # the chunk's elements of x
        average = (signs * (scales / size)).sum(0)
        average[real:] = 0.0
        bits, scale, servers[i] = _compress(average + servers[i], real)
        mine.append(_rows(_pack(bits.view(1, chunk)), scale.reshape(1)))
    # 3. every rank gathers the compressed chunks of each
    gathered = all_gather(torch.cat(mine, dim=1), axis, 0, sizes=(1,) * size, mesh=mesh)
    for i, piece in zip(moving, _split(gathered, [chunks[i] for i in moving]), strict=True):
        signs, scales = _unrow(piece)
        means[i] = (signs * scales).reshape(-1)[: xs[i].numel()].reshape(xs[i].shape)
    return means, workers, servers


def _split(rows: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, ...]:
    """The side-by-side rows of tensors with these chunk lengths."""
    return rows.split([c // 8 + 4 for c in chunks], dim=1)
