"""One table of optimizers, parametrized over properties: each matches its
``torch.optim`` counterpart (or a hand-written reference of its paper's
update) over 50 steps; ``init`` works on meta params; ``update`` mutates
nothing; and on real ranks, in the ZeRO-1/2/3 arrangements, the sharded run
— by ``update`` or by the fused stepper — equals the dense one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import Layout, P, optim
from shardax.kernels import OPTIM
from shardax.shard._placement import Placement


class Case(NamedTuple):
    make: Callable[[], optim.GradientTransformation]
    torch_ref: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None
    hand_ref: Callable[[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]], Any] | None = None
    tol: float = 1e-6  # rtol and atol after 50 steps


# -- hand-written references of the papers' updates -------------------------------


def lion_ref(lr: float, b1: float, b2: float, wd: float) -> Callable:
    """Chen et al. 2023, Algorithm 2."""

    def step(p: dict, g: dict, s: dict) -> None:
        for k in p:
            m = s.setdefault(k, torch.zeros_like(p[k]))
            c = b1 * m + (1 - b1) * g[k]
            p[k] = p[k] - lr * (torch.sign(c) + wd * p[k])
            s[k] = b2 * m + (1 - b2) * g[k]

    return step


def lamb_ref(lr: float, b1: float, b2: float, eps: float, wd: float) -> Callable:
    """You et al. 2020, Algorithm 2 (phi = identity)."""

    def step(p: dict, g: dict, s: dict) -> None:
        t = s["t"] = s.get("t", 0) + 1
        for k in p:
            m, v = s.get(("m", k), 0 * p[k]), s.get(("v", k), 0 * p[k])
            m = b1 * m + (1 - b1) * g[k]
            v = b2 * v + (1 - b2) * g[k] ** 2
            s[("m", k)], s[("v", k)] = m, v
            r = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p[k]
            pn, rn = p[k].norm(), r.norm()
            ratio = pn / rn if pn > 0 and rn > 0 else 1.0
            p[k] = p[k] - lr * ratio * r

    return step


def adafactor_ref(
    lr: float, clip: float = 1.0, eps1: float = 1e-30, eps2: float = 1e-3
) -> Callable:
    """Shazeer & Stern 2018, Algorithm 4 (factored for matrices) with update
    clipping and relative step size max(eps2, RMS(X)) * lr, beta2 = 1 - t^-0.8."""

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x.square().mean().sqrt()

    def step(p: dict, g: dict, s: dict) -> None:
        t = s["t"] = s.get("t", 0) + 1
        beta2 = 1 - t**-0.8
        for k in p:
            g2 = g[k] ** 2 + eps1
            if g[k].dim() == 2:
                r = beta2 * s.get(("r", k), 0.0) + (1 - beta2) * g2.mean(1)
                c = beta2 * s.get(("c", k), 0.0) + (1 - beta2) * g2.mean(0)
                s[("r", k)], s[("c", k)] = r, c
                v = torch.outer(r, c) / r.mean()
            else:
                v = s[("v", k)] = beta2 * s.get(("v", k), 0.0) + (1 - beta2) * g2
            u = g[k] / v.sqrt()
            u = u / torch.clamp(rms(u) / clip, min=1.0)
            p[k] = p[k] - lr * torch.clamp(rms(p[k]), min=eps2) * u

    return step


def nadam_ref(lr: float, b1: float, b2: float, eps: float) -> Callable:
    """Adam with Nesterov momentum, as optax's scale_by_adam(nesterov=True)."""

    def step(p: dict, g: dict, s: dict) -> None:
        t = s["t"] = s.get("t", 0) + 1
        for k in p:
            m = s[("m", k)] = b1 * s.get(("m", k), 0.0) + (1 - b1) * g[k]
            v = s[("v", k)] = b2 * s.get(("v", k), 0.0) + (1 - b2) * g[k] ** 2
            m_hat = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g[k] / (1 - b1**t)
            p[k] = p[k] - lr * m_hat / ((v / (1 - b2**t)).sqrt() + eps)

    return step


