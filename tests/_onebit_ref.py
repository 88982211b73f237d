"""The plain single-process pieces the 1-bit optimizers' tests compare
with: 1-bit averaging written out (:func:`simulate_pmean`), each rank's
gradient of the small model of ``_zero_net``, a learnable task and its
held-out loss, and ``torch.optim.AdamW`` trained on it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from _zero_net import BATCH, BETAS, EPS, LR, VOCAB, WD, Net

import shardax as sx
from shardax.collectives._onebit import onebit_chunk


def _compress(v: torch.Tensor, real: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, sign, error)`` of flat ``v``, of which the first ``real``
    elements count: the RMS of those, their signs (zero is +), and what
    ``scale * sign`` misses of them (zero elsewhere)."""
    scale = torch.linalg.vector_norm(v[:real]) / math.sqrt(real) if real else torch.tensor(0.0)
    sign = torch.where(v >= 0, 1.0, -1.0)
    error = v - scale * sign
    error[real:] = 0.0
    return scale, sign, error


def simulate_pmean(xs: list, workers: list, servers: list) -> tuple:
    """One call of 1-bit averaging for all ranks at once: ``(mean, workers,
    servers)``, the errors one per rank."""
    world, shape, n = len(xs), xs[0].shape, xs[0].numel()
    chunk = onebit_chunk(n, world)
    signs, scales, new_workers = [], [], []
    for x, w in zip(xs, workers, strict=True):  # each rank compresses its whole tensor
        scale, sign, error = _compress(x.reshape(-1) + w.reshape(-1), n)
        signs.append(torch.cat([sign, torch.ones(world * chunk - n)]).view(world, chunk))
        scales.append(scale)
        new_workers.append(error.view(shape))
    pieces, new_servers = [], []
    for j in range(world):  # rank j, the server of chunk j, gets it from every rank
        real = max(0, min(chunk, n - j * chunk))
        rows = torch.stack([sign[j] for sign in signs])
        average = (rows * (torch.stack(scales).view(world, 1) / world)).sum(0)
        average[real:] = 0.0  # the padding
        scale, sign, error = _compress(average + servers[j], real)
        new_servers.append(error)
        pieces.append(scale * sign)
    mean = torch.cat(pieces)[:n].view(shape)  # all-gathered
    return mean, new_workers, new_servers


def local_grads(model: Net, params: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """The loss of this rank's batch and its gradient (not divided by anything)."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    logits = torch.func.functional_call(model, leaves, (x,))
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), dict(zip(leaves, grads, strict=True))


def first_params() -> tuple[Net, dict]:
    torch.manual_seed(0)
    model = Net()
    return model, {k: v.detach().clone() for k, v in sx.params_of(model).items()}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the ranks have (the same float results for
    the same operations; and the fastest for this small model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def task_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task for the small model: the next token is ``3x + 1 mod
    VOCAB`` most of the time, a random one otherwise (a loss floor > 0)."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (BATCH, 6), generator=g)
    noise = torch.randint(0, VOCAB, x.shape, generator=g)
    keep = torch.rand(x.shape, generator=g) < 0.7
    return x, torch.where(keep, (3 * x + 1) % VOCAB, noise)


def eval_loss(params: dict) -> float:
    model, _ = first_params()
    losses = []
    for step in range(10_000, 10_008):  # held-out batches
        x, y = task_batch(step)
        logits = torch.func.functional_call(model, params, (x,))
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


@one_thread()
def adamw_train(steps: int) -> dict:
    model, _ = first_params()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(steps):
        x, y = task_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in sx.params_of(model).items()}
