"""1-bit Adam (Tang et al. 2021), 1-bit LAMB (Li et al. 2022) and their
collective, on real gloo ranks.

``onebit_pmean`` equals a plain single-process simulation of the algorithm
(compress per rank, chunk, server average, compress, gather) over calls that
carry the errors, and moves packed signs, not fp32; ``onebit_adam`` equals
``torch.optim.AdamW`` through the warm-up and a single-process simulation of
1-bit Adam after the freeze (also under tensor parallelism), trains the small
model of ``_zero_net`` as well as AdamW does, and refuses gradients it would
average twice or not at all; ``onebit_lamb`` equals DeepSpeed's algorithm
simulated on one process and trains as well as uncompressed LAMB."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _onebit_ref import (
    adamw_train,
    eval_loss,
    first_params,
    local_grads,
    one_thread,
    simulate_pmean,
    task_batch,
)
from _zero_net import BATCH, BETAS, EPS, LR, WD, batch

import shardax as sx
from shardax import Layout, P
from shardax.collectives._onebit import (
    onebit_chunk,
    onebit_errors,
    onebit_pmean,
    onebit_pmean_many,
)
from shardax.errors import CollectiveError, ShardingError

# -- the collective ----------------------------------------------------------------


def rank_input(shape: tuple, call: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=g) * (1.0 + rank)


def pmean_ranks(shape: tuple, calls: int) -> dict:
    mesh = sx.Mesh({"dp": -1})
    rank = mesh.axis_index("dp")
    x = rank_input(shape, 0, rank)
    worker, server = onebit_errors(x, "dp", mesh=mesh)
    out = {"mean": [], "worker": [], "server": [], "bytes": []}
    for call in range(calls):
        x = rank_input(shape, call, rank)
        with sx.collectives.traffic() as t:
            mean, worker, server = onebit_pmean(x, worker, server, "dp", mesh=mesh)
        for key, value in (("mean", mean), ("worker", worker), ("server", server)):
            out[key].append(value.clone())
        out["bytes"].append(dict(t.bytes))
    return out


SHAPES = [(5, 7), (64,), (3,), (4, 8, 9)]  # padded for 2 and 4 ranks, even, mostly padding, 3-d


@pytest.mark.parametrize("world_size", [2, 4])
def test_onebit_pmean_equals_the_simulation(world_size):
    """Four calls with the errors carried, for each shape: every rank gets the
    simulated mean and keeps its simulated errors (1e-6: the same fp32
    operations in the same order, so only the arithmetic of the pack and
    unpack could differ, and it is exact); the first call's worker error is
    ``x - rms(x) * sign(x)``; and what travels is the packed signs and the
    scales: ``world * (chunk / 8 + 4)`` bytes in each of the two
    collectives."""
    calls = 4
    for shape in SHAPES:
        results = run_ranks(pmean_ranks, shape, calls, world_size=world_size)
        n, chunk = math.prod(shape), onebit_chunk(math.prod(shape), world_size)
        workers = [torch.zeros(shape) for _ in range(world_size)]
        servers = [torch.zeros(chunk) for _ in range(world_size)]
        for call in range(calls):
            xs = [rank_input(shape, call, r) for r in range(world_size)]
            mean, workers, servers = simulate_pmean(xs, workers, servers)
            for r, got in enumerate(results):
                at = f"{shape} call {call} rank {r}"
                torch.testing.assert_close(got["mean"][call], mean, rtol=0, atol=1e-6, msg=at)
                torch.testing.assert_close(got["worker"][call], workers[r], rtol=0, atol=1e-6, msg=at)  # fmt: skip
                torch.testing.assert_close(got["server"][call], servers[r], rtol=0, atol=1e-6, msg=at)  # fmt: skip
                packed = world_size * (chunk // 8 + 4)
                assert got["bytes"][call] == {
                    ("all_to_all", ("dp",)): packed,
                    ("all_gather", ("dp",)): packed,
                }, at
        for r, got in enumerate(results):  # with zero errors: x - decompressed(x)
            x = rank_input(shape, 0, r)
            rms = x.norm() / math.sqrt(n)
            expected = x - rms * torch.where(x >= 0, 1.0, -1.0)
            torch.testing.assert_close(got["worker"][0], expected, rtol=0, atol=1e-6)


def big_traffic() -> dict:
    mesh = sx.Mesh({"dp": -1})
    x = torch.randn(4096)
    worker, server = onebit_errors(x, "dp", mesh=mesh)
    with sx.collectives.traffic() as t:
        onebit_pmean(x, worker, server, "dp", mesh=mesh)
    return dict(t.bytes)


@pytest.mark.world_size(2)
def test_onebit_pmean_moves_a_sixteenth_of_an_all_reduce():
    """4096 fp32 elements (16 KiB) on 2 ranks: 256 bytes of signs and 4 of
    scale per row, two rows in each collective — 1040 bytes in all, where a
    psum moves 16384."""
    for got in run_ranks(big_traffic, world_size=2):
        assert got == {("all_to_all", ("dp",)): 520, ("all_gather", ("dp",)): 520}


def many_ranks() -> tuple:
    mesh = sx.Mesh({"dp": -1})
    rank = mesh.axis_index("dp")
    xs = [rank_input(shape, 0, rank) for shape in SHAPES]
    workers, servers = zip(*(onebit_errors(x, "dp", mesh=mesh) for x in xs), strict=True)
    with sx.collectives.traffic() as t:
        many = onebit_pmean_many(xs, workers, servers, "dp", mesh=mesh)
    one = [
        onebit_pmean(x, w, s, "dp", mesh=mesh) for x, w, s in zip(xs, workers, servers, strict=True)
    ]
    return many, [list(o) for o in zip(*one, strict=True)], dict(t.calls)


@pytest.mark.world_size(2)
def test_onebit_pmean_many_is_one_call_each():
    """Several tensors in one all-to-all and one all-gather: the very numbers
    of one onebit_pmean each."""
    for many, one, calls in run_ranks(many_ranks, world_size=2):
        torch.testing.assert_close(many, one, rtol=0, atol=0)
        assert calls == {("all_to_all", ("dp",)): 1, ("all_gather", ("dp",)): 1}


def test_onebit_pmean_on_one_rank_is_exact():
    mesh = sx.Mesh({"dp": 1})
    x = torch.randn(3, 5)
    worker, server = onebit_errors(x, "dp", mesh=mesh)
    assert worker.shape == x.shape and server.shape == (16,)
    with sx.collectives.traffic() as t:
        mean, w, s = onebit_pmean(x, worker, server, "dp", mesh=mesh)
    assert torch.equal(mean, x) and mean is not x
    assert w is worker and s is server and t.bytes == {}


def test_onebit_pmean_refuses_bad_buffers():
    mesh = sx.Mesh({"dp": 1})
    x = torch.randn(3, 5)
    worker, server = onebit_errors(x, "dp", mesh=mesh)
    with pytest.raises(CollectiveError, match=r"worker_error .* shape \(15,\).*\(3, 5\).*onebit_errors"):  # fmt: skip
        onebit_pmean(x, worker.view(-1), server, "dp", mesh=mesh)
    with pytest.raises(CollectiveError, match=r"server_error .* shape \(8,\).*\(16,\).*chunk"):
        onebit_pmean(x, worker, server[:8], "dp", mesh=mesh)
    with pytest.raises(CollectiveError, match=r"torch.float16 of shape \(3, 5\).*x.float\(\)"):
        onebit_pmean(x.half(), worker, server, "dp", mesh=mesh)
    with pytest.raises(CollectiveError, match="needs a mesh"):
        onebit_pmean(x, worker, server, "dp")


# -- the optimizer -------------------------------------------------------------------


def adam_ranks(
    steps: int, freeze: int, bias_correction: bool, make_batch=batch, clip: float | None = None
) -> dict:
    """1-bit Adam on ``dp`` ranks: each rank's own gradient of its slice of the
    global batch, times 1/world, as a gradient partial over dp."""
    mesh = sx.Mesh({"dp": -1})
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    model, dense = first_params()
    params = {k: sx.Sharded(v, Layout(mesh, P()), v.shape) for k, v in dense.items()}
    opt = sx.optim.onebit_adam(LR, BETAS[0], BETAS[1], EPS, WD, freeze_step=freeze,
                               bias_correction=bias_correction, max_grad_norm=clip)  # fmt: skip
    state = opt.init(params)
    out: dict = {"params": [], "losses": [], "bytes": []}
    for step in range(steps):
        x, y = make_batch(step)
        mine = slice(i * BATCH // n, (i + 1) * BATCH // n)
        loss, g = local_grads(model, {k: v.local for k, v in params.items()}, x[mine], y[mine])
        grads = {k: sx.Sharded(v / n, Layout(mesh, P(), partial="dp"), v.shape) for k, v in g.items()}  # fmt: skip
        with sx.collectives.traffic() as t:
            updates, state = opt.update(grads, state, params)
        params = sx.optim.apply_updates(params, updates)
        out["params"].append({k: v.local.clone() for k, v in params.items()})
        out["losses"].append(loss.item())
        out["bytes"].append(dict(t.bytes))
    return out


@one_thread()
def simulate(p: dict, contributions_at, steps: int, freeze: int, world: int, bias_correction: bool, clip: float | None = None) -> list[dict]:  # fmt: skip
    """1-bit Adam on one process from params ``p``: ``contributions_at(step,
    p)`` gives every rank's gradient contribution; their sum for Adam until
    the freeze, then each rank's momentum and the compressed averaging of
    :func:`simulate_pmean`. The same fp32 operations as the ranks; the
    params after each step."""
    (b1, b2), keys = BETAS, sorted(p)
    mu = {k: torch.zeros_like(v) for k, v in p.items()}
    nu = {k: torch.zeros_like(v) for k, v in p.items()}
    workers = {k: [torch.zeros_like(v) for _ in range(world)] for k, v in p.items()}
    servers = {
        k: [torch.zeros(onebit_chunk(v.numel(), world)) for _ in range(world)] for k, v in p.items()
    }
    history = []
    for step in range(steps):
        contributions = contributions_at(step, p)
        t = step + 1
        summed = {k: sum(c[k] for c in contributions) for k in keys}  # psum's order on 2 ranks
        own = [{k: c[k] * world for k in keys} for c in contributions]
        if clip is not None:  # the summed gradient by its norm; then each rank's own by its own
            summed, *own = [_clip(g, clip) for g in (summed, *own)]
        for k in keys:
            if t <= freeze:
                g = summed[k]
                mu[k] = mu[k].lerp(g, 1 - b1)
                nu[k] = nu[k].mul(b2).addcmul_(g, g, value=1 - b2)
            else:
                mine = [mu[k].lerp(o[k], 1 - b1) for o in own]
                mu[k], workers[k], servers[k] = simulate_pmean(mine, workers[k], servers[k])
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2 ** min(t, freeze) if bias_correction else 1.0
        u = [mu[k].div(nu[k].sqrt().div_(math.sqrt(bc2)).add_(EPS)).div_(bc1) for k in keys]
        torch._foreach_add_(u, [p[k] for k in keys], alpha=WD)
        torch._foreach_mul_(u, -LR)
        p = {k: p[k] + uk for k, uk in zip(keys, u, strict=True)}
        history.append(p)
    return history


def _clip(grads: dict, max_norm: float) -> dict:
    """``torch.nn.utils.clip_grad_norm_``'s scaling of ``grads``."""
    norm = torch.stack([g.norm() for g in grads.values()]).norm()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return {k: g * coef for k, g in grads.items()}


