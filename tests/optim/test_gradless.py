"""The one rule for leaves without a gradient (issue 35), against
``torch.optim.AdamW`` on a tiny Hugging Face Llama: its rotary buffers
(which ``value_and_grad`` gives None), a frozen first layer
(``requires_grad=False`` in torch, None gradients here) and a leaf that only
sometimes gets a gradient (torch's per-parameter step count, so its own
bias correction) — by ``update`` + ``apply_updates`` (the README's
pattern), ``step``, ``fused_step``, a ``chain`` with clipping,
``MultiSteps`` and fp32 master weights for bf16 params, and on two ranks
under ZeRO-3. Then the rule's edges: integer buffers kept exactly, a
missing key named, masks and ``apply_if_finite``, ``MultiSteps`` across
micro-steps, states from before counts were per leaf, checkpoints. (Adam
without bias correction is in the optimizer tables, test_optimizers and
test_stepper.)"""

from __future__ import annotations

import _tiny as tiny
import optree
import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import optim

VOCAB, SEQ = tiny.VOCAB, tiny.SEQ
LR, WD = 1e-2, 0.1
STEPS = 4
FROZEN = "model.layers.0."  # requires_grad=False in torch; None gradients here
SOMETIMES = "model.norm.weight"  # no gradient at the micro-steps in DROPS
DROPS = {1: {1, 2}, 2: {1, 2, 3}}  # every_k -> micro-steps without it
# with every_k=2: its gradient from one micro-step of the first update, none in
# the second (no update: its step count stays), both in the last
BUFFERS = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")

# Parameters are at most ~1 in magnitude (the norms' weights start at 1).
# Torch's AdamW (its single-tensor loop on CPU) and the chain of transforms
# round the same arithmetic in a different order — a few fp32 roundings per
# step, ~1 ulp of 1.0 (1.2e-7) each — which the next steps' gradients carry
# along: 8 ulp of 1.0 after 4 steps. (A leaf stepped with a shared step count
# instead of its own is off by ~lr = 1e-2.)
TOL = {"rtol": 1e-6, "atol": 1e-6}


def batch(i: int, n: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(100 + i))


def no_gradient(key: str, i: int, every_k: int = 1) -> bool:
    return key.startswith(FROZEN) or (key == SOMETIMES and i in DROPS[every_k])


# -- the torch references ----------------------------------------------------------------


def torch_adamw(every_k: int = 1, clip: float | None = None, n: int = 2, eps: float = 1e-8) -> dict:
    """``torch.optim.AdamW`` over every parameter of the model (it skips
    those whose ``grad`` is None), ``every_k`` micro-batches of a loss
    divided by ``every_k`` per step; SOMETIMES's contribution dropped at its
    micro-steps (its ``grad`` put back as it was before their backward)."""
    torch.manual_seed(0)
    model = tiny.llama()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps, weight_decay=WD)
    sometimes = model.get_parameter(SOMETIMES)
    for s in range(STEPS):
        for m in range(every_k):
            i = s * every_k + m
            saved = None if sometimes.grad is None else sometimes.grad.clone()
            x = batch(i, n)
            (model(x, labels=x).loss / every_k).backward()
            if i in DROPS[every_k]:
                sometimes.grad = saved
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach() for name, p in model.named_parameters()}


def torch_master() -> dict:
    """fp32 master weights by hand: ``torch.optim.AdamW`` on an fp32 copy,
    the bf16 model (forward and backward) written from it each step."""
    torch.manual_seed(0)
    model = tiny.llama().to(torch.bfloat16)
    named = dict(model.named_parameters())
    master = {k: p.detach().float().clone().requires_grad_() for k, p in named.items()}
    opt = torch.optim.AdamW(master.values(), lr=LR, weight_decay=WD)
    for i in range(STEPS):
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(master[k])
        model.zero_grad(set_to_none=True)
        x = batch(i)
        model(x, labels=x).loss.backward()
        for k, p in named.items():
            master[k].grad = None if no_gradient(k, i) else p.grad.float()
        opt.step()
    return {k: m.detach() for k, m in master.items()}


# -- shardax -----------------------------------------------------------------------------


