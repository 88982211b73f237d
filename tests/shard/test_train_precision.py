"""Training parity for gradient accumulation and fp16 loss scaling: on real
gloo ranks under ZeRO 0–3, ``MultiSteps`` and ``DynamicLossScale`` (or
``apply_if_finite``) driven by value_and_grad + apply match the single-process
PyTorch run — torch.optim.AdamW with accumulated ``.backward()`` calls, and
``torch.amp.GradScaler`` — including steps that overflow on one rank only."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import shardax as sx
from shardax import optim

VOCAB, DIM, SEQ, MICRO = 13, 8, 5, 4  # MICRO: the global micro-batch
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


class Poison(torch.autograd.Function):
    """Identity whose backward turns the gradient at the masked positions into
    inf: an overflow in backward, on the ranks whose batch holds them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.mask = mask
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g.masked_fill(ctx.mask, float("inf")), None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, poison: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx)
        if poison is not None:
            x = Poison.apply(x, poison)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + i)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def adamw_torch(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def adamw() -> optim.GradientTransformation:
    return optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def setup(stage: int) -> tuple[nn.Module, dict, slice]:
    """The meta model, its ZeRO-``stage`` params (same init as the reference)
    and this rank's slice of each global batch."""
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(stage))
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    return model, params, slice(i * MICRO // n, (i + 1) * MICRO // n)


def _loss(params, model, x, y, poison=None, scale=1.0):
    logits = sx.apply(model, params, x, poison=poison).float()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) * scale


