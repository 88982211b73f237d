"""0/1 Adam (Lu et al. 2022) on real gloo ranks, against DeepSpeed's
``ZeroOneAdam`` written out plainly on one process.

The simulation follows DeepSpeed's ``step()`` line by line: each rank's
params and momentum, the shared variance, the accumulated change
(``momentum_accumulator``) it adds to and undoes in place, and the
compressed averaging of ``simulate_pmean``. The ranks must give each rank's
params at every step to 1e-5, move what the schedule says (full precision on
the variance's steps, packed signs on the others, nothing on local steps),
lay their params out diverged between syncs, and checkpoint the mean."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _onebit_ref import (
    eval_loss,
    first_params,
    local_grads,
    one_thread,
    simulate_pmean,
    task_batch,
)
from _zero_net import BATCH, BETAS, EPS, LR, WD, Net, batch

import shardax as sx
from shardax import Layout, P
from shardax.collectives._onebit import onebit_chunk
from shardax.errors import ShardingError

# var_interval 1, 1, 2, 2 (doubling after 2 updates), then local intervals 1,
# 1, 2, 2, 4, ...: every kind of step in 16.
SCHEDULE = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2,
            "local_step_clipper": 4}  # fmt: skip
STEPS = 16


@one_thread()
def simulate(steps: int, world: int, wd: float, make_batch=batch) -> list[list[dict]]:
    """DeepSpeed's ZeroOneAdam on one process for ``world`` ranks of the
    small model, each rank's gradient that of its slice of the global batch
    at its own params: every rank's params after each step. Its count
    includes its initializing step (``ds = t + 1``)."""
    model, p0 = first_params()
    (b1, b2), keys, part = BETAS, sorted(p0), BATCH // world
    vfs, var_scaler = SCHEDULE["var_freeze_step"], SCHEDULE["var_update_scaler"]
    local_scaler, clipper = SCHEDULE["local_step_scaler"], SCHEDULE["local_step_clipper"]
    ps = [dict(p0) for _ in range(world)]
    mus = [{k: torch.zeros_like(v) for k, v in p0.items()} for _ in range(world)]
    nu = {k: torch.zeros_like(v) for k, v in p0.items()}
    buffers = [{k: torch.zeros_like(v) for k, v in p0.items()} for _ in range(world)]
    var_interval, var_counter, interval, counter, lrs = 1, 0, 1, 0, 0.0

    def zero_errors() -> tuple[dict, dict]:
        chunks = {k: onebit_chunk(v.numel(), world) for k, v in p0.items()}
        return (
            {k: [torch.zeros_like(v) for _ in range(world)] for k, v in p0.items()},
            {k: [torch.zeros(c) for _ in range(world)] for k, c in chunks.items()},
        )

    workers, servers = zero_errors()
    history = []
    for step in range(steps):
        t, x_y = step + 1, make_batch(step)
        ds, x, y = t + 1, *x_y
        own = [local_grads(model, ps[r], x[r * part : (r + 1) * part], y[r * part : (r + 1) * part])[1] for r in range(world)]  # fmt: skip
        if t == vfs + 1:  # freeze: reinitial_error_buffer
            workers, servers = zero_errors()
        frozen = t > vfs
        if not frozen and ds % var_interval == 0:  # the engine averaged the gradients
            g = {k: sum(o[k] / world for o in own) for k in keys}
            for k in keys:
                nu[k] = nu[k].mul(b2).addcmul_(g[k], g[k], value=1 - b2)
                for r in range(world):
                    mus[r][k] = mus[r][k].lerp(g[k], 1 - b1)
        elif not frozen:  # compressed_allreduce of each rank's own gradient
            for k in keys:
                mean, workers[k], servers[k] = simulate_pmean([o[k] for o in own], workers[k], servers[k])  # fmt: skip
                for r in range(world):
                    mus[r][k] = mus[r][k].lerp(mean, 1 - b1)
        else:
            for r in range(world):
                for k in keys:
                    mus[r][k] = mus[r][k].lerp(own[r][k], 1 - b1)
            lrs += LR
        sync = frozen and ds % interval == 0
        for r in range(world):
            for k in keys:
                update = mus[r][k] / (nu[k].sqrt() + EPS) + wd * ps[r][k]
                ps[r][k] = ps[r][k] + -LR * update
                if frozen:
                    buffers[r][k] = buffers[r][k] + -LR * update
        if sync:
            for k in keys:
                for r in range(world):
                    ps[r][k] = ps[r][k] - buffers[r][k]
                scaled = [buffers[r][k] * (nu[k].sqrt() + EPS) for r in range(world)]
                mean, workers[k], servers[k] = simulate_pmean(scaled, workers[k], servers[k])
                for r in range(world):
                    mus[r][k] = -(mean / lrs)
                    ps[r][k] = ps[r][k] + mean / (nu[k].sqrt() + EPS)
                    buffers[r][k] = torch.zeros_like(buffers[r][k])
            lrs = 0.0
        if not frozen:
            if ds % var_interval == 0:
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            counter += 1
            if counter == local_scaler:
                counter, interval = 0, min(clipper, interval * 2)
        history.append([dict(p) for p in ps])
    return history


def kinds() -> list[str]:
    """What each of the STEPS steps sends, by the schedule."""
    out, var_interval, var_counter, interval, counter = [], 1, 0, 1, 0
    for t in range(1, STEPS + 1):
        ds = t + 1
        if t <= SCHEDULE["var_freeze_step"]:
            full = ds % var_interval == 0
            out.append("full" if full else "1-bit")
            if full:
                var_counter += 1
                if var_counter == SCHEDULE["var_update_scaler"]:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            out.append("sync" if ds % interval == 0 else "local")
            counter += 1
            if counter == SCHEDULE["local_step_scaler"]:
                counter, interval = 0, min(SCHEDULE["local_step_clipper"], interval * 2)
    return out


def start(schedule: dict, wd: float = WD, lr: float = LR) -> tuple:
    """``(model, params, opt, state)`` on this rank: the small model's
    params replicated over dp, 0/1 Adam on ``schedule``."""
    mesh = sx.Mesh({"dp": -1})
    model, dense = first_params()
    params = {k: sx.Sharded(v, Layout(mesh, P()), v.shape) for k, v in dense.items()}
    opt = sx.optim.zero_one_adam(lr, BETAS[0], BETAS[1], EPS, wd, **schedule)
    return model, params, opt, opt.init(params)


def step(model, params: dict, opt, state, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """One step on this rank: its own gradient of its slice of the global
    batch at its own params, times 1/world, partial over dp."""
    mesh = next(iter(params.values())).mesh
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    mine = slice(i * BATCH // n, (i + 1) * BATCH // n)
    _, g = local_grads(model, {k: v.local for k, v in params.items()}, x[mine], y[mine])
    grads = {k: sx.Sharded(v / n, Layout(mesh, P(), partial="dp"), v.shape) for k, v in g.items()}  # fmt: skip
    updates, state = opt.update(grads, state, params)
    return sx.optim.apply_updates(params, updates), state


def zero_one_ranks(steps: int, wd: float) -> dict:
    """0/1 Adam on dp ranks, each step's params, traffic and layouts."""
    model, params, opt, state = start(SCHEDULE, wd)
    out: dict = {"params": [], "bytes": [], "diverged": []}
    for at in range(steps):
        with sx.collectives.traffic() as t:
            params, state = step(model, params, opt, state, *batch(at))
        out["params"].append({k: v.local.clone() for k, v in params.items()})
        out["bytes"].append(dict(t.bytes))
        out["diverged"].append({v.layout.diverged for v in params.values()})
    return out


