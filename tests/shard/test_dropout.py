"""Randomness under sharding, on real ranks: dropout in replicated regions
draws the same mask on every tp rank (replicas stay equal) — also inside a
region after its row-parallel output, where GPT-2 puts its residual
dropout — inside the regions tp splits a different one per tp rank, across
dp ranks different ones; under sequence parallelism every dropout differs
per tp rank (each holds other positions) — and the whole run is
reproducible from its seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _dropout import NAMES, VOCAB, Net

import shardax as sx


def run(shape: dict[str, int], seed: int, sp: bool = False) -> dict:
    mesh = sx.Mesh(shape)
    rules = sx.rules.megatron("tp", sequence_parallel=sp, names=NAMES)
    torch.manual_seed(0)
    model = Net()
    params = sx.shard(sx.params_of(model), mesh, rules)
    sx.manual_seed(seed, mesh, vary="dp" if "dp" in shape else ())
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, out):
            seen[name] = torch.stack([out == 0, args[0] != 0]).flatten(1)  # dropped, counted

        return hook

    hooks = [
        model.blocks[0].mlp.drop.register_forward_hook(keep("split")),
        model.blocks[0].mlp.resid.register_forward_hook(keep("resid")),
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


def same(a: dict, b: dict, key: str) -> bool:
    """Whether two ranks' dropout masks agree where both inputs are nonzero
    (an input that is already zero shows no mask)."""
    (drop_a, counted_a), (drop_b, counted_b) = a[key], b[key]
    both = counted_a & counted_b
    return torch.equal(drop_a[both], drop_b[both])


@pytest.mark.world_size(4)
def test_dropout_is_shared_where_replicated_and_split_where_sharded():
    results = run_ranks(run, {"dp": 2, "tp": 2}, 7, world_size=4)
    by = {(r // 2, r % 2): res for r, res in enumerate(results)}  # (dp index, tp index)
    for d in (0, 1):
        a, b = by[(d, 0)], by[(d, 1)]
        assert same(a, b, "replicated")  # replicas draw alike...
        assert same(a, b, "resid")  # (a region's summed output is one)
        assert torch.equal(a["stream"], b["stream"])  # ...so they stay equal
        assert torch.equal(a["after"], b["after"])  # and the shared stream goes on alike
        assert not same(a, b, "split")  # pieces draw their own
    assert not same(by[(0, 0)], by[(1, 0)], "replicated")  # dp ranks differ
    again = run_ranks(run, {"dp": 2, "tp": 2}, 7, world_size=4)
    for first, second in zip(results, again, strict=True):  # reproducible from the seed
        keys = ("split", "resid", "replicated", "stream")
        assert all(torch.equal(first[k], second[k]) for k in keys)
        assert first["loss"] == second["loss"]
    other = run_ranks(run, {"dp": 2, "tp": 2}, 8, world_size=4)
    assert not torch.equal(other[0]["split"], results[0]["split"])


@pytest.mark.world_size(2)
def test_sequence_parallel_dropout_differs_per_piece():
    a, b = run_ranks(run, {"tp": 2}, 7, True, world_size=2)
    for key in ("split", "resid", "replicated"):  # every activation is split over tp
        assert a[key].shape == b[key].shape
        assert not same(a, b, key), key
    assert torch.equal(a["after"], b["after"])  # the shared stream goes on alike
    again = run_ranks(run, {"tp": 2}, 7, True, world_size=2)
    assert torch.equal(again[0]["resid"], a["resid"]) and again[0]["loss"] == a["loss"]