def simulate_adam(
    steps: int, freeze: int, world: int, bias_correction: bool, clip: float | None = None
) -> list[dict]:
    """:func:`simulate` on the small model, each rank's gradient that of its
    slice of the global batch."""
    model, p = first_params()
    part = BATCH // world

    def contributions_at(step: int, p: dict) -> list[dict]:
        x, y = batch(step)
        mine = [slice(r * part, (r + 1) * part) for r in range(world)]
        grads = [local_grads(model, p, x[s], y[s])[1] for s in mine]
        return [{k: g / world for k, g in gs.items()} for gs in grads]

    return simulate(p, contributions_at, steps, freeze, world, bias_correction, clip)


def adamw_reference(steps: int) -> list[dict]:
    """``torch.optim.AdamW`` on the global batch: same init, same data."""
    model, _ = first_params()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    history = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        history.append({k: v.detach().clone() for k, v in sx.params_of(model).items()})
    return history


FREEZE, STEPS = 3, 9


@pytest.mark.world_size(2)
@pytest.mark.parametrize("bias_correction", [True, False])
def test_onebit_adam_matches_adamw_then_the_simulation(bias_correction):
    """Three warm-up steps equal torch.optim.AdamW on one process (1e-5: the
    gradient summed from two half-batch means, fp32 over a few steps), and
    all nine — six of them compressed — equal the single-process simulation
    of 1-bit Adam (1e-5; the same operations, so in practice exact). The
    warm-up moves one fp32 all-reduce of the whole model a step; the
    compressed steps only packed signs and scales."""
    results = run_ranks(adam_ranks, STEPS, FREEZE, bias_correction, world_size=2)
    simulated = simulate_adam(STEPS, FREEZE, 2, bias_correction)
    reference = adamw_reference(FREEZE) if bias_correction else []
    _, dense = first_params()
    numel = sum(v.numel() for v in dense.values())
    packed = sum(2 * (onebit_chunk(v.numel(), 2) // 8 + 4) for v in dense.values())
    for got in results:
        for step in range(STEPS):
            for k, want in simulated[step].items():
                at = f"{k} step {step + 1}"
                torch.testing.assert_close(got["params"][step][k], want, rtol=1e-5, atol=1e-5, msg=at)  # fmt: skip
            if step < len(reference):
                for k, want in reference[step].items():
                    at = f"{k} step {step + 1} (AdamW)"
                    torch.testing.assert_close(got["params"][step][k], want, rtol=1e-5, atol=1e-5, msg=at)  # fmt: skip
            if step < FREEZE:
                assert got["bytes"][step] == {("psum", ("dp",)): 4 * numel}
            else:
                assert got["bytes"][step] == {
                    ("all_to_all", ("dp",)): packed,
                    ("all_gather", ("dp",)): packed,
                }
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)


@pytest.mark.world_size(2)
def test_onebit_adam_clips_as_deepspeed():
    """``max_grad_norm``: during the warm-up the summed gradient is clipped
    by its global norm, after the freeze each rank's own gradient by its
    own norm (DeepSpeed's engine clips what it holds: the averaged
    gradient, then the local one). Nine steps equal the simulation that
    clips so, to 1e-5, and differ from the unclipped run."""
    clip = 0.5
    results = run_ranks(adam_ranks, STEPS, FREEZE, True, batch, clip, world_size=2)
    simulated = simulate_adam(STEPS, FREEZE, 2, True, clip)
    unclipped = simulate_adam(STEPS, FREEZE, 2, True)
    for got in results:
        for step in range(STEPS):
            for k, want in simulated[step].items():
                at = f"{k} step {step + 1}"
                torch.testing.assert_close(got["params"][step][k], want, rtol=1e-5, atol=1e-5, msg=at)  # fmt: skip
    for step in (0, FREEZE, STEPS - 1):  # clipping bit in the warm-up and after it
        assert any(
            not torch.allclose(simulated[step][k], unclipped[step][k], rtol=1e-4, atol=1e-6)
            for k in unclipped[step]
        ), step
    with pytest.raises(ValueError, match="max_grad_norm"):
        sx.optim.onebit_adam(0.1, freeze_step=2, max_grad_norm=0.0)


def tp_grad(step: int, dp: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + dp))