def _assert_params(params: dict, ref: dict, rank: int) -> None:
    assert sorted(params) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(params[k], ref[k], rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {k}")


# -- gradient accumulation -----------------------------------------------------------------

K, STEPS = 2, 3  # micro-batches per optimizer step, optimizer steps


def accumulate_reference() -> tuple[list[float], dict]:
    """torch: ``(loss / K).backward()`` on each micro-batch, one AdamW step
    every K."""
    torch.manual_seed(0)
    model = Net()
    opt = adamw_torch(model)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(K):
            x, y = batch(step * K + micro)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            (loss / K).backward()
            losses.append(loss.item())
        opt.step()
    return losses, {k: v.clone() for k, v in sx.params_of(model).items()}


def accumulate_ranks(stage: int):
    model, params, local = setup(stage)
    opt = optim.MultiSteps(adamw(), every_k=K)
    state = opt.init(params)
    losses, unchanged = [], []
    for i in range(STEPS * K):
        x, y = batch(i)
        loss, g = sx.value_and_grad(_loss)(params, model, x[local], y[local])
        updates, state = opt.update(g, state, params)
        new = optim.apply_updates(params, updates)
        unchanged.append(all(torch.equal(new[k].local, params[k].local) for k in params))
        params = new
        losses.append(loss.item())
    acc_split = all("dp" in a.spec.axes for a in state.acc_grads.values())
    counts = (int(state.mini_step), int(state.gradient_step))
    return losses, unchanged, sx.gather(params), counts, acc_split


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_multisteps_matches_accumulated_backward(stage, world_size):
    """MultiSteps(adamw, K): every micro-batch's loss and the final params
    equal torch's AdamW stepping every K ``(loss / K).backward()`` calls; the
    params stay put between the steps and the sum is kept sharded like the
    optimizer state."""
    ref_losses, ref_params = accumulate_reference()
    results = run_ranks(accumulate_ranks, stage, world_size=world_size)
    for rank, (losses, unchanged, params, counts, acc_split) in enumerate(results):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        assert unchanged == [(i + 1) % K != 0 for i in range(STEPS * K)], f"rank {rank}"
        _assert_params(params, ref_params, rank)
        assert counts == (0, STEPS)
        assert acc_split == (stage >= 1)


# -- dynamic loss scaling ------------------------------------------------------------------

INIT_SCALE, GROWTH, SCALED_STEPS = 2.0**10, 2, 7
POISONED = {1: 0, 4: 3}  # step -> the sample (of the global batch) whose backward overflows


def scaled_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's batch and poison mask. A poisoned step overflows in one
    feature of one sample's first embedding: one element of the embedding's
    gradient becomes inf, which under ZeRO-2/3 lives in one rank's shard —
    not necessarily that of the rank whose batch overflowed."""
    x, y = batch(100 + step)
    poison = torch.zeros(MICRO, SEQ, DIM, dtype=torch.bool)
    if step in POISONED:
        poison[POISONED[step], 0, 0] = True
    return x, y, poison


def scaled_reference() -> tuple[list[float], list[dict], list[float], list[bool], dict]:
    """torch.amp.GradScaler driving AdamW: losses, unscaled gradients, the
    scale after each step, which steps were taken, and the final params."""
    torch.manual_seed(0)
    model = Net()
    opt = adamw_torch(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH)
    losses, grads, scales, taken = [], [], [], []
    for step in range(SCALED_STEPS):
        x, y, poison = scaled_batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x, poison).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)  # unscales the .grad in place, inf or not
        scaler.update()
        losses.append(loss.item())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        scales.append(scaler.get_scale())
        taken.append(
            not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        )
    return losses, grads, scales, taken, {k: v.clone() for k, v in sx.params_of(model).items()}


def scaled_ranks(stage: int, skip_with: str):
    model, params, local = setup(stage)
    base = adamw()
    opt = base if skip_with == "loss_scale" else optim.apply_if_finite(base)
    state = opt.init(params)
    ls = optim.DynamicLossScale(INIT_SCALE, growth_interval=GROWTH)
    losses, grads, scales, taken, locally_finite = [], [], [], [], []
    for step in range(SCALED_STEPS):
        x, y, poison = scaled_batch(step)
        args = (model, x[local], y[local], poison[local], ls.scale)
        scaled, g = sx.value_and_grad(_loss)(params, *args)
        losses.append((scaled / ls.scale).item())
        locally_finite.append(all(bool(torch.isfinite(v.local).all()) for v in g.values()))
        if skip_with == "loss_scale":
            g, ls = ls.unscale_and_adjust(g)
            if ls.finite:
                updates, state = opt.update(g, state, params)
                params = optim.apply_updates(params, updates)
        else:  # the updates are zeros on a non-finite step
            g = ls.unscale(g)
            updates, state = opt.update(g, state, params)
            params = optim.apply_updates(params, updates)
            ls = ls.adjust(state.last_finite)
        grads.append(sx.gather(g))
        scales.append(ls.scale)
        taken.append(ls.finite)
    return losses, grads, scales, taken, locally_finite, ls.skipped, sx.gather(params)


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("skip_with", ["loss_scale", "apply_if_finite"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_scaling_matches_grad_scaler(stage, skip_with, world_size):
    """The scaled loss's gradients overflow at two steps: the scale backs off
    there and grows after GROWTH good steps, the overflowing steps are skipped
    on every rank — also under ZeRO-2/3, where only one rank's gradient shard
    holds the inf — and losses, scales, skipped steps and the final params
    equal GradScaler + AdamW's."""
    ref_losses, ref_grads, ref_scales, ref_taken, ref_params = scaled_reference()
    assert ref_taken == [s not in POISONED for s in range(SCALED_STEPS)]  # the premise
    assert any(b > a for a, b in itertools.pairwise(ref_scales)), ref_scales  # and it grew
    results = run_ranks(scaled_ranks, stage, skip_with, world_size=world_size)
    for rank, (losses, grads, scales, taken, _, skipped, params) in enumerate(results):
        assert taken == ref_taken, f"rank {rank}"
        assert scales == ref_scales, f"rank {rank}"
        assert skipped == len(POISONED)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for step, (g, rg) in enumerate(zip(grads, ref_grads, strict=True)):
            for k in rg:  # unscaled, the inf (if any) in the same element
                msg = f"rank {rank}, step {step}: {k}"
                torch.testing.assert_close(g[k], rg[k], rtol=1e-5, atol=1e-6, msg=msg)
        _assert_params(params, ref_params, rank)
    # the premise: replicated grads show the inf on every rank, split ones on one
    for step in range(SCALED_STEPS):
        seen = sum(not r[4][step] for r in results)
        assert seen == (0 if step not in POISONED else world_size if stage < 2 else 1), step


# -- fp16 compute, fp32 master weights -----------------------------------------------------

# fp16 backward overflows above a scale of 2**18.2 to 2**18.9 on these batches: the scales
# used stay at least a factor 2**0.35 away, far beyond rounding differences
FP16_SCALE, FP16_STEPS = 2.0**20, 8


def fp16_reference() -> tuple[list[float], list[dict], list[float], list[bool], dict, dict]:
    """The fp16 model with fp32 master weights in torch: GradScaler unscales
    the master gradients (it refuses fp16 ones) and AdamW steps the masters,
    which are copied back into the fp16 model."""
    torch.manual_seed(0)
    model = Net().half()
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE, growth_interval=GROWTH)
    losses, grads, scales, taken = [], [], [], []
    for step in range(FP16_STEPS):
        x, y = batch(400 + step)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        before = [q.detach().clone() for q in master]
        for p, q in zip(model.parameters(), master, strict=True):
            q.grad = p.grad.float()
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            for p, q in zip(model.parameters(), master, strict=True):
                p.copy_(q)
        names = [k for k, _ in model.named_parameters()]
        losses.append(loss.item())
        grads.append({k: q.grad.clone() for k, q in zip(names, master, strict=True)})
        scales.append(scaler.get_scale())
        taken.append(not all(torch.equal(b, q) for b, q in zip(before, master, strict=True)))
    masters = {k: q.detach().clone() for k, q in zip(names, master, strict=True)}
    params = {k: v.clone() for k, v in sx.params_of(model).items()}
    return losses, grads, scales, taken, masters, params