def deepspeed_adam_ref(lr: float, wd: float, adam_w_mode: bool) -> Callable:
    """DeepSpeed 0.19.8's ``FusedAdam(bias_correction=False)`` (betas 0.9,
    0.999, eps 1e-8), as ``ops/csrc/adam/multi_tensor_adam.cu`` writes it —
    ``bias_correction1 = bias_correction2 = 1`` unless ``bias_correction ==
    1``, so ``m / (sqrt(v) + eps)`` — and ``cpu_adam.h`` alike: ADAM_MODE_1
    (``adam_w_mode``) decays the param, ADAM_MODE_0 adds ``decay * p`` to
    the gradient (L2)."""
    b1, b2, eps = 0.9, 0.999, 1e-8

    def step(p: dict, g: dict, s: dict) -> None:
        for k in p:
            grad = g[k] if adam_w_mode else g[k] + wd * p[k]
            m = s[("m", k)] = b1 * s.get(("m", k), 0.0) + (1 - b1) * grad
            v = s[("v", k)] = b2 * s.get(("v", k), 0.0) + (1 - b2) * grad * grad
            update = m / (v.sqrt() + eps) + (wd * p[k] if adam_w_mode else 0.0)
            p[k] = p[k] - lr * update

    return step


T = torch.optim
OPTIMIZERS: dict[str, Case] = {
    "sgd": Case(lambda: optim.sgd(0.1), lambda ps: T.SGD(ps, lr=0.1)),
    "sgd_momentum": Case(
        lambda: optim.sgd(0.05, momentum=0.9), lambda ps: T.SGD(ps, lr=0.05, momentum=0.9)
    ),
    "sgd_nesterov_wd": Case(
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
        lambda ps: T.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    ),
    "adam": Case(lambda: optim.adam(1e-2), lambda ps: T.Adam(ps, lr=1e-2)),
    "adam_l2_amsgrad": Case(
        lambda: optim.adam(1e-2, b2=0.99, weight_decay=0.1, amsgrad=True),
        lambda ps: T.Adam(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=True),
    ),
    "adam_nesterov": Case(
        lambda: optim.adam(1e-2, nesterov=True), hand_ref=nadam_ref(1e-2, 0.9, 0.999, 1e-8)
    ),
    "adamw": Case(
        lambda: optim.adamw(1e-2, weight_decay=0.1),
        lambda ps: T.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ),
    "adamw_no_bias_correction": Case(
        lambda: optim.adamw(1e-3, weight_decay=0.1, bias_correction=False),
        hand_ref=deepspeed_adam_ref(1e-3, 0.1, adam_w_mode=True),
    ),
    "adam_l2_no_bias_correction": Case(
        lambda: optim.adam(1e-3, weight_decay=0.1, bias_correction=False),
        hand_ref=deepspeed_adam_ref(1e-3, 0.1, adam_w_mode=False),
    ),
    "adagrad": Case(
        lambda: optim.adagrad(0.1, initial_accumulator_value=0.1, weight_decay=0.01),
        lambda ps: T.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, weight_decay=0.01),
    ),
    "rmsprop": Case(lambda: optim.rmsprop(1e-2), lambda ps: T.RMSprop(ps, lr=1e-2)),
    "rmsprop_centered": Case(
        lambda: optim.rmsprop(1e-2, centered=True, weight_decay=0.01),
        lambda ps: T.RMSprop(ps, lr=1e-2, centered=True, weight_decay=0.01),
    ),
    "rmsprop_momentum": Case(
        lambda: optim.rmsprop(1e-2, momentum=0.9),
        lambda ps: T.RMSprop(ps, lr=1e-2, momentum=0.9),
        # torch applies the momentum buffer as one `param.add_(buf, alpha=-lr)`
        # (a single rounding, an FMA on some hosts); the chain rounds -lr * buf
        # first: an ulp a step, which the 0.9 momentum carries along.
        tol=1e-5,
    ),
    "lion": Case(
        lambda: optim.lion(1e-3, weight_decay=0.1), hand_ref=lion_ref(1e-3, 0.9, 0.99, 0.1)
    ),
    "lamb": Case(
        lambda: optim.lamb(1e-2, weight_decay=0.01),
        hand_ref=lamb_ref(1e-2, 0.9, 0.999, 1e-6, 0.01),
    ),
    "adafactor": Case(
        lambda: optim.adafactor(1e-2, min_dim_size_to_factor=2), hand_ref=adafactor_ref(1e-2)
    ),
}
NAMES = list(OPTIMIZERS)
FUSED = [
    "adam",
    "adamw",
    "adamw_no_bias_correction",
    "adam_l2_no_bias_correction",
    "adagrad",
    "rmsprop",
    "lion",
]  # the cases optim.fused_step runs in native passes


# -- the reference comparison -----------------------------------------------------