def tp_ranks(steps: int, freeze: int) -> tuple:
    """A weight split over tp; its gradients partial over dp (each dp rank's
    own, the same rows split over tp)."""
    mesh = sx.Mesh({"dp": 2, "tp": 2})
    dp, tp = mesh.axis_index("dp"), mesh.axis_index("tp")
    params = {"w": sx.Sharded(torch.ones(4, 6), Layout(mesh, P("tp")), (8, 6))}
    opt = sx.optim.onebit_adam(LR, BETAS[0], BETAS[1], EPS, WD, freeze_step=freeze)
    state = opt.init(params)
    history = []
    for step in range(steps):
        mine = tp_grad(step, dp)[4 * tp : 4 * (tp + 1)] / 2
        grads = {"w": sx.Sharded(mine, Layout(mesh, P("tp"), partial="dp"), (8, 6))}
        with sx.collectives.traffic() as t:
            updates, state = opt.update(grads, state, params)
        params = sx.optim.apply_updates(params, updates)
        history.append(params["w"].local.clone())
    return tp, history, dict(t.bytes)


@pytest.mark.world_size(4)
def test_onebit_adam_under_tensor_parallelism():
    """dp=2 x tp=2, a weight split over tp: each tp half is 1-bit Adam over
    its dp pair — the simulation of that half — and only dp carries the
    compressed momenta (1e-5 as above)."""
    for tp, history, traffic in run_ranks(tp_ranks, 6, 2, world_size=4):
        rows = slice(4 * tp, 4 * (tp + 1))

        def contributions_at(step: int, p: dict, rows=rows) -> list[dict]:
            return [{"w": tp_grad(step, dp)[rows] / 2} for dp in range(2)]

        want = simulate({"w": torch.ones(4, 6)}, contributions_at, 6, 2, 2, True)
        for step, got in enumerate(history):
            torch.testing.assert_close(got, want[step]["w"], rtol=1e-5, atol=1e-5, msg=f"{step}")
        packed = 2 * (onebit_chunk(24, 2) // 8 + 4)
        assert traffic == {("all_to_all", ("dp",)): packed, ("all_gather", ("dp",)): packed}


def mask_ranks(masked: bool) -> torch.Tensor:
    """Row 3 of ``w`` never gets a gradient."""
    mesh = sx.Mesh({"dp": -1})
    dp = mesh.axis_index("dp")
    params = {"w": sx.Sharded(torch.ones(4, 3), Layout(mesh, P()), (4, 3))}
    keep = torch.ones(4, 3)
    keep[3] = 0.0
    opt = sx.optim.onebit_adam(LR, freeze_step=2, momentum_mask={"w": keep} if masked else None)
    state = opt.init(params)
    for step in range(5):
        g = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + dp))
        g[3] = 0.0
        grads = {"w": sx.Sharded(g / 2, Layout(mesh, P(), partial="dp"), (4, 3))}
        updates, state = opt.update(grads, state, params)
        params = sx.optim.apply_updates(params, updates)
    return params["w"].local


