"""The fused native AdamW update against the reference chain of transforms
(``SHARDAX_NO_NATIVE=1``): the same state structure, moments equal, params
within about an ulp after several steps — constant and scheduled learning
rates, with and without weight decay; what it does not cover (bf16, a mask)
runs the reference; and the optimizer benchmark's smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardax as sx
from shardax.kernels import OPTIM

pytestmark = pytest.mark.skipif(OPTIM.load() is None, reason="no C++ compiler here")
ROOT = Path(__file__).resolve().parents[2]


def steps(monkeypatch, native: bool, lr, wd: float, dtype=torch.float32, **kw):
    if native:
        monkeypatch.delenv("SHARDAX_NO_NATIVE", raising=False)
    else:
        monkeypatch.setenv("SHARDAX_NO_NATIVE", "1")
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4099, generator=g).to(dtype),
        "b": torch.randn(3, generator=g).to(dtype),
    }
    opt = sx.optim.adamw(lr, weight_decay=wd, **kw)
    state = opt.init(params)
    for _ in range(8):
        grads = {k: torch.randn(v.shape, generator=g).to(dtype) for k, v in params.items()}
        updates, state = opt.update(grads, state, params)
        params = sx.optim.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("scheduled", [False, True], ids=["constant-lr", "schedule"])
def test_fused_adamw_matches_the_reference(monkeypatch, wd, scheduled):
    lr = sx.optim.warmup_cosine_decay_schedule(1e-2, 2, 8) if scheduled else 1e-2
    fused, fstate = steps(monkeypatch, True, lr, wd)
    ref, rstate = steps(monkeypatch, False, lr, wd)
    assert [type(s).__name__ for s in fstate] == [type(s).__name__ for s in rstate]
    assert int(fstate[0].count) == int(rstate[0].count) == 8
    if scheduled:
        assert int(fstate[2].count) == int(rstate[2].count) == 8
    for k in ref:
        torch.testing.assert_close(fstate[0].mu[k], rstate[0].mu[k], rtol=0, atol=0)
        torch.testing.assert_close(fused[k], ref[k], rtol=1e-6, atol=2e-7)


def test_fused_adamw_is_really_used(monkeypatch):
    calls = []
    lib = OPTIM.load()
    real = lib.sx_adamw_f32
    monkeypatch.setattr(lib, "sx_adamw_f32", lambda *a: (calls.append(1), real(*a))[1])
    steps(monkeypatch, True, 1e-2, 0.1)
    assert len(calls) == 8 * 2  # 8 steps, 2 leaves


def test_what_the_kernel_does_not_cover_runs_the_reference(monkeypatch):
    for kwargs in ({"dtype": torch.bfloat16}, {"mask": {"w": True, "b": False}}):
        fused, _ = steps(monkeypatch, True, 1e-2, 0.1, **kwargs)
        ref, _ = steps(monkeypatch, False, 1e-2, 0.1, **kwargs)
        for k in ref:
            assert torch.equal(fused[k], ref[k]), (kwargs, k)


def test_optim_benchmark_smoke(tmp_path):
    out = tmp_path / "optim.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/optim.py", "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert set(result["results"]) == {
        "shardax",
        "shardax_reference",
        "torch_foreach",
        "torch_fused",
    }
    assert all(r["ms"] > 0 for r in result["results"].values())


def test_bf16_params_with_fp32_master_weights_use_the_kernel(monkeypatch):
    """``with_master_weights(adamw)``: the inner AdamW steps the fp32 master
    copy, so the fused kernel runs there (bf16 params, fp32 state)."""
    calls = []
    lib = OPTIM.load()
    real = lib.sx_adamw_f32
    monkeypatch.setattr(lib, "sx_adamw_f32", lambda *a: (calls.append(1), real(*a))[1])

    def run(native: bool) -> dict:
        if native:
            monkeypatch.delenv("SHARDAX_NO_NATIVE", raising=False)
        else:
            monkeypatch.setenv("SHARDAX_NO_NATIVE", "1")
        g = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(1000, generator=g).to(torch.bfloat16)}
        opt = sx.optim.with_master_weights(sx.optim.adamw(1e-2, weight_decay=0.1))
        state = opt.init(params)
        for _ in range(4):
            grads = {"w": torch.randn(1000, generator=g).to(torch.bfloat16)}
            updates, state = opt.update(grads, state, params)
            params = sx.optim.apply_updates(params, updates)
        return params

    fused, ref = run(True), run(False)
    assert len(calls) == 4
    torch.testing.assert_close(fused["w"].float(), ref["w"].float(), rtol=0, atol=2**-7)


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("scheduled", [False, True], ids=["constant-lr", "schedule"])
def test_fused_lion_is_bit_for_bit_the_reference(monkeypatch, wd, scheduled):
    def run(native: bool):
        if native:
            monkeypatch.delenv("SHARDAX_NO_NATIVE", raising=False)
        else:
            monkeypatch.setenv("SHARDAX_NO_NATIVE", "1")
        g = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(4099, generator=g), "b": torch.randn(3, generator=g)}
        lr = sx.optim.warmup_cosine_decay_schedule(1e-3, 2, 8) if scheduled else 1e-3
        opt = sx.optim.lion(lr, weight_decay=wd)
        state = opt.init(params)
        before = state[0].mu["w"].clone()
        first = state
        for _ in range(8):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            updates, state = opt.update(grads, state, params)
            params = sx.optim.apply_updates(params, updates)
        assert torch.equal(first[0].mu["w"], before)  # the old state is left alone
        return params, state

    (fused, fstate), (ref, rstate) = run(True), run(False)
    for k in ref:
        assert torch.equal(fused[k], ref[k]) and torch.equal(fstate[0].mu[k], rstate[0].mu[k])
    assert int(fstate[0].count) == 8 and type(fstate[2]) is type(rstate[2])
