"""Training parity: value_and_grad + apply under ZeRO 0–3 on real gloo ranks
match the single-process PyTorch reference (same init, same global batch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _zero_net import (
    BATCH,
    BETAS,
    EPS,
    LR,
    WD,
    Block,
    Net,
    assert_matches,
    batch,
    reference,
    traced_adamw_steps,
)
from torch import nn

import shardax as sx
from shardax import P


def _loss(params, model, x, y):
    return F.cross_entropy(sx.apply(model, params, x).flatten(0, 1), y.flatten())


def train_ranks(stage: int, steps: int):
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(stage))
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    opt_state = opt.init(params)
    layouts = {k: (v.layout, opt_state[0].mu[k].layout) for k, v in params.items()}
    losses, grads = [], []
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    for step in range(steps):
        x, y = batch(step)
        local = slice(i * BATCH // n, (i + 1) * BATCH // n)
        loss, g = sx.value_and_grad(_loss)(params, model, x[local], y[local])
        grads.append(sx.gather(g))
        updates, opt_state = opt.update(g, opt_state, params)
        params = sx.optim.apply_updates(params, updates)
        losses.append(loss.item())
    return losses, grads, sx.gather(params), layouts, {k: v.layout for k, v in g.items()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_adamw_matches_pytorch(stage, world_size):
    """Five AdamW steps under ZeRO-``stage``: losses, every step's gradients
    and the final parameters equal torch.optim.AdamW's on one process, and
    each role lives where the stage says."""
    ref_losses, ref_grads, ref_params = reference(5)
    results = run_ranks(train_ranks, stage, 5, world_size=world_size)
    for losses, grads, params, layouts, grad_layouts in results:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for g, rg in zip(grads, ref_grads, strict=True):
            assert sorted(g) == sorted(rg)
            for k in rg:
                torch.testing.assert_close(g[k], rg[k], rtol=1e-5, atol=1e-6, msg=k)
        assert sorted(params) == sorted(ref_params)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-5, msg=k)
        split = {"params": stage >= 3, "grads": stage >= 2, "opt_state": stage >= 1}
        param_layout, state_layout = layouts["blocks.0.up.weight"]
        assert ("dp" in param_layout.spec.axes) == split["params"]
        assert ("dp" in grad_layouts["blocks.0.up.weight"].spec.axes) == split["grads"]
        assert ("dp" in state_layout.spec.axes) == split["opt_state"]


def variants_ranks(bucket_bytes: int, prefetch: bool, units):
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(3))
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    x, y = batch(0)
    local = slice(i * BATCH // n, (i + 1) * BATCH // n)

    def loss_fn(p):
        logits = sx.apply(model, p, x[local], prefetch=prefetch, units=units)
        return F.cross_entropy(logits.flatten(0, 1), y[local].flatten())

    _, g = sx.value_and_grad(loss_fn, bucket_bytes=bucket_bytes)(params)
    return sx.gather(g)


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize(
    ("bucket_bytes", "prefetch", "units"),
    [(1, False, None), (200, True, None), (2**30, True, r"blocks\.\d+\.up"), (512, True, "")],
)
def test_buckets_prefetch_and_units_do_not_change_grads(bucket_bytes, prefetch, units, world_size):
    _, ref_grads, _ = reference(1)
    for g in run_ranks(variants_ranks, bucket_bytes, prefetch, units, world_size=world_size):
        for k in ref_grads[0]:
            torch.testing.assert_close(g[k], ref_grads[0][k], rtol=1e-5, atol=1e-6, msg=k)


SEEN: list = []


class Spy(Block):
    """A block that notes which storage its weight lived in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.multiprocessing.reductions import StorageWeakRef

        SEEN.append(StorageWeakRef(self.up.weight.untyped_storage()))
        return super().forward(x)