def make(kind: str) -> optim.GradientTransformation:
    opt = optim.adamw(LR, weight_decay=WD)
    if kind == "chain":
        return optim.chain(optim.clip_by_global_norm(1.0), opt)
    if kind == "multisteps":
        return optim.MultiSteps(opt, every_k=2)
    if kind == "master":
        return optim.with_master_weights(opt)
    return opt


def take(opt, via: str, grads, state, params):
    if via == "update":  # the README's pattern
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state
    if via == "step":
        return optim.step(opt, grads, state, params)
    return optim.fused_step(opt).step(params, grads, state)


def sx_run(kind: str, via: str) -> tuple[dict, object, dict]:
    """The shardax run: final params, state, and the buffers as they were."""
    torch.manual_seed(0)
    model = tiny.llama()
    if kind == "master":
        model = model.to(torch.bfloat16)
    every_k = 2 if kind == "multisteps" else 1
    params = sx.params_of(model)
    buffers = {k: params[k] for k in BUFFERS}
    opt = make(kind)
    state = opt.init(params)
    grad_fn = sx.value_and_grad(lambda p, x: sx.apply(model, p, x, labels=x).loss)
    for i in range(STEPS * every_k):
        x = batch(i)
        _, grads = grad_fn(params, x)
        assert all(grads[k] is None for k in BUFFERS)  # the measured case: buffers get None
        grads = {k: None if no_gradient(k, i, every_k) else g for k, g in grads.items()}
        params, state = take(opt, via, grads, state, params)
    return params, state, buffers


