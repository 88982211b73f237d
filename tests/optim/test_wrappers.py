"""Wrappers and plumbing at world size 1: inject_hyperparams, MultiSteps,
masked, weight-decay masks, apply_if_finite, chain — each against a
reference run — and the errors bad input gets."""

from __future__ import annotations

import optree
import pytest
import torch

import shardax as sx
from shardax import P, optim


def params0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(30 + step)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}


def run(opt: optim.GradientTransformation, steps: int, hook=None) -> tuple[dict, object]:
    params = params0()
    state = opt.init(params)
    for step in range(steps):
        if hook is not None:
            state = hook(step, state)
        updates, state = opt.update(grads(step), state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def torch_run(make, steps: int, hook=None) -> dict[str, torch.Tensor]:
    params = {k: v.clone().requires_grad_() for k, v in params0().items()}
    opt = make(params)
    for step in range(steps):
        if hook is not None:
            hook(step, opt)
        for k, g in grads(step).items():
            params[k].grad = g
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def assert_trees_close(a: dict, b: dict, **kw) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k, **kw)


# -- inject_hyperparams ---------------------------------------------------------------


def test_inject_hyperparams_changes_lr_mid_run_like_torch():
    def set_lr(step, state):
        if step == 5:
            state.hyperparams["lr"] = torch.tensor(1e-3, dtype=torch.float64)
        return state

    def set_torch_lr(step, opt):
        if step == 5:
            opt.param_groups[0]["lr"] = 1e-3

    ours, state = run(optim.inject_hyperparams(optim.adamw)(lr=1e-2), 10, set_lr)
    ref = torch_run(lambda p: torch.optim.AdamW(p.values(), lr=1e-2), 10, set_torch_lr)
    assert_trees_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert float(state.hyperparams["lr"]) == 1e-3
    assert set(state.hyperparams) == {"lr", "b1", "b2", "eps", "weight_decay"}


def test_inject_hyperparams_evaluates_schedules_every_step():
    schedule = optim.warmup_cosine(0.1, 3, 8)
    opt = optim.inject_hyperparams(optim.sgd)(schedule, momentum=0.9)
    params, state = params0(), None
    state = opt.init(params)
    seen = []
    for step in range(8):
        updates, state = opt.update(grads(step), state, params)
        params = optim.apply_updates(params, updates)
        seen.append(float(state.hyperparams["lr"]))
    assert seen == [schedule(i) for i in range(8)]
    plain, _ = run(optim.sgd(schedule, momentum=0.9), 8)
    assert_trees_close(params, plain, rtol=0, atol=0)


def test_inject_hyperparams_rejects_unknown_names():
    opt = optim.inject_hyperparams(optim.sgd)(0.1)
    state = opt.init(params0())
    state.hyperparams["momentum_typo"] = torch.tensor(0.9)
    with pytest.raises(ValueError, match="momentum_typo"):
        opt.update(grads(0), state, params0())
    with pytest.raises(TypeError, match="static_args"):
        optim.inject_hyperparams(optim.sgd, static_args=("nope",))(0.1)


# -- MultiSteps ------------------------------------------------------------------------


def test_multisteps_equals_one_step_on_the_mean():
    k = 3
    opt = optim.MultiSteps(optim.adam(1e-2), every_k=k)
    params = params0()
    state = opt.init(params)
    ref_opt = optim.adam(1e-2)
    ref_params = params0()
    ref_state = ref_opt.init(ref_params)
    for step in range(2 * k):
        updates, state = opt.update(grads(step), state, params)
        if (step + 1) % k:
            assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
            assert int(state.mini_step) == (step + 1) % k
        params = optim.apply_updates(params, updates)
        if (step + 1) % k == 0:
            gs = [grads(s) for s in range(step + 1 - k, step + 1)]
            mean = {n: (gs[0][n] + gs[1][n] + gs[2][n]) / k for n in gs[0]}
            u, ref_state = ref_opt.update(mean, ref_state, ref_params)
            ref_params = optim.apply_updates(ref_params, u)
            assert int(state.mini_step) == 0
            assert_trees_close(params, ref_params, rtol=0, atol=0)
    assert int(state.gradient_step) == 2


def test_multisteps_accumulates_bf16_grads_in_fp32():
    opt = optim.MultiSteps(optim.sgd(1.0), every_k=2)
    params = {"w": torch.zeros(2, dtype=torch.bfloat16)}
    state = opt.init(params)
    assert state.acc_grads["w"].dtype == torch.float32
    _, state = opt.update({"w": torch.full((2,), 1.0, dtype=torch.bfloat16)}, state, params)
    u, state = opt.update({"w": torch.full((2,), 2**-9, dtype=torch.bfloat16)}, state, params)
    assert u["w"].dtype == torch.float32
    torch.testing.assert_close(u["w"], torch.full((2,), -(1 + 2**-9) / 2))


