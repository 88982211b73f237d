"""A tiny transformer-shaped model with dropout everywhere Megatron's rules
treat differently — on the features tp splits, on a region's summed
output (a replica again), on the residual stream — and the names that
split it (``NAMES``: its MLP a region over ``tp``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardax as sx

DIM, HIDDEN, VOCAB = 8, 32, 16
NAMES = sx.rules.TransformerNames(
    column=r"blocks\.\d+\.mlp\.fc",
    row=r"blocks\.\d+\.mlp\.proj",
    vocab=r"emb",
    head=r"head",
    regions=r"blocks\.\d+\.mlp",
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, HIDDEN)
        self.drop = nn.Dropout(0.5)  # on features tp splits
        self.proj = nn.Linear(HIDDEN, DIM)
        self.resid = nn.Dropout(0.5)  # on the summed output: a replica again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid(self.proj(self.drop(F.gelu(self.fc(x)))))


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