@pytest.mark.world_size(2)
def test_onebit_adam_momentum_mask_keeps_dead_rows_still():
    """One bit cannot say zero: a row whose gradient is always zero gets a
    momentum of ±scale after the freeze, over a variance of zero — a step
    of ``lr * scale / eps``. DeepSpeed's mask (``exp_avg_mask``) keeps it."""
    unmasked = run_ranks(mask_ranks, False)[0]
    masked = run_ranks(mask_ranks, True)[0]
    assert (unmasked[3] - 1.0).abs().min() > 1.0
    assert torch.equal(masked[3], torch.ones(3))
    assert not torch.equal(masked[:3], torch.ones(3, 3))


# -- training -------------------------------------------------------------------------

TRAIN_STEPS, TRAIN_FREEZE = 200, 40


def train_ranks(steps: int, freeze: int) -> dict:
    out = adam_ranks(steps, freeze, True, make_batch=task_batch)
    return out["params"][-1]


@pytest.mark.world_size(2)
def test_onebit_adam_trains_like_adamw():
    """200 steps of the small model on 2 ranks, the last 160 compressed: the
    held-out loss ends within 5% of AdamW's (the same init and batches),
    far below where it started."""
    start = eval_loss(first_params()[1])
    adamw = eval_loss(adamw_train(TRAIN_STEPS))
    onebit = [eval_loss(p) for p in run_ranks(train_ranks, TRAIN_STEPS, TRAIN_FREEZE)]
    assert onebit[0] == onebit[1]
    assert adamw < 0.6 * start
    assert abs(onebit[0] - adamw) <= 0.05 * adamw, (start, adamw, onebit[0])