CASES = [
    ("adamw", "update"), ("adamw", "step"), ("adamw", "fused"), ("chain", "update"),
    ("chain", "fused"), ("multisteps", "update"), ("multisteps", "fused"),
    ("master", "update"), ("master", "fused"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "via"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_hf_llama_with_buffers_a_frozen_layer_and_a_sometimes_unused_leaf_matches_torch_adamw(
    kind, via
):
    params, state, buffers = sx_run(kind, via)
    for k in BUFFERS:  # kept: the same tensors, the same values
        assert params[k] is buffers[k]
    if kind == "master":
        ref = torch_master()
        for k, v in ref.items():
            torch.testing.assert_close(state.master[k], v, **TOL, msg=k)
            # the bf16 params are the master copy rounded (exactly: they round alike)
            assert torch.equal(params[k], v.to(torch.bfloat16)), k
        counts = state.inner_state[0].count
    else:
        ref = torch_adamw(
            every_k=2 if kind == "multisteps" else 1, clip=1.0 if kind == "chain" else None
        )
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, **TOL, msg=k)
        counts = {
            "adamw": lambda s: s[0].count,
            "chain": lambda s: s[-1][0].count,
            "multisteps": lambda s: s.inner_state[0].count,
        }[kind](state)
    # each leaf's own step count, as torch's state["step"]; none for the frozen layer
    assert int(counts[FROZEN + "mlp.up_proj.weight"]) == 0
    assert int(counts["lm_head.weight"]) == STEPS
    assert int(counts[SOMETIMES]) == (2 if kind != "multisteps" else STEPS - 1)
    assert int(counts[BUFFERS[0]]) == 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_readmes_update_steps_each_llama_family_keeping_its_buffers(family):
    """The issue's measured case: ``opt.update`` then ``apply_updates``,
    as the README writes the loop, on the models whose rotary buffers get
    None gradients."""
    torch.manual_seed(0)
    model = tiny.llama(family)
    params = sx.params_of(model)
    opt = optim.adamw(LR)
    state = opt.init(params)
    x = batch(0)
    _, grads = sx.value_and_grad(lambda p: sx.apply(model, p, x, labels=x).loss)(params)
    buffers = {k for k, g in grads.items() if g is None}
    assert buffers == set(BUFFERS)
    updates, state = opt.update(grads, state, params)
    new = optim.apply_updates(params, updates)
    assert all(new[k] is params[k] for k in buffers)
    assert all(not torch.equal(new[k], params[k]) for k in params if k not in buffers)


def test_the_frozen_leaves_keep_their_state_tensors_untouched():
    """Not only equal values: ``fused_step`` neither reads nor writes a
    frozen leaf's moments and count (the very tensors ``init`` made)."""
    torch.manual_seed(0)
    model = tiny.llama()
    params = sx.params_of(model)
    opt = optim.adamw(LR, weight_decay=WD)
    state = opt.init(params)
    frozen = [k for k in params if k.startswith(FROZEN)]
    before = {k: (state[0].mu[k], state[0].nu[k], state[0].count[k]) for k in frozen}
    grad_fn = sx.value_and_grad(lambda p, x: sx.apply(model, p, x, labels=x).loss)
    for i in range(2):
        _, grads = grad_fn(params, batch(i))
        grads = {k: None if k.startswith(FROZEN) else g for k, g in grads.items()}
        params, state = optim.fused_step(opt).step(params, grads, state)
    for k, (mu, nu, count) in before.items():
        assert state[0].mu[k] is mu and state[0].nu[k] is nu and state[0].count[k] is count
        assert not mu.any() and not nu.any() and int(count) == 0


# -- on two ranks: ZeRO-3 ---------------------------------------------------------------


def _zero3_llama(via: str, eps: float) -> dict[str, torch.Tensor]:
    """4 AdamW steps of the Llama under ZeRO-3 on dp=2, each rank on its
    half of the batch, with the same leaves without a gradient."""
    mesh = sx.Mesh({"dp": 2})
    torch.manual_seed(0)
    model = tiny.llama()
    params = sx.shard(sx.params_of(model), mesh, sx.rules.zero(3))
    opt = optim.adamw(LR, eps=eps, weight_decay=WD)
    state = opt.init(params)
    grad_fn = sx.value_and_grad(lambda p, x: sx.apply(model, p, x, labels=x).loss)
    r = mesh.axis_index("dp")
    for i in range(STEPS):
        _, grads = grad_fn(params, batch(i, 4)[2 * r : 2 * r + 2])
        grads = {k: None if no_gradient(k, i) else g for k, g in grads.items()}
        params, state = take(opt, via, grads, state, params)
    return sx.gather(params)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("via", ["update", "fused"])
def test_zero3_on_two_ranks_matches_torch_adamw(via):
    # The batch's gradient summed in two halves differs from one backward by
    # ~1e-7 of its largest terms; Adam divides that by sqrt(v) + eps, so for an
    # element whose gradient is near 0 it moves the step by up to lr (2.8e-5
    # seen with eps = 1e-8). eps = 1e-5 caps the effect at lr * 1e-9 / eps:
    # TOL holds.
    eps = 1e-5
    ref = torch_adamw(n=4, eps=eps)
    for rank, got in enumerate(run_ranks(_zero3_llama, via, eps, world_size=2)):
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"rank {rank}: {k}")


# -- the rule's edges ----------------------------------------------------------------------


@pytest.mark.parametrize("via", ["update", "step", "fused"])
def test_an_integer_buffer_is_kept_exactly(via):
    """No round trip through a float: 2**40 + 1 is not an fp32 number."""
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1))
    big = torch.tensor([2**40 + 1], dtype=torch.int64)
    params = {"w": torch.ones(3), "n": big}
    state = opt.init(params)
    params, state = take(opt, via, {"w": torch.ones(3), "n": None}, state, params)
    assert params["n"] is big and int(big) == 2**40 + 1
    assert not torch.equal(params["w"], torch.ones(3))


def test_a_missing_gradient_is_an_error_that_says_to_give_none():
    opt = optim.adamw(0.1)
    params = {"w": torch.ones(2), "b": torch.ones(1)}
    with pytest.raises(ValueError, match=r"missing from updates: 'b'.*stays in the tree as None"):
        opt.update({"w": torch.ones(2)}, opt.init(params), params)
    with pytest.raises(ValueError, match=r"missing from updates: 'b'.*stays in the tree as None"):
        optim.apply_updates(params, {"w": torch.ones(2)})