# -- masks -----------------------------------------------------------------------------


def test_masked_applies_inner_only_where_true():
    mask = {"w": True, "b": False}
    for m in (mask, lambda p: {"w": p["w"].dim() > 1, "b": p["b"].dim() > 1}):
        opt = optim.masked(optim.adam(1e-2), m)
        state = opt.init(params0())
        assert state.inner_state[0].mu["b"] is None  # no state for masked-out leaves
        updates, state = opt.update(grads(0), state, params0())
        assert torch.equal(updates["b"], grads(0)["b"])  # passed through unchanged
        adam = optim.adam(1e-2)
        ref, _ = adam.update({"w": grads(0)["w"]}, adam.init({"w": params0()["w"]}), None)
        assert torch.equal(updates["w"], ref["w"])


def test_masked_with_a_prefix_mask():
    params = {"enc": params0(), "dec": params0()}
    opt = optim.masked(optim.scale(0.0), {"enc": True, "dec": False})
    updates, _ = opt.update({"enc": grads(0), "dec": grads(1)}, opt.init(params), params)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates["enc"].values())
    assert all(torch.equal(updates["dec"][k], grads(1)[k]) for k in ("w", "b"))


def test_adamw_weight_decay_mask_matches_torch_param_groups():
    def decay_matrices(p):
        return optree.tree_map(lambda x: x.dim() > 1, p)

    ours, _ = run(optim.adamw(1e-2, weight_decay=0.5, mask=decay_matrices), 20)
    ref = torch_run(
        lambda p: torch.optim.AdamW(
            [{"params": [p["w"]]}, {"params": [p["b"]], "weight_decay": 0.0}],
            lr=1e-2,
            weight_decay=0.5,
        ),
        20,
    )
    assert_trees_close(ours, ref, rtol=1e-6, atol=1e-6)
    unmasked, _ = run(optim.adamw(1e-2, weight_decay=0.5), 20)
    assert not torch.allclose(unmasked["b"], ours["b"])  # the mask mattered


def test_add_decayed_weights_mask():
    opt = optim.add_decayed_weights(0.5, mask={"w": False, "b": True})
    p = params0()
    u, _ = opt.update(grads(0), opt.init(p), p)
    assert torch.equal(u["w"], grads(0)["w"])
    torch.testing.assert_close(u["b"], grads(0)["b"] + 0.5 * p["b"])


# -- apply_if_finite, chain ----------------------------------------------------------------


def test_apply_if_finite_skips_and_keeps_the_inner_state():
    opt = optim.apply_if_finite(optim.adam(1e-2), max_consecutive_errors=2)
    params = params0()
    state = opt.init(params)
    _, state = opt.update(grads(0), state, params)
    bad = grads(1) | {"b": torch.tensor([float("nan"), 0.0])}
    for n in (1, 2):
        u, new = opt.update(bad, state, params)
        assert all(torch.equal(x, torch.zeros_like(x)) for x in u.values())
        assert new.inner_state is state.inner_state
        assert (new.notfinite_count, new.last_finite, new.total_notfinite) == (n, False, n)
        state = new
    u, state = opt.update(bad, state, params)  # too many in a row: applied, NaN shows
    assert torch.isnan(u["b"]).any() and state.total_notfinite == 3
    u, state = opt.update(grads(2), opt.init(params), params)
    assert state.last_finite and state.notfinite_count == 0


def test_chain_of_nothing_is_the_identity():
    u, state = optim.chain().update(grads(0), optim.chain().init(params0()))
    assert state == () and u is not None and torch.equal(u["w"], grads(0)["w"])


# -- errors --------------------------------------------------------------------------------


def test_mismatched_trees_name_the_path():
    opt = optim.adamw(1e-3)
    p = params0()
    state = opt.init(p)
    with pytest.raises(ValueError, match=r"missing from updates: 'b'"):
        opt.update({"w": grads(0)["w"]}, state, p)
    with pytest.raises(ValueError, match=r"'w'.*shape \(2, 3\); expected \(3, 2\)"):
        opt.update({"w": torch.ones(2, 3), "b": grads(0)["b"]}, state, p)
    with pytest.raises(ValueError, match=r"not in params: 'c'"):
        optim.apply_updates(p, grads(0) | {"c": torch.ones(1)})
    with pytest.raises(TypeError, match=r"leaf 'w' is a int"):
        opt.init({"w": 3})
    with pytest.raises(ValueError, match="tuple of their 3 states"):
        opt.update(grads(0), state[1], p)
    with pytest.raises(TypeError, match="scale_by_adam expects its ScaleByAdamState; got a Empty"):
        opt.update(grads(0), state[::-1], p)


