"""Randomness under sharding, on real ranks: dropout in replicated regions
draws the same mask on every tp rank (replicas stay equal), inside the
regions tp splits a different one per tp rank, across dp ranks different
ones — and the whole run is reproducible from its seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import shardax as sx

DIM, HIDDEN, VOCAB = 8, 32, 16
NAMES = sx.rules.TransformerNames(
    column=r"blocks\.\d+\.mlp\.fc",
    row=r"blocks\.\d+\.mlp\.proj",
    regions=r"blocks\.\d+\.mlp",
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, HIDDEN)
        self.drop = nn.Dropout(0.5)  # on features tp splits
        self.proj = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.drop(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.drop = nn.Dropout(0.5)  # on the replicated residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run(shape: dict[str, int], seed: int) -> dict:
    mesh = sx.Mesh(shape)
    rules = sx.rules.megatron("tp", names=NAMES)
    torch.manual_seed(0)
    model = Net()
    params = sx.shard(sx.params_of(model), mesh, rules)
    sx.manual_seed(seed, mesh, vary="dp" if "dp" in shape else ())
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, out):
            seen[name] = (out != 0).flatten()

        return hook

    hooks = [
        model.blocks[0].mlp.drop.register_forward_hook(keep("split")),
        model.blocks[0].drop.register_forward_hook(keep("replicated")),
        model.blocks[1].register_forward_hook(
            lambda m, a, out: seen.__setitem__("stream", out.detach())
        ),
    ]
    x = torch.arange(12).reshape(2, 6) % VOCAB
    loss, _ = sx.value_and_grad(
        lambda p: F.cross_entropy(sx.apply(model, p, x, rules=rules).flatten(0, 1), x.flatten())
    )(params)
    for h in hooks:
        h.remove()
    after = torch.rand(3)  # the shared stream after the step
    return {**seen, "loss": loss.item(), "after": after}


@pytest.mark.world_size(4)
def test_dropout_is_shared_where_replicated_and_split_where_sharded():
    results = run_ranks(run, {"dp": 2, "tp": 2}, 7, world_size=4)
    by = {(r // 2, r % 2): res for r, res in enumerate(results)}  # (dp index, tp index)
    for d in (0, 1):
        a, b = by[(d, 0)], by[(d, 1)]
        assert torch.equal(a["replicated"], b["replicated"])  # replicas draw alike...
        assert torch.equal(a["stream"], b["stream"])  # ...so they stay equal
        assert torch.equal(a["after"], b["after"])  # and the shared stream goes on alike
        assert not torch.equal(a["split"], b["split"])  # pieces draw their own
    assert not torch.equal(by[(0, 0)]["replicated"], by[(1, 0)]["replicated"])  # dp ranks differ
    again = run_ranks(run, {"dp": 2, "tp": 2}, 7, world_size=4)
    for first, second in zip(results, again, strict=True):  # reproducible from the seed
        assert all(torch.equal(first[k], second[k]) for k in ("split", "replicated", "stream"))
        assert first["loss"] == second["loss"]
    other = run_ranks(run, {"dp": 2, "tp": 2}, 8, world_size=4)
    assert not torch.equal(other[0]["split"], results[0]["split"])
