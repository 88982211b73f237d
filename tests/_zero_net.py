"""The small tied-embedding model the ZeRO training tests share, its
batches, and its single-process PyTorch AdamW run (the reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardax as sx

VOCAB, DIM, SEQ, BATCH = 13, 10, 6, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM)
        self.down = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def reference(steps: int) -> tuple[list[float], list[dict], dict]:
    """The single-process PyTorch run: same init, same global batches."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: v.clone() for k, v in sx.params_of(model).items()}


def _loss(params, model, x, y):
    return F.cross_entropy(sx.apply(model, params, x).flatten(0, 1), y.flatten())


def traced_adamw_steps(mesh, rules, axes, steps: int):
    """``steps`` AdamW steps of :class:`Net` (built on meta, initialised as
    the reference) under ``rules``, the global batch split over ``axes``:
    the losses, each step's gathered gradients and traffic log, the final
    params (still sharded) and the last step's gradients."""
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, rules)
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    opt_state = opt.init(params)
    n, i = mesh.size(axes), mesh.axis_index(axes)
    losses, grads, moved, g = [], [], [], None
    for step in range(steps):
        x, y = batch(step)
        local = slice(i * BATCH // n, (i + 1) * BATCH // n)
        with sx.collectives.traffic() as t:
            loss, g = sx.value_and_grad(_loss)(params, model, x[local], y[local])
        moved.append(dict(t.bytes))
        grads.append(sx.gather(g))
        updates, opt_state = opt.update(g, opt_state, params)
        params = sx.optim.apply_updates(params, updates)
        losses.append(loss.item())
    return losses, grads, moved, params, g


def assert_matches(losses, grads, params, ref_losses, ref_grads, ref_params) -> None:
    """One run's losses, per-step gradients and final params equal the
    reference's: 1e-5 relative (the sums of another order, over 5 steps)."""
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for g, rg in zip(grads, ref_grads, strict=True):
        for k in rg:
            torch.testing.assert_close(g[k], rg[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-5, msg=k)
