"""Schedules: values at the key steps against their formulas, and against
torch's LR schedulers where one exists."""

from __future__ import annotations

import math

import pytest
import torch

from shardax import optim


def torch_lrs(make, steps: int, lr: float) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant_and_linear():
    assert optim.constant(0.3)(0) == optim.constant(0.3)(10**6) == 0.3
    s = optim.linear(1.0, 0.2, transition_steps=8, transition_begin=2)
    assert [s(i) for i in (0, 2)] == [1.0, 1.0]
    assert math.isclose(s(6), 0.6) and s(10) == s(100) == 0.2


def test_cosine_matches_torch_cosine_annealing():
    ours = optim.cosine(0.1, decay_steps=20, alpha=0.1)
    ref = torch_lrs(
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.01), 21, 0.1
    )
    for i, r in enumerate(ref):
        assert math.isclose(ours(i), r, rel_tol=1e-9, abs_tol=1e-12), i
    assert ours(20) == ours(500) == pytest.approx(0.01)


def test_warmup_cosine_key_steps():
    peak, warm, total, end = 3e-4, 10, 110, 3e-5
    s = optim.warmup_cosine(peak, warm, total, init_value=1e-5, end_value=end)
    assert s(0) == 1e-5
    assert math.isclose(s(5), 1e-5 + (peak - 1e-5) / 2)
    assert s(warm) == peak
    assert math.isclose(s(warm + 50), end + (peak - end) / 2)  # half way down
    assert math.isclose(s(total), end) and math.isclose(s(10 * total), end)
    for i in range(warm, total):  # monotone decay
        assert s(i + 1) <= s(i)


def test_warmup_linear_decay_key_steps():
    s = optim.warmup_linear_decay(1.0, 4, 12, end_value=0.2)
    assert [s(i) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert math.isclose(s(8), 0.6) and s(12) == s(99) == pytest.approx(0.2)


def test_one_cycle_matches_torch():
    total = 25
    ours = optim.one_cycle(0.5, total, pct_start=0.3, div_factor=10.0, final_div_factor=100.0)
    ref = torch_lrs(
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o,
            max_lr=0.5,
            total_steps=total,
            pct_start=0.3,
            div_factor=10.0,
            final_div_factor=100.0,
            cycle_momentum=False,
        ),
        total,
        0.5,
    )
    for i, r in enumerate(ref):
        assert math.isclose(ours(i), r, rel_tol=1e-12, abs_tol=1e-15), (i, ours(i), r)
    assert ours(total + 5) == ours(total - 1)


def test_piecewise_matches_multistep_lr():
    ours = optim.piecewise(0.1, {3: 0.5, 7: 0.5})
    ref = torch_lrs(
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[3, 7], gamma=0.5), 10, 0.1
    )
    assert [ours(i) for i in range(10)] == pytest.approx(ref)


def test_short_names_are_the_long_ones():
    assert optim.warmup_cosine is optim.warmup_cosine_decay_schedule
    assert optim.warmup_linear_decay is optim.warmup_linear_decay_schedule
    assert optim.one_cycle is optim.one_cycle_schedule
    assert optim.piecewise is optim.piecewise_constant_schedule
    assert optim.cosine is optim.cosine_decay_schedule
    assert optim.linear is optim.linear_schedule and optim.constant is optim.constant_schedule


def test_bad_schedules_are_clear_errors():
    with pytest.raises(ValueError, match=r"decay_steps .* must exceed warmup_steps"):
        optim.warmup_cosine(1e-3, 100, 100)
    with pytest.raises(ValueError, match="transition_steps must be >= 1"):
        optim.linear(1.0, 0.0, 0)
    with pytest.raises(TypeError, match="decay_steps must be an int"):
        optim.cosine(1.0, 10.5)
    with pytest.raises(ValueError, match="boundary must be >= 0"):
        optim.piecewise(1.0, {-1: 0.5})


def test_deepspeeds_warmup_is_the_native_one_an_update_late():
    """DeepSpeed steps its scheduler after each update: update ``k + 1`` of
    its ``WarmupDecayLR`` (linear warmup) runs at the native schedule's
    step ``k`` (decaying to the warmup's start), update 0 at the start too.
    The two compute in different orders: a rounding or two of 2**-53 on
    either side, so 8 half-ulps bound the difference."""
    from shardax.optim._schedules import deepspeed_warmup

    init, peak, warm, total = 1e-5, 3e-4, 6, 20
    ours = deepspeed_warmup(init, peak, warm, total, warmup="linear")
    native = optim.warmup_linear_decay(peak, warm, total, init_value=init, end_value=init)
    assert ours(0) == native(0) == init
    for k in range(30):
        assert ours(k + 1) == pytest.approx(native(k), rel=8 * 2.0**-53, abs=0), k
    short = deepspeed_warmup(0.0, 1.0, 1, warmup="linear")  # DeepSpeed warms up over >= 2
    assert [short(k) for k in range(5)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    short = deepspeed_warmup(0.0, 1.0, 1)  # log: log(k) / log(2), at the peak one update sooner
    assert [short(k) for k in range(5)] == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_bad_deepspeed_schedules_are_clear_errors():
    from shardax.optim._schedules import deepspeed_warmup, deepspeed_warmup_cosine

    with pytest.raises(ValueError, match="warmup must be 'log' or 'linear'; got 'cosine'"):
        deepspeed_warmup(0.0, 1.0, 10, warmup="cosine")
    with pytest.raises(ValueError, match="warmup_steps must be >= 1; got 0"):
        deepspeed_warmup_cosine(1.0, 0, 10)
    with pytest.raises(TypeError, match=r"decay_steps must be an int; got 9\.5"):
        deepspeed_warmup(0.0, 1.0, 4, 9.5)
