"""Statistics over whole sharded pytrees, on real ranks: the global norm
counts each element once whatever the layout (replicated, sharded, uneven,
empty shards, 2-axis meshes, several meshes), clipping uses it, and a
non-finite value on one rank skips the step on every rank."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import Layout, P, optim


def _dense_tree(world_size: int) -> dict[str, tuple[torch.Tensor, str, P]]:
    """name -> (dense value, mesh name, spec)."""
    g = torch.Generator().manual_seed(7)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    tree = {
        "rep": (t(3, 4), "main", P()),
        "dp_uneven": (t(5, 3), "main", P("dp")),
        "mostly_empty": (t(1, 3), "main", P("dp")),
        "empty": (t(0, 3), "main", P("dp")),
    }
    if world_size == 4:
        tree |= {
            "dp_tp": (t(5, 3), "main", P("dp", "tp")),
            "tp_only": (t(4, 6), "main", P(None, "tp")),
            "four_way": (t(5, 3), "main", P(("dp", "tp"))),  # 2, 2, 1, 0 rows
            "other_mesh": (
                t(
                    7,
                ),
                "view",
                P("z"),
            ),
        }
    return tree


def _meshes(world_size: int) -> dict[str, sx.Mesh]:
    main = sx.Mesh({"dp": 2, "tp": 2} if world_size == 4 else {"dp": world_size})
    return {"main": main, "view": main.view({"z": world_size})}


def _norms(world_size: int) -> dict:
    meshes = _meshes(world_size)
    tree = {k: sx.shard(v, meshes[m], spec) for k, (v, m, spec) in _dense_tree(world_size).items()}
    plain = torch.arange(4.0)  # a plain tensor, identical on every rank: counted as it is
    tree["plain"] = plain
    norm = optim.global_norm(tree)
    clipped, _ = optim.clip_by_global_norm(1.0).update(tree, optim.EmptyState())
    bf16 = {k: v.with_local(v.local.to(torch.bfloat16)) for k, v in tree.items() if k != "plain"}
    return {
        "norm": norm,
        "clipped": sx.gather(clipped),
        "bf16": optim.global_norm(bf16),
        "layouts": all(clipped[k].layout == tree[k].layout for k in tree if k != "plain"),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_global_norm_counts_every_element_once(world_size):
    results = run_ranks(_norms, world_size, world_size=world_size)
    dense = {k: v for k, (v, _, _) in _dense_tree(world_size).items()}
    dense["plain"] = torch.arange(4.0)
    expected = torch.sqrt(sum((v.double() ** 2).sum() for v in dense.values())).float()
    bf16 = torch.sqrt(
        sum((v.bfloat16().double() ** 2).sum() for k, v in dense.items() if k != "plain")
    ).float()
    coef = min(1.0, 1.0 / (float(expected) + 1e-6))
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["norm"], expected, rtol=1e-6, atol=0, msg=f"rank {rank}")
        torch.testing.assert_close(r["bf16"], bf16, rtol=1e-6, atol=0, msg=f"rank {rank} bf16")
        assert r["layouts"]
        for k, v in dense.items():
            torch.testing.assert_close(r["clipped"][k], v * coef, msg=f"rank {rank}: {k}")
    assert float(expected) > 1.0  # so clipping did something


def _loss_scale_agreement() -> dict:
    """Only rank 1's shard overflows at step 1: both ranks must skip it."""
    mesh = sx.Mesh({"dp": -1})
    params = sx.shard(torch.ones(4), mesh, P("dp"))
    opt = optim.sgd(0.5)
    state = opt.init(params)
    ls = optim.DynamicLossScale(8.0, growth_interval=2)
    history = []
    for step in range(4):
        grads = torch.full((4,), float(step + 1)) * ls.scale  # as backward of the scaled loss
        if step == 1:
            grads[3] = float("inf")  # rank 1 holds elements 2 and 3
        grads, ls = ls.unscale_and_adjust(sx.shard(grads, mesh, P("dp")))
        history.append((ls.finite, ls.scale, ls.skipped))
        if ls.finite:
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
    return {"history": history, "params": sx.gather(params)}


@pytest.mark.world_size(2)
def test_a_non_finite_shard_on_one_rank_skips_the_step_on_all_ranks():
    results = run_ranks(_loss_scale_agreement, world_size=2)
    expected = [(True, 8.0, 0), (False, 4.0, 1), (True, 4.0, 1), (True, 8.0, 1)]
    p = torch.ones(4) - 0.5 * (1 + 3 + 4)  # steps 0, 2, 3 applied
    for rank, r in enumerate(results):
        assert r["history"] == expected, f"rank {rank}: {r['history']}"
        torch.testing.assert_close(r["params"], p, msg=f"rank {rank}")


def test_partial_leaves_must_be_reduced_before_a_norm():
    mesh = sx.Mesh({"dp": 1})
    g = sx.Sharded(torch.ones(2), Layout(mesh, P(), partial="dp"), (2,))
    with pytest.raises(sx.ShardingError, match=r"leaf 'grads\.w'.*pending sums over \('dp',\)"):
        optim.global_norm({"grads": {"w": g}})
    with pytest.raises(sx.ShardingError, match="pending sums"):
        optim.clip_by_global_norm(1.0).update({"w": g}, optim.EmptyState())
    assert optim.all_finite({"w": g})


def test_global_norm_of_plain_and_empty_trees():
    assert optim.global_norm({}).item() == 0.0
    assert optim.global_norm([torch.zeros(0), torch.tensor([3.0, 4.0])]).item() == 5.0
    half = [torch.tensor([3.0], dtype=torch.float16), torch.tensor([4.0], dtype=torch.bfloat16)]
    norm = optim.global_norm(half)
    assert norm.dtype == torch.float32 and norm.item() == 5.0