# -- 1-bit LAMB ------------------------------------------------------------------------


def lamb_ranks(
    steps: int, freeze: int, wd: float, make_batch=batch, clip: float | None = None
) -> dict:
    """1-bit LAMB on dp ranks, gradients as :func:`adam_ranks` makes them."""
    mesh = sx.Mesh({"dp": -1})
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    model, dense = first_params()
    params = {k: sx.Sharded(v, Layout(mesh, P()), v.shape) for k, v in dense.items()}
    opt = sx.optim.onebit_lamb(LR, BETAS[0], BETAS[1], EPS, wd, freeze_step=freeze,
                               max_grad_norm=clip)  # fmt: skip
    state = opt.init(params)
    out: dict = {"params": [], "bytes": []}
    for step in range(steps):
        x, y = make_batch(step)
        mine = slice(i * BATCH // n, (i + 1) * BATCH // n)
        _, g = local_grads(model, {k: v.local for k, v in params.items()}, x[mine], y[mine])
        partial = Layout(mesh, P(), partial="dp")
        grads = {k: sx.Sharded(v / n, partial, v.shape) for k, v in g.items()}
        with sx.collectives.traffic() as t:
            updates, state = opt.update(grads, state, params)
        params = sx.optim.apply_updates(params, updates)
        out["params"].append({k: v.local.clone() for k, v in params.items()})
        out["bytes"].append(dict(t.bytes))
    return out


def _norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm as shardax's sums of squares take it (norm, squared, root)."""
    n = torch._foreach_norm([x], 2, dtype=torch.float32)[0]
    return (n * n).sqrt()


@one_thread()
def simulate_lamb(
    steps: int, freeze: int, world: int, wd: float, clip: float | None = None
) -> list[dict]:
    """DeepSpeed's OnebitLamb on one process, written plainly: LAMB on the
    summed contributions until the freeze, its trust ratios averaged; then
    every rank's momenta scaled to one RMS, compressed as one flat buffer by
    :func:`simulate_pmean`, and the trust ratio from the fresh variance."""
    model, p = first_params()
    (b1, b2), keys, part = BETAS, sorted(p), BATCH // world
    mu = {k: torch.zeros_like(v) for k, v in p.items()}
    nu = {k: torch.zeros_like(v) for k, v in p.items()}
    fresh = dict(mu)
    coeff = {k: torch.tensor(0.0) for k in keys}
    factor = {k: torch.tensor(1.0) for k in keys}
    total = sum(v.numel() for v in p.values())
    workers = [torch.zeros(total) for _ in range(world)]
    servers = [torch.zeros(onebit_chunk(total, world)) for _ in range(world)]
    history = []
    for step in range(steps):
        x, y = batch(step)
        mine = [slice(r * part, (r + 1) * part) for r in range(world)]
        contributions = [
            {k: g / world for k, g in local_grads(model, p, x[s], y[s])[1].items()} for s in mine
        ]
        t, new = step + 1, {}
        summed = {k: sum(c[k] for c in contributions) for k in keys}
        own = [{k: c[k] * world for k in keys} for c in contributions]
        if clip is not None:  # the summed gradient by its norm; then each rank's own by its own
            summed, *own = [_clip(g, clip) for g in (summed, *own)]
        if t <= freeze:
            for k in keys:
                g = summed[k]
                mu[k] = mu[k].lerp(g, 1 - b1)
                nu[k] = nu[k].mul(b2).addcmul_(g, g, value=1 - b2)
                if t == freeze:
                    fresh[k] = nu[k].clone()
                u = mu[k] / (nu[k].sqrt() + EPS) + wd * p[k]
                w_norm, u_norm = _norm(p[k]), _norm(u)
                ratio = (w_norm / u_norm).clamp(0.01, 10.0) if w_norm > 0 and u_norm > 0 else 1.0
                if ratio != 1.0:
                    coeff[k] = 0.9 * coeff[k] + 0.1 * ratio
                new[k] = p[k] + (u * ratio) * -LR
        else:
            if t == freeze + 1:
                rms = {k: _norm(mu[k]) / math.sqrt(mu[k].numel()) for k in keys}
                united = sum(rms[k] for k in keys) / len(keys)
                scaling = {k: united / rms[k] for k in keys}
            rows = []  # each rank's momenta, scaled, as one flat buffer
            for o in own:
                scaled = [mu[k].lerp(o[k], 1 - b1) * scaling[k] for k in keys]
                rows.append(torch.cat([m.reshape(-1) for m in scaled]))
            mean, workers, servers = simulate_pmean(rows, workers, servers)
            pieces = dict(zip(keys, mean.split([mu[k].numel() for k in keys]), strict=True))
            for k in keys:
                last, mu[k] = mu[k], pieces[k].view(mu[k].shape) / scaling[k]
                rebuilt = (mu[k] - b1 * last) / (1 - b1)
                fresh[k] = fresh[k].mul(b2).addcmul_(rebuilt, rebuilt, value=1 - b2)
                denom = nu[k].sqrt() + EPS
                prelim = mu[k] / denom
                u = prelim + wd * p[k] if wd else prelim
                f = (denom / (fresh[k].sqrt() + EPS)).max()
                if wd:
                    share = (_norm(prelim) / _norm(u)).clamp(max=1.0)
                    f = f * share + (1.0 - share)
                f = f.clamp(0.5, 4.0).clamp(factor[k] * 0.9, factor[k] * 1.1)
                factor[k] = f
                new[k] = p[k] + (u * (coeff[k] * f)) * -LR
        p = new
        history.append(p)
    return history


@pytest.mark.world_size(2)
@pytest.mark.parametrize("wd", [0.0, WD])
def test_onebit_lamb_matches_the_simulation(wd):
    """Three warm-up steps and six compressed ones of 1-bit LAMB on 2 ranks
    equal DeepSpeed's algorithm simulated on one process (1e-5; the same
    operations); a compressed step moves one all-to-all and one all-gather
    of the whole model's packed momenta."""
    results = run_ranks(lamb_ranks, STEPS, FREEZE, wd, world_size=2)
    simulated = simulate_lamb(STEPS, FREEZE, 2, wd)
    _, dense = first_params()
    total = sum(v.numel() for v in dense.values())
    packed = 2 * (onebit_chunk(total, 2) // 8 + 4)
    for got in results:
        for step in range(STEPS):
            for k, want in simulated[step].items():
                at = f"{k} step {step + 1}"
                torch.testing.assert_close(got["params"][step][k], want, rtol=1e-5, atol=1e-5, msg=at)  # fmt: skip
            if step < FREEZE:
                assert got["bytes"][step] == {("psum", ("dp",)): 4 * total}
            else:
                assert got["bytes"][step] == {
                    ("all_to_all", ("dp",)): packed,
                    ("all_gather", ("dp",)): packed,
                }


@pytest.mark.world_size(2)
def test_onebit_lamb_clips_as_deepspeed():
    """``max_grad_norm`` in 1-bit LAMB: the summed gradient during the
    warm-up, each rank's own after it; nine steps equal the simulation that
    clips so, and differ from the unclipped one."""
    results = run_ranks(lamb_ranks, STEPS, FREEZE, WD, batch, 0.5, world_size=2)
    simulated = simulate_lamb(STEPS, FREEZE, 2, WD, 0.5)
    unclipped = simulate_lamb(STEPS, FREEZE, 2, WD)
    for got in results:
        for step in range(STEPS):
            for k, want in simulated[step].items():
                at = f"{k} step {step + 1}"
                torch.testing.assert_close(got["params"][step][k], want, rtol=1e-5, atol=1e-5, msg=at)  # fmt: skip
    assert any(
        not torch.allclose(simulated[-1][k], unclipped[-1][k], rtol=1e-4, atol=1e-6)
        for k in unclipped[-1]
    )


def lamb_train_ranks(steps: int, freeze: int) -> dict:
    return lamb_ranks(steps, freeze, WD, make_batch=task_batch)["params"][-1]


@pytest.mark.world_size(2)
def test_onebit_lamb_trains_like_lamb():
    """200 steps, the last 160 compressed, end within 5% of the held-out loss
    of 200 uncompressed LAMB steps (a freeze after the last step)."""
    start = eval_loss(first_params()[1])
    lamb = eval_loss(run_ranks(lamb_train_ranks, TRAIN_STEPS, TRAIN_STEPS)[0])
    onebit = eval_loss(run_ranks(lamb_train_ranks, TRAIN_STEPS, TRAIN_FREEZE)[0])
    assert lamb < 0.6 * start
    assert abs(onebit - lamb) <= 0.05 * lamb, (start, lamb, onebit)


# -- bad input ------------------------------------------------------------------------


def _setup(axis="dp", mesh_axes=None):
    mesh = sx.Mesh(mesh_axes or {"dp": 1})
    params = {"w": sx.Sharded(torch.ones(2, 3), Layout(mesh, P()), (2, 3))}
    opt = sx.optim.onebit_adam(0.1, freeze_step=2, axis=axis)
    return mesh, params, opt, opt.init(params)


def test_onebit_adam_refuses_gradients_it_cannot_average():
    mesh, params, opt, state = _setup()
    partial = Layout(mesh, P(), partial="dp")
    with pytest.raises(ShardingError, match=r"gradient 'w' is a plain tensor \(2, 3\).*partial over \('dp',\)"):  # fmt: skip
        opt.update({"w": torch.ones(2, 3)}, state, params)
    summed = sx.Sharded(torch.ones(2, 3), Layout(mesh, P()), (2, 3))
    with pytest.raises(ShardingError, match=r"gradient 'w' .*already summed.*average it again"):
        opt.update({"w": summed}, state, params)
    wrong_shape = sx.Sharded(torch.ones(3, 2), partial, (3, 2))
    with pytest.raises(ShardingError, match=r"gradient 'w' has global shape \(3, 2\); its param has \(2, 3\)"):  # fmt: skip
        opt.update({"w": wrong_shape}, state, params)
    with pytest.raises(ValueError, match="missing from grads: 'w'"):
        opt.update({"v": sx.Sharded(torch.ones(2, 3), partial, (2, 3))}, state, params)


def test_onebit_adam_refuses_the_wrong_axis():
    mesh, params, opt, state = _setup(axis="dp", mesh_axes={"dp": 1, "tp": 1})
    over_tp = sx.Sharded(torch.ones(2, 3), Layout(mesh, P(), partial="tp"), (2, 3))
    with pytest.raises(ShardingError, match=r"partial over \('tp',\), but onebit_adam\(axis=\('dp',\)\)"):  # fmt: skip
        opt.update({"w": over_tp}, state, params)
    both = sx.Sharded(torch.ones(2, 3), Layout(mesh, P(), partial=("dp", "tp")), (2, 3))
    with pytest.raises(ShardingError, match=r"partial over \('dp', 'tp'\).*sum any other partial axes first"):  # fmt: skip
        opt.update({"w": both}, state, params)
    _, params, opt, state = _setup(axis=("dp", "tp"), mesh_axes={"dp": 1, "tp": 1})
    opt.update({"w": both}, state, params)  # named together, it is the one axis


def test_onebit_adam_refuses_a_mask_of_another_shape():
    mesh, params, _, _ = _setup()
    opt = sx.optim.onebit_adam(0.1, freeze_step=2, momentum_mask={"w": torch.ones(3, 2)})
    grads = {"w": sx.Sharded(torch.ones(2, 3), Layout(mesh, P(), partial="dp"), (2, 3))}
    with pytest.raises(ShardingError, match=r"momentum_mask 'w' is \(3, 2\).*shape \(2, 3\)"):
        opt.update(grads, opt.init(params), params)
    opt = sx.optim.onebit_adam(0.1, freeze_step=2, momentum_mask={"v": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="momentum_mask does not have the structure"):
        opt.update(grads, opt.init(params), params)


def test_onebit_adam_refuses_params_split_over_its_axis():
    mesh = sx.Mesh({"dp": 1})
    split = {"w": sx.shard(torch.ones(4), mesh, P("dp"))}
    with pytest.raises(ShardingError, match=r"'w' .*split over \['dp'\].*no rules.zero"):
        sx.optim.onebit_adam(0.1, freeze_step=2).init(split)
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        sx.optim.onebit_adam(0.1, freeze_step=0)


def test_onebit_lamb_refuses_what_it_cannot_compress_as_one_buffer():
    mesh, params, _, _ = _setup()
    params = {**params, "b": sx.Sharded(torch.ones(2), Layout(mesh, P()), (2,))}
    opt = sx.optim.onebit_lamb(0.1, freeze_step=2)
    state = opt.init(params)
    grad = sx.Sharded(torch.ones(2, 3), Layout(mesh, P(), partial="dp"), (2, 3))
    with pytest.raises(ValueError, match=r"gradient 'b' is None; 1-bit LAMB compresses every"):
        opt.update({"b": None, "w": grad}, state, params)
    summed = sx.Sharded(torch.ones(2), Layout(mesh, P()), (2,))
    with pytest.raises(ShardingError, match=r"gradient 'b' .*already summed"):
        opt.update({"b": summed, "w": grad}, state, params)


def restored_ranks(which: str) -> tuple[bool, bool]:
    """After 1-bit steps: an update from a state stamped with another rank
    (as a restored checkpoint's, which keeps rank 0's plain tensors) equals
    one from empty errors; from this rank's own state it does not."""
    mesh = sx.Mesh({"dp": -1})
    params = {"w": sx.shard(torch.linspace(-1, 1, 40).reshape(5, 8), mesh, P())}
    make = {"adam": sx.optim.onebit_adam, "lamb": sx.optim.onebit_lamb}[which]
    opt = make(0.01, freeze_step=1)
    state = opt.init(params)
    g = torch.Generator().manual_seed(mesh.rank)
    for _ in range(4):
        grads = {
            "w": sx.Sharded(torch.randn(5, 8, generator=g), Layout(mesh, P(), partial="dp"), (5, 8))
        }
        _, state = opt.update(grads, state, params)
    inner = state[0]  # chain(core, ...): the core's state first
    other = inner._replace(owner=torch.tensor([1 - mesh.rank, 2]))
    empty = optree.tree_map(lambda e: e.new_zeros(0), (inner.worker_error, inner.server_error))
    fresh = inner._replace(worker_error=empty[0], server_error=empty[1])

    def update(core_state):
        return opt.update(grads, (core_state, *state[1:]), params)[0]["w"].local

    return torch.equal(update(other), update(fresh)), torch.equal(update(inner), update(fresh))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("which", ["adam", "lamb"])
def test_a_restored_state_starts_from_zero_errors(which):
    """The compression errors are each rank's own; a checkpoint keeps rank
    0's plain tensors. A rank whose state is stamped with another rank's
    ``owner`` drops them and starts from zero errors (DeepSpeed resets
    them when it loads a checkpoint), while its own errors do change the
    update."""
    for reset, own in run_ranks(restored_ranks, which, world_size=2):
        assert reset and not own


def accumulated_ranks() -> bool:
    """``MultiSteps`` over 1-bit Adam: the micro-steps' partial gradients
    summed on each rank, still partial, equal one step of their mean."""
    mesh = sx.Mesh({"dp": -1})
    params = {"w": sx.shard(torch.linspace(-1, 1, 12).reshape(3, 4), mesh, P())}
    g = torch.Generator().manual_seed(mesh.rank)
    partial = Layout(mesh, P(), partial="dp")
    micro = [[torch.randn(3, 4, generator=g) for _ in range(2)] for _ in range(4)]
    many = sx.optim.MultiSteps(sx.optim.onebit_adam(0.01, freeze_step=2), 2)
    one = sx.optim.onebit_adam(0.01, freeze_step=2)
    s_many, s_one, p_many, p_one = many.init(params), one.init(params), params, params
    for a, b in micro:
        for x in (a, b):
            u, s_many = many.update({"w": sx.Sharded(x, partial, (3, 4))}, s_many, p_many)
            p_many = sx.optim.apply_updates(p_many, u)
        u, s_one = one.update({"w": sx.Sharded((a + b) / 2, partial, (3, 4))}, s_one, p_one)
        p_one = sx.optim.apply_updates(p_one, u)
    return torch.allclose(p_many["w"].local, p_one["w"].local, rtol=1e-6, atol=1e-7)


@pytest.mark.world_size(2)
def test_gradient_accumulation_keeps_the_gradients_partial():
    """Accumulated over micro-steps (``MultiSteps``, a run config's
    ``batch.accumulation``), each rank's own gradients stay partial for 1-bit
    Adam, through its warm-up and its compressed steps."""
    assert run_ranks(accumulated_ranks, world_size=2) == [True, True]