def test_each_leaf_steps_with_its_own_count_as_torch_adam():
    """Plain tensors, bias correction visible: a leaf without a gradient at
    steps 1-3 then stepped at t=2, as ``torch.optim.Adam`` does."""
    g = torch.Generator().manual_seed(0)
    grads = [{"a": torch.randn(5, generator=g), "b": torch.randn(3, generator=g)} for _ in range(6)]
    skip = {1, 2, 3}
    ref = {k: torch.zeros(n, requires_grad=True) for k, n in (("a", 5), ("b", 3))}
    torch_opt = torch.optim.Adam(ref.values(), lr=0.1)
    opt = optim.adam(0.1)
    params = {"a": torch.zeros(5), "b": torch.zeros(3)}
    state = opt.init(params)
    for step, gs in enumerate(grads):
        gs = {k: None if k == "b" and step in skip else v for k, v in gs.items()}
        for k in ref:
            ref[k].grad = gs[k]
        torch_opt.step()
        updates, state = opt.update(gs, state, params)
        assert (updates["b"] is None) == (step in skip)
        params = optim.apply_updates(params, updates)
        for k in ref:  # the same fp32 arithmetic, reordered: an ulp or two of 0.1 * step
            torch.testing.assert_close(params[k], ref[k].detach(), rtol=1e-6, atol=1e-7)
    assert {k: int(c) for k, c in state[0].count.items()} == {"a": 6, "b": 3}
    assert {k: int(torch_opt.state[ref[k]]["step"]) for k in ref} == {"a": 6, "b": 3}


def test_a_schedule_advances_every_step_as_torchs_lr_scheduler():
    sched = optim.linear_schedule(1.0, 0.0, 10)
    opt = optim.adamw(sched)
    params = {"w": torch.ones(2), "f": torch.ones(2)}
    state = opt.init(params)
    for _ in range(3):
        updates, state = opt.update({"w": torch.ones(2), "f": None}, state, params)
        params = optim.apply_updates(params, updates)
    assert int(state[-1].count) == 3
    assert {k: int(c) for k, c in state[0].count.items()} == {"w": 3, "f": 0}


def test_masks_clipping_and_apply_if_finite_pass_none_through():
    mask = {"w": True, "b": False, "f": True}
    opt = optim.apply_if_finite(
        optim.chain(
            optim.clip_by_global_norm(1.0),
            optim.adamw(0.1, weight_decay=0.5, mask=mask),
        )
    )
    params = {"w": torch.ones(2), "b": torch.ones(2), "f": torch.ones(2)}
    state = opt.init(params)
    updates, state = opt.update({"w": torch.ones(2), "b": torch.ones(2), "f": None}, state, params)
    assert updates["f"] is None and updates["w"] is not None and updates["b"] is not None
    nan = {"w": torch.full((2,), float("nan")), "b": torch.ones(2), "f": None}
    updates, state = opt.update(nan, state, params)  # skipped: zeros, and None for f
    assert updates["f"] is None and not updates["w"].any()
    ref = optim.adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False})
    two = {"w": params["w"], "b": params["b"]}
    want, _ = ref.update(
        optim.clip_by_global_norm(1.0).update({"w": torch.ones(2), "b": torch.ones(2)}, None)[0],
        ref.init(two),
        two,
    )
    first, _ = opt.update(
        {"w": torch.ones(2), "b": torch.ones(2), "f": None}, opt.init(params), params
    )
    for k in want:
        torch.testing.assert_close(first[k], want[k], rtol=0, atol=0)
    # a mask function sees the whole params, the leaves without a gradient too
    by_ndim = optim.adamw(
        0.1, weight_decay=0.5, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}
    )
    updates, _ = by_ndim.update(
        {"w": torch.ones(2), "b": torch.ones(2), "f": None}, by_ndim.init(params), params
    )
    assert updates["f"] is None