def test_sharded_and_plain_leaves_do_not_mix_silently():
    mesh = sx.Mesh({"dp": 1})
    opt = optim.adam(1e-3)
    state = opt.init(sx.shard(params0(), mesh, P()))
    with pytest.raises(sx.ShardingError, match=r"leaf 'b' is a plain tensor"):
        opt.update(grads(0), state, None)
    state = opt.init(params0())
    with pytest.raises(sx.ShardingError, match=r"initialized on dense params"):
        opt.update(sx.shard(grads(0), mesh, P()), state, None)


def test_bad_hyperparameters_are_clear_errors():
    with pytest.raises(ValueError, match=r"lr must be in \[0.0, inf\); got -0.1"):
        optim.sgd(-0.1)
    with pytest.raises(ValueError, match=r"b1 must be in \[0.0, 1.0\)"):
        optim.adam(1e-3, b1=1.0)
    with pytest.raises(TypeError, match="lr must be a number"):
        optim.adamw("fast")
    with pytest.raises(ValueError, match="Nesterov momentum needs momentum"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(TypeError, match="bias_correction must be a bool; got 0"):
        optim.adamw(1e-3, bias_correction=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every_k"):
        optim.MultiSteps(optim.sgd(0.1), every_k=0)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(0.0)
    with pytest.raises(ValueError, match=r"schedule gave -1\.0 at step 0"):
        opt = optim.sgd(lambda step: -1.0)
        opt.update(grads(0), opt.init(params0()), params0())
    with pytest.raises(ValueError, match="needs the params"):
        opt = optim.adamw(1e-3)
        opt.update(grads(0), opt.init(params0()))


def test_bad_masks_are_clear_errors():
    p = params0()
    opt = optim.masked(optim.scale(2.0), {"w": True})
    with pytest.raises(ValueError, match="mask's structure does not match"):
        opt.init(p)
    opt = optim.masked(optim.scale(2.0), {"w": True, "b": "yes"})
    with pytest.raises(TypeError, match=r"mask entry for 'b' is 'yes'"):
        opt.init(p)
    opt = optim.masked(optim.scale(2.0), lambda params: [True, False])
    with pytest.raises(ValueError, match="mask's structure does not match"):
        opt.update(grads(0), opt.init(None), p)


# -- dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda: optim.adam(1e-2), lambda: optim.rmsprop(1e-2, momentum=0.9)]
)
def test_mixed_dtypes_are_grouped_and_each_leaf_kept_in_its_own(make):
    dtypes = {"a": torch.float32, "b": torch.bfloat16, "c": torch.float64, "d": torch.float32}
    params = {k: torch.linspace(-1, 1, 5 + i, dtype=dt) for i, (k, dt) in enumerate(dtypes.items())}
    opt = make()
    state = opt.init(params)
    solo = {k: (make(), make().init({k: v})) for k, v in params.items()}
    for step in range(3):
        g = {k: torch.cos(v * (step + 1)) for k, v in params.items()}
        updates, state = opt.update(g, state, params)
        for k in params:
            o, s = solo[k]
            u, s = o.update({k: g[k]}, s, {k: params[k]})
            solo[k] = (o, s)
            assert updates[k].dtype == dtypes[k]
            # Same formula, but grouped leaves go through torch's foreach kernels
            # and a lone leaf through the plain ones, whose vectorisation (and
            # fused multiply-adds) differ by CPU: the update's ~8 roundings may
            # differ by an ulp each, so 8 ulps of the leaf's dtype, relative
            # (and absolute at the scale of the learning rate, for updates near 0).
            eps = torch.finfo(dtypes[k]).eps
            torch.testing.assert_close(updates[k], u[k], rtol=8 * eps, atol=8 * eps * 1e-2)
        params = optim.apply_updates(params, updates)


def test_apply_updates_adds_in_the_wider_dtype():
    p = {"w": torch.ones(2, dtype=torch.float64) * (1 + 2**-30)}
    u = {"w": torch.full((2,), 2.0**-10, dtype=torch.bfloat16)}
    out = optim.apply_updates(p, u)
    assert out["w"].dtype == torch.float64
    assert torch.equal(out["w"], p["w"] + 2.0**-10)