@pytest.mark.world_size(2)
@pytest.mark.parametrize("wd", [0.0, WD])
def test_zero_one_adam_matches_deepspeeds_algorithm(wd):
    """16 steps on 2 ranks — full-precision and 1-bit variance-phase steps,
    then syncs and local steps as the interval doubles to 4 — give each
    rank's params of DeepSpeed's algorithm simulated on one process (1e-5:
    the sync undoes the local change in another order). What crosses is the
    schedule's: one fp32 all-reduce on the variance's steps, packed signs
    and scales on the 1-bit steps and the syncs, nothing on local steps;
    and the params are laid out diverged over dp from the first local step
    on, replicated before it."""
    results = run_ranks(zero_one_ranks, STEPS, wd, world_size=2)
    simulated = simulate(STEPS, 2, wd)
    _, dense = first_params()
    numel = sum(v.numel() for v in dense.values())
    packed = sum(2 * (onebit_chunk(v.numel(), 2) // 8 + 4) for v in dense.values())
    sent = {
        "full": {("psum", ("dp",)): 4 * numel},
        "1-bit": {("all_to_all", ("dp",)): packed, ("all_gather", ("dp",)): packed},
        "sync": {("all_to_all", ("dp",)): packed, ("all_gather", ("dp",)): packed},
        "local": {},
    }
    schedule = kinds()
    assert schedule == ["full"] * 3 + ["1-bit", "full", "1-bit"] + ["sync"] * 3 + ["local", "sync", "local", "local", "local", "sync", "local"]  # fmt: skip
    first_local = schedule.index("local")
    for rank, got in enumerate(results):
        for step in range(STEPS):
            for k, want in simulated[step][rank].items():
                at = f"rank {rank} {k} step {step + 1} ({schedule[step]})"
                torch.testing.assert_close(got["params"][step][k], want, rtol=1e-5, atol=1e-5, msg=at)  # fmt: skip
            assert got["bytes"][step] == sent[schedule[step]], (step + 1, schedule[step])
            assert got["diverged"][step] == ({("dp",)} if step >= first_local else {()})
    before = results[0]["params"][first_local - 1]
    torch.testing.assert_close(before, results[1]["params"][first_local - 1], rtol=0, atol=0)
    apart = [results[r]["params"][first_local]["emb.weight"] for r in range(2)]
    assert not torch.equal(*apart)  # each rank its own step


def applied_ranks(steps: int) -> list[dict]:
    """0/1 Adam in a plain train step: params from ``rules.zero(0)``, the
    forward through ``sx.apply`` (each rank's own copy once they diverge),
    ``value_and_grad(unreduced="dp")``."""
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(0))
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    opt = sx.optim.zero_one_adam(LR, BETAS[0], BETAS[1], EPS, WD, **SCHEDULE)
    state = opt.init(params)

    def loss_fn(params, x, y):
        return F.cross_entropy(sx.apply(model, params, x).flatten(0, 1), y.flatten())

    out = []
    for step in range(steps):
        x, y = batch(step)
        mine = slice(i * BATCH // n, (i + 1) * BATCH // n)
        _, grads = sx.value_and_grad(loss_fn, unreduced="dp")(params, x[mine], y[mine])
        updates, state = opt.update(grads, state, params)
        params = sx.optim.apply_updates(params, updates)
        out.append({k: v.local.clone() for k, v in params.items()})
    return out


@pytest.mark.world_size(2)
def test_zero_one_adam_in_a_train_step_computes_with_each_ranks_copy():
    """Through ``sx.apply`` and ``value_and_grad``, the same 16 steps give
    the simulation's params on each rank: once they diverge, each rank's
    forward runs on its own copy (its compute layout is diverged too), not
    on a mean."""
    simulated = simulate(STEPS, 2, WD)
    for rank, got in enumerate(run_ranks(applied_ranks, STEPS, world_size=2)):
        for step in range(STEPS):
            for k, want in simulated[step][rank].items():
                at = f"rank {rank} {k} step {step + 1}"
                torch.testing.assert_close(got[step][k], want, rtol=1e-5, atol=1e-5, msg=at)


def saved_ranks(tmp: str) -> dict:
    """After a local step: gather and a checkpoint give the ranks' mean;
    restored, every rank starts from it and trains on."""
    model, params, opt, state = start(SCHEDULE)
    for at in range(10):  # step 10 is the first local one
        params, state = step(model, params, opt, state, *batch(at))
    gathered = sx.gather(params["emb.weight"])
    sx.ckpt.save(f"{tmp}/ckpt", {"params": params, "opt": state})
    restored = sx.ckpt.load(f"{tmp}/ckpt", {"params": params, "opt": state})
    params2, state2 = restored["params"], restored["opt"]
    after, _ = step(model, params2, opt, state2, *batch(10))
    return {
        "local": params["emb.weight"].local.clone(),
        "gathered": gathered.clone(),
        "restored": params2["emb.weight"].local.clone(),
        "restored_layout": params2["emb.weight"].layout.diverged,
        "momentum_layout": state.mu["emb.weight"].layout.diverged,
        "after": after["emb.weight"].layout.diverged,
        "policy": state2.policy.tolist(),
        "finite": bool(torch.isfinite(after["emb.weight"].local).all()),
    }


@pytest.mark.world_size(2)
def test_diverged_params_gather_and_checkpoint_as_their_mean(tmp_path):
    """Between syncs the ranks hold different params, laid out diverged:
    ``gather`` and ``ckpt.save`` take their mean (one psum); a restored run
    starts every rank from it (in the template's layout), with the policy's
    counters, and steps on."""
    a, b = run_ranks(saved_ranks, str(tmp_path), world_size=2)
    assert not torch.equal(a["local"], b["local"])
    mean = (a["local"] + b["local"]) / 2
    for r in (a, b):
        torch.testing.assert_close(r["gathered"], mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["restored"], mean, rtol=1e-6, atol=1e-7)
        assert r["momentum_layout"] == r["restored_layout"] == ("dp",)  # the template's
        assert r["after"] == ("dp",) and r["finite"]
        assert r["policy"] == [4, 0, 4, 0]


TRAIN_STEPS, TRAIN_LR = 200, LR / 3
TRAIN = {"var_freeze_step": 60, "var_update_scaler": 8, "local_step_scaler": 40,
         "local_step_clipper": 4}  # fmt: skip
PLAIN = {"var_freeze_step": TRAIN_STEPS, "var_update_scaler": TRAIN_STEPS}  # every step fp32


def train_ranks(steps: int, schedule: dict) -> dict:
    model, params, opt, state = start(schedule, lr=TRAIN_LR)
    for at in range(steps):
        params, state = step(model, params, opt, state, *task_batch(at))
    return {k: sx.gather(v) for k, v in params.items()}


@pytest.mark.world_size(2)
def test_zero_one_adam_trains_like_its_uncompressed_run():
    """200 steps of the small model on 2 ranks — the variance updated ever
    more rarely until step 60, then local intervals up to 4 — end with the
    held-out loss of the ranks' mean params within 2% of the same optimizer
    never compressing (every step a full-precision variance step; measured:
    0.3%), far below where it started."""
    start = eval_loss(first_params()[1])
    plain = eval_loss(run_ranks(train_ranks, TRAIN_STEPS, PLAIN, world_size=2)[0])
    got = [eval_loss(p) for p in run_ranks(train_ranks, TRAIN_STEPS, TRAIN, world_size=2)]
    assert got[0] == got[1]
    assert plain < 0.6 * start
    assert abs(got[0] - plain) <= 0.02 * plain, (start, plain, got[0])


def test_zero_one_adam_refuses_what_it_cannot_run():
    mesh = sx.Mesh({"dp": 1})
    params = {"w": sx.Sharded(torch.ones(2, 3), Layout(mesh, P()), (2, 3))}
    opt = sx.optim.zero_one_adam(0.1, var_freeze_step=2, weight_decay=0.1)
    state = opt.init(params)
    summed = sx.Sharded(torch.ones(2, 3), Layout(mesh, P()), (2, 3))
    with pytest.raises(ShardingError, match=r"gradient 'w' .*already summed"):
        opt.update({"w": summed}, state, params)
    partial = sx.Sharded(torch.ones(2, 3), Layout(mesh, P(), partial="dp"), (2, 3))
    with pytest.raises(ValueError, match="zero_one_adam needs the params"):
        opt.update({"w": partial}, state)
    with pytest.raises(ShardingError, match=r"'w' .*split over \['dp'\]"):
        opt.init({"w": sx.shard(torch.ones(4), mesh, P("dp"))})
    for bad in ({"var_freeze_step": 0}, {"var_freeze_step": 2, "local_step_clipper": 0},
                {"var_freeze_step": 2, "var_update_scaler": 1.5}):  # fmt: skip
        with pytest.raises(ValueError, match="must be an int >= 1"):
            sx.optim.zero_one_adam(0.1, **bad)
    assert optree.tree_structure(state.mu) == optree.tree_structure(params, is_leaf=lambda x: isinstance(x, sx.Sharded))  # fmt: skip