def test_multisteps_steps_a_leaf_whose_gradient_came_at_an_earlier_micro_step():
    opt = optim.MultiSteps(optim.sgd(1.0), every_k=2)
    params = {"w": torch.zeros(1), "f": torch.zeros(1)}
    state = opt.init(params)
    u, state = opt.update({"w": torch.ones(1), "f": torch.full((1,), 4.0)}, state, params)
    assert u["f"] is not None and int(state.acc_count["f"]) == 1
    u, state = opt.update({"w": torch.ones(1), "f": None}, state, params)
    assert torch.equal(u["f"], torch.tensor([-2.0]))  # its sum over every_k
    u, state = opt.update({"w": torch.ones(1), "f": None}, state, params)
    assert u["f"] is None
    u, state = opt.update({"w": torch.ones(1), "f": None}, state, params)
    assert u["f"] is None  # no micro-step gave it one: kept
    assert int(state.gradient_step) == 2


# -- states from before counts were per leaf -------------------------------------------------


def _one_count(state: tuple, value: int) -> tuple:
    return (state[0]._replace(count=torch.tensor(value)), *state[1:])


@pytest.mark.parametrize("via", ["update", "fused"])
def test_a_state_with_one_count_for_every_leaf_is_read_as_each_leafs(via):
    opt = optim.adamw(optim.linear_schedule(0.1, 0.0, 10))
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    new = opt.init(params)
    new = (new[0]._replace(count={"w": torch.tensor(3), "b": torch.tensor(3)}), *new[1:])
    old = _one_count(opt.init(params), 3)
    grads = {"w": torch.ones(3), "b": None}
    want, want_state = optim.step(opt, grads, new, {k: v.clone() for k, v in params.items()})
    got, got_state = take(opt, via, grads, old, {k: v.clone() for k, v in params.items()})
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert {k: int(c) for k, c in got_state[0].count.items()} == {"w": 4, "b": 3}
    for a, b in zip(optree.tree_leaves(got_state), optree.tree_leaves(want_state), strict=True):
        assert torch.equal(a, b)


def test_older_adafactor_and_multisteps_states_are_read_too():
    params = {"w": torch.ones(4, 4), "b": torch.ones(4)}
    grads = {"w": torch.ones(4, 4), "b": None}
    opt = optim.scale_by_factored_rms(min_dim_size_to_factor=2)
    state = opt.init(params)
    u, s = opt.update(grads, state._replace(count=torch.tensor(2)), params)
    want, _ = opt.update(grads, state._replace(count={"w": torch.tensor(2), "b": None}), params)
    assert torch.equal(u["w"], want["w"]) and u["b"] is None
    assert {k: int(c) for k, c in s.count.items()} == {"w": 3, "b": 2}
    acc = optim.MultiSteps(optim.sgd(1.0), every_k=1)
    old = acc.init(params)._replace(acc_count=None)
    u, s = acc.update(grads, old, params)
    assert torch.equal(u["w"], -torch.ones(4, 4)) and u["b"] is None
    assert s.acc_count is not None


def test_checkpoints_hold_one_count_per_leaf_and_an_older_one_loads_into_a_one_count_template(
    tmp_path,
):
    mesh = sx.Mesh({"dp": 1})
    params = sx.shard({"w": torch.ones(4), "b": torch.ones(3)}, mesh, sx.rules.zero(3))
    opt = optim.adamw(0.1)
    state = opt.init(params)
    grads = {"w": params["w"].with_local(torch.ones(4)), "b": None}
    params, state = optim.fused_step(opt).step(params, grads, state)
    sx.ckpt.save(tmp_path / "new", {"opt": state})
    loaded = sx.ckpt.load(tmp_path / "new", {"opt": opt.init(params)})["opt"]
    assert {k: int(c) for k, c in loaded[0].count.items()} == {"w": 1, "b": 0}
    # a checkpoint from before: one count; loaded into a template of that shape, then stepped
    old = _one_count(state, 1)
    sx.ckpt.save(tmp_path / "old", {"opt": old})
    with pytest.raises(sx.CheckpointError, match=r"opt\.0\.count\.w"):
        sx.ckpt.load(tmp_path / "old", {"opt": opt.init(params)})
    loaded = sx.ckpt.load(tmp_path / "old", {"opt": _one_count(opt.init(params), 0)})["opt"]
    assert int(loaded[0].count) == 1
    _, stepped = optim.step(opt, grads, loaded, params)
    assert {k: int(c) for k, c in stepped[0].count.items()} == {"w": 2, "b": 1}
