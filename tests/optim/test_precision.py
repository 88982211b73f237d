"""Mixed precision: fp32 master weights for bf16 params against an fp32
reference run, dynamic loss scaling against ``torch.amp.GradScaler``, and
both (with accumulation) on ZeRO-1 shards equal to the dense run."""

from __future__ import annotations

import optree
import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import Layout, P, optim
from shardax.shard._placement import Placement


def grads(step: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(60 + step)
    return {
        "w": torch.randn(4, 3, generator=g).to(dtype),
        "b": torch.randn(5, generator=g).to(dtype),
    }


def params0(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return {
        "w": torch.randn(4, 3, generator=g).to(dtype),
        "b": torch.randn(5, generator=g).to(dtype),
    }


def test_master_weights_for_bf16_params_follow_the_fp32_run():
    opt = optim.with_master_weights(optim.adamw(1e-3, weight_decay=0.1))
    params = params0(torch.bfloat16)
    state = opt.init(params)
    assert all(m.dtype == torch.float32 for m in state.master.values())
    ref = {k: v.float().requires_grad_() for k, v in params.items()}  # starts from the bf16 values
    torch_opt = torch.optim.AdamW(ref.values(), lr=1e-3, weight_decay=0.1)
    for step in range(20):
        g = grads(step, torch.bfloat16)
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
        for k in ref:
            ref[k].grad = g[k].float()
        torch_opt.step()
        for k in params:
            assert params[k].dtype == torch.bfloat16
            assert torch.equal(params[k], state.master[k].to(torch.bfloat16)), (step, k)
            torch.testing.assert_close(state.master[k], ref[k].detach(), rtol=1e-6, atol=1e-6)
    # without master weights the bf16 run drifts away from the fp32 one
    plain = params0(torch.bfloat16)
    plain_opt = optim.adamw(1e-3, weight_decay=0.1)
    plain_state = plain_opt.init(plain)
    for step in range(20):
        u, plain_state = plain_opt.update(grads(step, torch.bfloat16), plain_state, plain)
        plain = optim.apply_updates(plain, u)
    assert not all(torch.equal(plain[k], params[k]) for k in plain)


def test_loss_scaling_matches_grad_scaler():
    """fp32 params; the scale starts so high that the scaled gradients
    overflow, backs off, grows back every 3 good steps, overflows again."""
    x = torch.tensor([[1.0, -2.0, 3.0], [0.5, 1.0, -1.0]])
    y = torch.tensor([2.0, -1.0])
    w0 = torch.tensor([0.1, 0.2, -0.3])

    def loss_fn(w: torch.Tensor) -> torch.Tensor:
        return ((x @ w - y) ** 2).sum()

    w_ref = w0.clone().requires_grad_()
    ref_opt = torch.optim.SGD([w_ref], lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**124, growth_interval=3)
    opt = optim.sgd(0.01, momentum=0.9)
    w = w0.clone()
    state = opt.init(w)
    ls = optim.DynamicLossScale(2.0**124, growth_interval=3)
    scales, ref_scales, skipped = [], [], []
    for _ in range(12):
        ref_opt.zero_grad()
        scaler.scale(loss_fn(w_ref)).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_scales.append(scaler.get_scale())

        wg = w.clone().requires_grad_()
        (g,) = torch.autograd.grad(ls.scale_loss(loss_fn(wg)), [wg])
        g, ls = ls.unscale_and_adjust(g)
        if ls.finite:
            u, state = opt.update(g, state, w)
            w = optim.apply_updates(w, u)
        scales.append(ls.scale)
        skipped.append(ls.skipped)
    assert scales == ref_scales
    assert 0 < skipped[-1] < 12 and max(scales) > min(scales)  # both skips and growth happened
    torch.testing.assert_close(w, w_ref.detach(), rtol=1e-6, atol=1e-7)


def test_loss_scale_is_a_validated_pytree_value():
    ls = optim.DynamicLossScale(1024.0)
    leaves, spec = optree.tree_flatten(ls)
    assert optree.tree_unflatten(spec, leaves) == ls
    assert ls.adjust(True).growth_tracker == 1 and ls.growth_tracker == 0  # frozen
    with pytest.raises(ValueError, match="positive finite"):
        optim.DynamicLossScale(0.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        optim.DynamicLossScale(backoff_factor=1.5)
    with pytest.raises(TypeError, match="growth_interval must be an int"):
        optim.DynamicLossScale(growth_interval=2.5)


# -- on two ranks: ZeRO-1 bf16 params, master weights and accumulation sharded ---------------


def make_opt() -> optim.GradientTransformation:
    return optim.MultiSteps(optim.with_master_weights(optim.adamw(1e-2, weight_decay=0.1)), 2)


def _zero1_mixed() -> dict:
    mesh = sx.Mesh({"dp": -1})
    rep = Layout(mesh)
    params = {}
    for k, v in params0(torch.bfloat16).items():
        p = sx.shard(v, mesh, P())
        params[k] = sx.Sharded(
            p.local, p.layout, p.shape, placement=Placement(rep, rep, Layout(mesh, P("dp")))
        )
    opt = make_opt()
    state = opt.init(params)
    master = state.inner_state.master
    sharded = all(m.spec == P("dp") and m.dtype == torch.float32 for m in master.values())
    for step in range(4):
        g = sx.shard(grads(step, torch.bfloat16), mesh, P())
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return {
        "params": sx.gather(params),
        "master": sx.gather(state.inner_state.master),
        "sharded": sharded and state.acc_grads["w"].spec == P("dp"),
        "local_rows": master["w"].local.shape[0],
    }


@pytest.mark.world_size(2)
def test_master_weights_and_accumulation_on_zero1_shards_equal_dense():
    results = run_ranks(_zero1_mixed, world_size=2)
    opt = make_opt()
    params = params0(torch.bfloat16)
    state = opt.init(params)
    for step in range(4):
        updates, state = opt.update(grads(step, torch.bfloat16), state, params)
        params = optim.apply_updates(params, updates)
    for rank, r in enumerate(results):
        assert r["sharded"] and r["local_rows"] == 2, f"rank {rank}: state not sharded over dp"
        for k in params:
            # AdamW is elementwise and both runs take the same kernel: a leaf's
            # shard is updated exactly as its rows of the dense leaf are, so the
            # fp32 masters agree bit for bit, and so do the bf16 params made from them
            assert torch.equal(r["master"][k], state.inner_state.master[k]), f"rank {rank}: {k}"
            assert torch.equal(r["params"][k], params[k]), f"rank {rank}: {k}"


def test_hysteresis_and_the_floor_follow_deepspeed():
    """DeepSpeed's DynamicLossScaler: with hysteresis 2 the scale backs off at
    the 2nd overflow since it last grew (both steps skipped), at every later
    one until it grows again, and never below min_scale."""
    ls = optim.DynamicLossScale(8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    seen = []
    for finite in [False, False, False, True, True, False, False, False]:
        ls = ls.adjust(finite)
        seen.append((ls.scale, ls.finite))
    assert seen == [(8.0, False), (4.0, False), (2.0, False), (2.0, True), (4.0, True),
                    (4.0, False), (2.0, False), (2.0, False)]  # fmt: skip
    assert ls.skipped == 6
    with pytest.raises(ValueError, match="hysteresis must be an int >= 1"):
        optim.DynamicLossScale(hysteresis=0)
    with pytest.raises(ValueError, match="min_scale must be in"):
        optim.DynamicLossScale(4.0, min_scale=8.0)
