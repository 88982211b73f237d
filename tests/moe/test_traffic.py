"""What the monitor sees of the routing, and what expert parallelism moves, counted by ``sx.collectives.traffic()``:
each token's hidden state crosses the wire twice per layer (out to the
expert, back with its output) for each of its k choices whose expert lives
on another rank — and once more each way in backward — plus the per-expert
counts exchanged before each dispatch. Nothing else travels over ``ep`` as
an all-to-all; what a rank keeps for its own experts costs nothing."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _moe import BATCH, _batches, _loss, _model

import shardax as sx


def _one_step_counted() -> tuple[float, int, int, int, int]:
    mesh = sx.Mesh({"ep": 2})
    n, me = 2, mesh.axis_index("ep")
    model = _model("mixtral")
    experts = model.config.num_local_experts
    rules = sx.rules.experts("ep") + sx.rules.zero(0, "ep")
    params = sx.shard(sx.params_of(model), mesh, rules)
    grad_fn = sx.value_and_grad(lambda p, x, y: _loss(sx.apply(model, p, x), y))
    x, y = _batches()[0]
    rows = slice(me * BATCH // n, (me + 1) * BATCH // n)
    with sx.collectives.traffic() as t, sx.moe.expert_load() as seen:
        grad_fn(params, x[rows], y[rows])
    local = experts // n
    mine = slice(me * local, (me + 1) * local)
    sent = seen.local().load  # [layers, experts]: this rank's (token, choice) pairs
    everyone = seen.total().load  # the whole batch's
    out = int(sent.sum() - sent[:, mine].sum())  # this rank's pairs for other ranks' experts
    back = int(everyone[:, mine].sum() - sent[:, mine].sum())  # other ranks' pairs for mine
    counts = sent.shape[0] * (n - 1) * local * 8  # each dispatch's int64 count per expert
    return t.wire[("ragged_all_to_all", ("ep",))], out, back, counts, model.config.hidden_size


def test_dropless_experts_move_each_remote_choice_twice_per_layer_each_way():
    results = run_ranks(_one_step_counted, world_size=2)
    row = results[0][-1] * 4  # one hidden state, fp32
    for wire, out, back, counts, _ in results:
        # forward: its tokens out and the outputs of others' tokens back; backward: the same
        assert wire == 2 * (out + back) * row + counts, (wire, out, back)
    # over the mesh: each remote (token, choice) pair twice per layer, each way
    remote = sum(out for _, out, *_ in results)
    assert remote > 0
    assert sum(wire for wire, *_ in results) == 4 * remote * row + sum(r[3] for r in results)


def _monitored_step() -> tuple[dict | None, sx.moe.ExpertLoad]:
    mesh = sx.Mesh({"ep": 2})
    me = mesh.axis_index("ep")
    model = _model("mixtral")
    rules = sx.rules.experts("ep", capacity_factor=1.0) + sx.rules.zero(0, "ep")
    params = sx.shard(sx.params_of(model), mesh, rules)
    grad_fn = sx.value_and_grad(lambda p, x, y: _loss(sx.apply(model, p, x), y))
    monitor = sx.monitor.Monitor(writers=(), log_every=2, experts=True, mesh=mesh)
    with sx.moe.expert_load() as seen:
        for step, (x, y) in enumerate(_batches()[:2], 1):
            with monitor.step(step):
                grad_fn(params, x[me * 2 : me * 2 + 2], y[me * 2 : me * 2 + 2])
    return (monitor.records[-1] if monitor.records else None), seen.total()


def test_the_monitor_records_each_experts_share_and_the_dropped_fraction_of_the_whole_batch():
    (record, seen), (nothing, seen_too) = run_ranks(_monitored_step, world_size=2)
    assert nothing is None  # rank 0 writes
    assert torch.equal(seen.load, seen_too.load)  # the listener outside saw both steps, summed
    assert seen.load.shape == (4, 4)  # 2 steps × 2 layers, 4 experts
    per_expert = seen.load.sum(0).double()
    assert record["expert_load"] == pytest.approx((per_expert / per_expert.sum()).tolist())
    assert record["expert_load_max"] == pytest.approx(
        4 * float(per_expert.max() / per_expert.sum())
    )
    assert 0 < record["dropped_fraction"] == pytest.approx(seen.dropped_fraction)
    assert record["dropped_fraction"] == float(seen.dropped.sum()) / float(seen.load.sum())


def test_explain_shows_the_experts_per_rank_and_the_bytes_each_token_moves():
    model = _model("mixtral")
    rules = sx.rules.experts("ep") + sx.rules.zero(3, ("dp", "ep"))
    text = str(sx.explain(sx.params_of(model), sx.AbstractMesh({"dp": 2, "ep": 2}), rules))
    assert "experts over 'ep' (2 ranks): 2 layers of 4 experts (d=16), 2 per rank" in text
    assert "rank r holds experts 2·r … 2·(r+1)−1" in text
    # 4 crossings · 1/2 of the choices elsewhere · 16 floats · 4 B, per choice
    assert "= 128·k B; 256·k B over the 2 layers" in text
    one = str(sx.explain(sx.params_of(model), sx.AbstractMesh({"dp": 1, "ep": 1}), rules))
    assert "4 per rank" in one and "= 0·k B" in one  # one rank: nothing moves