def fp16_ranks(stage: int):
    model, params, local = setup(stage)
    params = {k: v.with_local(v.local.half()) for k, v in params.items()}
    opt = optim.with_master_weights(adamw())
    state = opt.init(params)
    ls = optim.DynamicLossScale(FP16_SCALE, growth_interval=GROWTH)
    losses, grads, scales, taken = [], [], [], []
    for step in range(FP16_STEPS):
        x, y = batch(400 + step)
        scaled, g = sx.value_and_grad(_loss)(params, model, x[local], y[local], None, ls.scale)
        losses.append((scaled / ls.scale).item())
        # as GradScaler does: unscale fp32 copies of the gradients (fp16 ones lose the small values)
        g = {k: v.with_local(v.local.float()) for k, v in g.items()}
        g, ls = ls.unscale_and_adjust(g)
        if ls.finite:
            updates, state = opt.update(g, state, params)
            params = optim.apply_updates(params, updates)
        grads.append(sx.gather(g))
        scales.append(ls.scale)
        taken.append(ls.finite)
    split = all("dp" in m.spec.axes for m in state.master.values())
    dtypes = {v.dtype for v in params.values()} | {m.dtype for m in state.master.values()}
    masters, params = sx.gather(state.master), sx.gather(params)
    return losses, grads, scales, taken, masters, params, split, dtypes


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_with_master_weights_matches_grad_scaler(stage, world_size):
    """fp16 params and compute, fp32 master weights sharded like the optimizer
    state: the scale starts too high for fp16's range, backs off step by step
    until backward stops overflowing, then grows and overflows again; the
    scales, skipped steps and losses equal GradScaler's, the masters and the
    fp16 params torch's — up to fp16 rounding: the ranks sum their half-batch
    gradients in fp16, a different order from the full-batch reference."""
    ref_losses, ref_grads, ref_scales, ref_taken, ref_master, ref_params = fp16_reference()
    assert ref_taken[:2] == [False, False] and sum(ref_taken) >= 3, ref_taken  # the premise
    assert any(b > a for a, b in itertools.pairwise(ref_scales)), ref_scales
    first = ref_taken.index(True)  # the first step taken: both runs still hold the initial params
    results = run_ranks(fp16_ranks, stage, world_size=world_size)
    for rank, (losses, grads, scales, taken, master, params, split, dtypes) in enumerate(results):
        assert taken == ref_taken, f"rank {rank}"
        assert scales == ref_scales, f"rank {rank}"
        torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-4)
        assert split == (stage >= 1) and dtypes == {torch.float16, torch.float32}
        for k in ref_master:
            msg = f"rank {rank}: {k}"
            # fp16 partial sums of about 0.25 round to 2**-13: unscaled, to the reference's
            g, rg = grads[first][k], ref_grads[first][k]
            torch.testing.assert_close(g, rg, rtol=2**-9, atol=5e-4, msg=msg)
            torch.testing.assert_close(master[k], ref_master[k], rtol=1e-4, atol=2e-4, msg=msg)
            assert torch.equal(params[k], master[k].half()), msg
            torch.testing.assert_close(params[k], ref_params[k], rtol=2**-10, atol=2e-4, msg=msg)