def released_ranks(under_tape: bool) -> tuple[int, int]:
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
        model.blocks = nn.ModuleList([Spy(), Spy()])
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(3))
    x, y = batch(0)
    alive = []

    def loss_fn(p):
        SEEN.clear()
        loss = F.cross_entropy(sx.apply(model, p, x).flatten(0, 1), y.flatten())
        alive.append(sum(not r.expired() for r in SEEN))
        return loss

    if under_tape:
        sx.value_and_grad(loss_fn)(params)
    else:  # plain autograd through the gathers keeps what it saved
        params = {k: v.with_local(v.local.requires_grad_()) for k, v in params.items()}
        loss_fn(params).backward()
    return alive[0], len(SEEN)


@pytest.mark.parametrize("world_size", [2])
def test_zero3_does_not_keep_gathered_params_for_backward(world_size):
    """Under value_and_grad the gathered weights' storage is freed when their
    block's forward ends (backward gathers them again); plain autograd keeps
    it alive, which shows the probe can fail."""
    assert run_ranks(released_ranks, True, world_size=world_size) == [(0, 2)] * 2
    assert run_ranks(released_ranks, False, world_size=world_size) == [(2, 2)] * 2


def dropped_ranks() -> tuple[list[bool], str]:
    """One ZeRO-3 step with the garbage collector off: whether each
    gradient the call returned (and the leaf it tracked) is freed once the
    caller drops it; and what a backward after the call through a second
    output (returned as aux) says."""
    import gc
    import weakref

    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(3))
    x, y = batch(0)

    def loss_fn(p):
        other = sx.apply(model, p, x)  # not part of the loss: its graph outlives the call
        return _loss(p, model, x, y), other

    gc.disable()
    try:
        _, grads = sx.value_and_grad(_loss)(params, model, x, y)
        freed = [weakref.ref(g.local) for g in grads.values() if g is not None]
        del grads
        freed_now = [r() is None for r in freed]
    finally:
        gc.enable()
    (_, other), _ = sx.value_and_grad(loss_fn, has_aux=True)(params)
    try:
        other.sum().backward()
        said = "no error"
    except sx.ShardingError as err:
        said = str(err)
    return freed_now, said


@pytest.mark.parametrize("world_size", [2])
def test_value_and_grad_leaves_no_cycle_that_keeps_gradients_alive(world_size):
    """The run's regather and the run refer to each other; the call breaks
    that when backward is over, so the gradients (and the step's old
    parameters) go when the caller drops them, not at the collector's next
    pass — which kept 768 MiB alive in the wide example's offloaded step.
    A backward after the call through a graph it left behind is refused."""
    for freed, said in run_ranks(dropped_ranks, world_size=world_size):
        assert freed and all(freed), freed
        assert "after its value_and_grad call ended" in said, said