def init_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(4, 6, generator=g) * 0.5,
        "b1": torch.randn(6, generator=g) * 0.1,
        "w2": torch.randn(6, 3, generator=g) * 0.5,
    }


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def loss_fn(p: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    x, y = batch(step)
    return ((torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2).mean()


def grads_at(p: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
    grads = torch.autograd.grad(loss_fn(leaves, step), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def run_ours(case: Case, steps: int) -> dict[str, torch.Tensor]:
    opt = case.make()
    params = init_params()
    state = opt.init(params)
    for step in range(steps):
        updates, state = opt.update(grads_at(params, step), state, params)
        params = optim.apply_updates(params, updates)
    return params


def run_reference(case: Case, steps: int) -> dict[str, torch.Tensor]:
    params = init_params()
    if case.torch_ref is not None:
        tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
        opt = case.torch_ref(list(tensors.values()))
        for step in range(steps):
            opt.zero_grad()
            loss_fn(tensors, step).backward()
            opt.step()
        return {k: v.detach() for k, v in tensors.items()}
    state: dict = {}
    for step in range(steps):
        case.hand_ref(params, grads_at(params, step), state)
    return params


@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_over_50_steps(name):
    case = OPTIMIZERS[name]
    ours, ref = run_ours(case, 50), run_reference(case, 50)
    for k in ref:
        torch.testing.assert_close(
            ours[k], ref[k], rtol=case.tol, atol=case.tol, msg=f"{name}: {k}"
        )
    moved = sum((ours[k] - init_params()[k]).abs().sum() for k in ours)
    assert moved > 1e-3, f"{name} barely moved the params: the comparison would prove nothing"


# -- properties ------------------------------------------------------------------------


def _tensor_leaves(tree: Any) -> list[Any]:
    return [
        x
        for x in optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, sx.Sharded))
        if isinstance(x, torch.Tensor | sx.Sharded)
    ]


@pytest.mark.parametrize("name", NAMES)
def test_init_on_meta_params_gives_meta_state(name):
    params = {k: torch.empty_like(v, device="meta") for k, v in init_params().items()}
    state = OPTIMIZERS[name].make().init(params)
    shaped = [x for x in _tensor_leaves(state) if x.dim() > 0]
    assert all(x.device.type == "meta" for x in shaped)
    assert shaped or name == "sgd", "a stateful optimizer kept no param-shaped state"
    mesh = sx.Mesh({"dp": 1})
    sharded = {k: sx.Sharded(v, Layout(mesh, P("dp")), tuple(v.shape)) for k, v in params.items()}
    state = OPTIMIZERS[name].make().init(sharded)
    leaves = [x for x in _tensor_leaves(state) if isinstance(x, sx.Sharded)]
    assert all(x.device.type == "meta" and x.local.dim() == x.ndim for x in leaves)
    assert leaves or name == "sgd"


@pytest.mark.parametrize("master", [False, True], ids=["", "master-weights"])
@pytest.mark.parametrize("name", NAMES)
def test_update_mutates_nothing_it_is_given(name, master):
    """``update`` is pure: the params, the gradients and the state passed in
    are bit for bit what they were (also under ``with_master_weights``, and
    with the native kernels available)."""
    opt = OPTIMIZERS[name].make()
    params = init_params()
    if master:
        opt = optim.with_master_weights(opt)
        params = {k: v.to(torch.bfloat16) for k, v in params.items()}
    state = opt.init(params)
    for step in range(2):  # the second step sees non-zero state
        dense = {k: v.float() for k, v in params.items()}
        grads = {k: g.to(params[k].dtype) for k, g in grads_at(dense, step).items()}
        inputs = _tensor_leaves((params, grads, state))
        before = [x.clone() for x in inputs]
        updates, new_state = opt.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        for a, b in zip(before, inputs, strict=True):
            assert torch.equal(a, b), f"{name} mutated an input in step {step}"
        params, state = new_params, new_state


SKIPPED = {1, 2, 4}  # the steps at which b1 gets no gradient


@pytest.mark.parametrize(
    ("name", "via"), [(n, "update") for n in NAMES] + [(n, "fused") for n in FUSED]
)
def test_a_leaf_without_a_gradient_keeps_its_state_and_steps_as_if_alone(name, via):
    """The rule for leaves without a gradient: where b1's gradient is None
    its update is None and it keeps its value (the same tensor); where it
    gets one, it steps bit for bit as the optimizer on b1 alone (stepped
    the same way), given only those gradients — its state, its own step count included, was
    kept (as ``torch.optim`` keeps ``state["step"]`` per parameter), while
    the other leaves step every time. (Every optimizer here keeps per-leaf
    statistics; a global-norm clip would not.)"""
    make = OPTIMIZERS[name].make
    opt, params = make(), init_params()
    state = opt.init(params)
    alone = {k: (make(), {k: v}) for k, v in params.items()}
    alone = {k: (o, p, o.init(p)) for k, (o, p) in alone.items()}
    for step in range(6):
        grads = grads_at(params, step)
        if step in SKIPPED:
            grads["b1"] = None
        before = params["b1"]
        if via == "update":
            updates, state = opt.update(grads, state, params)
            assert (updates["b1"] is None) == (step in SKIPPED)
            params = optim.apply_updates(params, updates)
        else:
            params, state = optim.fused_step(opt).step(dict(params), grads, state)
        if step in SKIPPED:
            assert params["b1"] is before
        for k, g in grads.items():
            if g is None:
                continue
            o, p, s = alone[k]
            if via == "update":
                u, s = o.update({k: g}, s, p)
                alone[k] = (o, optim.apply_updates(p, u), s)
            else:
                alone[k] = (o, *optim.fused_step(o).step(p, {k: g}, s))
    for k, (_, p, _) in alone.items():
        torch.testing.assert_close(params[k], p[k], rtol=0, atol=0, msg=f"{name}: {k}")


@pytest.mark.parametrize("name", NAMES)
def test_sharded_leaves_at_world_size_1_equal_dense(name):
    case = OPTIMIZERS[name]
    mesh = sx.Mesh({"dp": 1})
    specs = {"w1": P("dp"), "b1": P(), "w2": P(None, "dp")}
    opt = case.make()
    params = sx.shard(init_params(), mesh, specs)
    state = opt.init(params)
    for step in range(5):
        grads = sx.shard(grads_at(sx.gather(params), step), mesh, specs)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        assert all(isinstance(x, sx.Sharded) for x in _tensor_leaves(params))
    dense = run_ours(case, 5)
    for k, v in sx.gather(params).items():
        torch.testing.assert_close(v, dense[k], rtol=0, atol=0, msg=f"{name}: {k}")


# -- on real ranks: ZeRO-1, ZeRO-2 and ZeRO-3 arrangements equal the dense run -----------

SHARDED_SPECS = {
    "w": P("dp", "tp"),  # (5, 3): uneven on both axes
    "v": P(("dp", "tp")),  # (6, 4) over 4 ranks: one empty shard
    "b": P(),  # replicated
    "e": P(None, "tp", "dp"),  # 3-d
}
SHAPES = {"w": (5, 3), "v": (6, 4), "b": (7,), "e": (4, 6, 3)}
STEPS = 3


def sharded_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def sharded_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def _arranged(dense: dict, mesh: sx.Mesh, arrangement: str) -> dict[str, sx.Sharded]:
    out = {}
    for k, x in dense.items():
        split = Layout(mesh, SHARDED_SPECS[k])
        if arrangement == "zero3":
            out[k] = sx.shard(x, mesh, split.spec)
            continue
        rep = Layout(mesh)
        grads = rep if arrangement == "zero1" else split
        y = sx.shard(x, mesh, P())
        out[k] = sx.Sharded(y.local, y.layout, y.shape, placement=Placement(rep, grads, split))
    return out


def _arranged_grads(dense: dict, mesh: sx.Mesh, arrangement: str) -> dict[str, sx.Sharded]:
    if arrangement == "zero3":
        return sx.shard(dense, mesh, SHARDED_SPECS)
    if arrangement == "zero1":
        return sx.shard(dense, mesh, P())
    # ZeRO-2: gradients as a data-parallel backward leaves them, pending sums
    # over dp (each dp rank holds half); the optimizer reduce-scatters them.
    partial = Layout(mesh, P(), partial="dp")
    return {k: sx.Sharded(v / 2, partial, tuple(v.shape)) for k, v in dense.items()}


def _run_sharded(names: list[str], arrangement: str, via: str = "update") -> dict:
    from shardax.optim._native import Native

    # the leaves the kernels stepped: 1 writing the params (the one-pass
    # step), 0 writing the updates (ZeRO-1/2: apply_updates gathers them)
    kernel_leaves: list[int] = []
    launch = Native.launch

    def spy(self, function, s0, s1, g, p, out, shadows, apply, scalars):  # type: ignore[no-untyped-def]
        kernel_leaves.extend([int(apply)] * sum(1 for t in out if t.numel()))
        return launch(self, function, s0, s1, g, p, out, shadows, apply, scalars)

    Native.launch = spy  # type: ignore[method-assign]
    try:
        return _run_sharded_spied(names, arrangement, via, kernel_leaves)
    finally:
        Native.launch = launch  # type: ignore[method-assign]


def _run_sharded_spied(names: list[str], arrangement: str, via: str, kernel_leaves: list) -> dict:
    mesh = sx.Mesh({"dp": 2, "tp": 2})
    out: dict = {"kernel leaves": kernel_leaves}
    for name in names:
        opt = OPTIMIZERS[name].make()
        params = _arranged(sharded_params(), mesh, arrangement)
        state = opt.init(params)
        wrong = [
            f"{x.shape}: {x.spec}"
            for x in _tensor_leaves(state)
            if isinstance(x, sx.Sharded)
            and x.shape in SHAPES.values()
            and x.spec != SHARDED_SPECS[next(k for k, s in SHAPES.items() if s == x.shape)]
        ]
        for step in range(STEPS):
            grads = _arranged_grads(sharded_grads(step), mesh, arrangement)
            if via == "fused":  # one pass (ZeRO-3), the kernels' updates applied (ZeRO-1/2)
                params, state = optim.fused_step(opt).step(params, grads, state)
            else:
                updates, state = opt.update(grads, state, params)
                params = optim.apply_updates(params, updates)
        layouts_kept = all(
            params[k].layout == _arranged(sharded_params(), mesh, arrangement)[k].layout
            for k in params
        )
        out[name] = (sx.gather(params), wrong, layouts_kept)
    return out


def _dense_run(name: str) -> dict[str, torch.Tensor]:
    opt = OPTIMIZERS[name].make()
    params = sharded_params()
    state = opt.init(params)
    for step in range(STEPS):
        updates, state = opt.update(sharded_grads(step), state, params)
        params = optim.apply_updates(params, updates)
    return params


def _torch_run(name: str) -> dict[str, torch.Tensor]:
    params = {k: v.clone().requires_grad_() for k, v in sharded_params().items()}
    opt = OPTIMIZERS[name].torch_ref(list(params.values()))
    for step in range(STEPS):
        for k, g in sharded_grads(step).items():
            params[k].grad = g
        opt.step()
    return {k: v.detach() for k, v in params.items()}


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("arrangement", "via"),
    [("zero1", "update"), ("zero2", "update"), ("zero3", "update"), ("zero1", "fused"),
     ("zero2", "fused"), ("zero3", "fused")],
)  # fmt: skip
def test_sharded_runs_equal_dense_on_a_2x2_mesh(arrangement, via):
    results = run_ranks(_run_sharded, NAMES, arrangement, via, world_size=4)
    kernel_leaves = results[0]["kernel leaves"]
    if via == "fused" and OPTIM.load() is not None:
        # every fused optimizer's leaves (rank 0 holds a piece of each), every
        # step, in one pass where the params are laid out like the state
        # (ZeRO-3); ZeRO-1/2's replicated params are not: the kernels write
        # the updates
        assert kernel_leaves == [int(arrangement == "zero3")] * STEPS * len(SHAPES) * len(FUSED)
    else:  # update is pure: the chains of transforms
        assert kernel_leaves == []
    for name in NAMES:
        dense = _dense_run(name)
        torch_ref = _torch_run(name) if OPTIMIZERS[name].torch_ref else None
        for rank, per_rank in enumerate(results):
            got, wrong, layouts_kept = per_rank[name]
            assert not wrong, f"{name}/{arrangement}: state not in the opt_state layout: {wrong}"
            assert layouts_kept, f"{name}/{arrangement}: apply_updates changed a param's layout"
            for k in dense:
                msg = f"{name}/{arrangement} rank {rank}: {k}"
                torch.testing.assert_close(got[k], dense[k], rtol=1e-5, atol=1e-6, msg=msg)
                if torch_ref is not None:
                    torch.testing.assert_close(got[k], torch_ref[k], rtol=1e-5, atol=1e-6, msg=msg)


def test_table_covers_every_optimizer():
    made = {OPTIMIZERS[n].make.__code__.co_names[-1] for n in NAMES}
    aliases = {"sgd", "adam", "adamw", "adagrad", "rmsprop", "lion", "lamb", "adafactor"}
    assert aliases <= made, aliases - made