def hsdp_ranks(stage: int, steps: int):
    """``train_ranks`` on a 2 × 2 mesh: ZeRO-``stage`` over ``fsdp`` inside
    each replica, the batch split over both axes."""
    mesh = sx.Mesh({"replicate": 2, "fsdp": -1})
    rules = sx.rules.zero(stage, "fsdp")
    losses, grads, moved, params, g = traced_adamw_steps(mesh, rules, ("replicate", "fsdp"), steps)
    layout = {k: (v.layout.spec, g[k].layout.spec) for k, v in params.items()}
    return losses, grads, sx.gather(params), layout, moved


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_matches_pytorch(stage, world_size):
    """HSDP (MiCS): ZeRO-``stage`` over ``fsdp`` inside each replica,
    replicas over ``replicate``, the batch split over both. Five AdamW steps
    equal one process (losses, every gradient, the parameters); parameters
    and gradients are split over ``fsdp`` only; and a step moves what the
    formula says, for ``P`` fp32 parameters: gradients reduce-scattered over
    ``fsdp`` (4P bytes in), the ``1/fsdp`` shard all-reduced over
    ``replicate`` (4P/2) — the only traffic across replicas — and under
    ZeRO-3 the parameters all-gathered over ``fsdp`` twice (forward and
    backward: 8P)."""
    ref_losses, ref_grads, ref_params = reference(5)
    size = 4 * sum(t.numel() for t in ref_params.values())
    want = {("psum_scatter", ("fsdp",)): size, ("psum", ("replicate",)): size // 2}
    want[("pmean", ("replicate", "fsdp"))] = 4  # the loss
    if stage == 3:
        want[("all_gather", ("fsdp",))] = 2 * size
    runs = run_ranks(hsdp_ranks, stage, 5, world_size=world_size)
    for losses, grads, params, layout, moved in runs:
        assert_matches(losses, grads, params, ref_losses, ref_grads, ref_params)
        assert layout["blocks.0.up.weight"] == (P("fsdp") if stage == 3 else P(), P("fsdp"))
        assert moved == [want] * 5


PERSIST = 100  # of Net's leaves, the norms and biases (10 or 30 elements) stay whole


def zero3_ranks(steps: int, **options):
    """``steps`` AdamW steps under ``rules.zero(3, **options)``: the losses,
    gradients and params; each step's traffic in ``value_and_grad`` and in
    the update; the params and grads layouts; how many of the blocks'
    gathered weights were still alive when the forward ended."""
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
        model.blocks = nn.ModuleList([Spy(), Spy()])
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(3, **options))
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    opt_state = opt.init(params)
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    losses, grads, moved, alive = [], [], [], []

    def loss_fn(p, x, y):
        SEEN.clear()
        loss = _loss(p, model, x, y)
        alive.append(sum(not r.expired() for r in SEEN))
        return loss

    for step in range(steps):
        x, y = batch(step)
        local = slice(i * BATCH // n, (i + 1) * BATCH // n)
        with sx.collectives.traffic() as t:
            loss, g = sx.value_and_grad(loss_fn)(params, x[local], y[local])
        grads.append(sx.gather(g))
        with sx.collectives.traffic() as u:
            updates, opt_state = opt.update(g, opt_state, params)
            params = sx.optim.apply_updates(params, updates)
        moved.append((dict(t.bytes), dict(u.bytes)))
        losses.append(loss.item())
    layout = {k: (v.layout.spec, g[k].layout.spec) for k, v in params.items()}
    return losses, grads, sx.gather(params), layout, moved, alive


@pytest.mark.parametrize("world_size", [2])
def test_zero3_keeps_parameters_below_the_persistence_threshold_whole(world_size):
    """``rules.zero(3, persist_below=N)`` (DeepSpeed's
    ``stage3_param_persistence_threshold``): five AdamW steps equal one
    process; the leaves of fewer than N elements stay whole on every rank,
    their gradients split; and a step moves what the formula says, for ``S``
    split and ``Q`` whole fp32 elements: the split ones all-gathered in
    forward and backward (8S bytes), every gradient reduce-scattered
    (4(S+Q)), and the whole ones' updates all-gathered once (4Q) — two
    transfers of theirs a step instead of three."""
    ref_losses, ref_grads, ref_params = reference(5)
    small = {k for k, v in ref_params.items() if v.numel() < PERSIST}
    assert small == {k for k in ref_params if k.endswith((".bias", "norm.weight"))}
    whole = 4 * sum(ref_params[k].numel() for k in small)
    split = 4 * sum(v.numel() for k, v in ref_params.items() if k not in small)
    grad_step = {
        ("all_gather", ("dp",)): 2 * split,
        ("psum_scatter", ("dp",)): split + whole,
        ("pmean", ("dp",)): 4,  # the loss
    }
    update_step = {("all_gather", ("dp",)): whole}
    runs = run_ranks(zero3_ranks, 5, persist_below=PERSIST, world_size=world_size)
    for losses, grads, params, layout, moved, _ in runs:
        assert_matches(losses, grads, params, ref_losses, ref_grads, ref_params)
        assert layout["blocks.0.up.bias"] == (P(), P("dp"))
        assert layout["blocks.0.up.weight"] == (P("dp"), P("dp"))
        assert moved == [(grad_step, update_step)] * 5


@pytest.mark.parametrize("world_size", [2])
def test_zero3_keeping_the_gathered_parameters_gathers_once_a_step(world_size):
    """``rules.zero(3, keep_gathered=True)`` (FSDP2's
    ``reshard_after_forward=False``): five AdamW steps equal one process;
    the blocks' gathered weights are still alive when the forward ends
    (plain ZeRO-3 has let both go: see above), and a step gathers the
    parameters once, for the forward (4P bytes, not 8P), beside the
    gradients' reduce-scatter (4P); the update moves nothing."""
    ref_losses, ref_grads, ref_params = reference(5)
    size = 4 * sum(t.numel() for t in ref_params.values())
    grad_step = {
        ("all_gather", ("dp",)): size,
        ("psum_scatter", ("dp",)): size,
        ("pmean", ("dp",)): 4,  # the loss
    }
    runs = run_ranks(zero3_ranks, 5, keep_gathered=True, world_size=world_size)
    for losses, grads, params, layout, moved, alive in runs:
        assert_matches(losses, grads, params, ref_losses, ref_grads, ref_params)
        assert layout["blocks.0.up.weight"] == (P("dp"), P("dp"))
        assert moved == [(grad_step, {})] * 5
        assert alive == [2] * 5
    with pytest.raises(sx.ShardingError, match="choose one of keep_gathered and secondary"):
        sx.rules.zero(3, ("node", "local"), keep_gathered=True, secondary="local")
    with pytest.raises(sx.ShardingError, match=r"use rules.zero\(3, keep_gathered=True\)"):
        sx.rules.zero(2, keep_gathered=True)


def test_persist_below_is_refused_where_nothing_splits_the_parameters():
    with pytest.raises(sx.ShardingError, match=r"rules.zero\(3, persist_below=...\)"):
        sx.rules.zero(2, persist_below=100)
    with pytest.raises(sx.ShardingError, match="a number of elements >= 0"):
        sx.rules.zero(3, persist_below=-1)


def unreduced_ranks(stage: int):
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(stage))
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    x, y = batch(0)
    local = slice(i * BATCH // n, (i + 1) * BATCH // n)
    with sx.collectives.traffic() as t:
        _, g = sx.value_and_grad(_loss, unreduced="dp")(params, model, x[local], y[local])
    own = {k: v.local.clone() for k, v in g.items()}
    assert all(v.layout.partial == ("dp",) for v in g.values())
    return own, sx.gather(g), dict(t.bytes)


@pytest.mark.parametrize("world_size", [2])
def test_unreduced_gradients_are_each_ranks_own_contribution(world_size):
    """``value_and_grad(unreduced="dp")``: each rank's gradient is its own
    contribution (the gradient of its local loss over the world size),
    partial over ``dp``: nothing is reduced (only the loss's pmean moves),
    and their sum — what ``gather`` gives — is one process's gradient. A
    gradient split over ``dp`` (ZeRO-2) is refused by name."""
    _, ref_grads, _ = reference(1)
    runs = run_ranks(unreduced_ranks, 0, world_size=world_size)
    for k in ref_grads[0]:
        torch.testing.assert_close(
            runs[0][0][k] + runs[1][0][k], ref_grads[0][k], rtol=1e-5, atol=1e-6
        )
        assert not torch.equal(runs[0][0][k], runs[1][0][k]), k
    for _, gathered, moved in runs:
        assert moved == {("pmean", ("dp",)): 4}
        for k in ref_grads[0]:
            torch.testing.assert_close(gathered[k], ref_grads[0][k], rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match=r"is split over \['dp'\].*ZeRO-0 or 1 there"):
        run_ranks(unreduced_ranks, 2, world_size=world_size)
