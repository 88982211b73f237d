"""The fused native optimizer kernels against the reference chains of
transforms (``SHARDAX_NO_NATIVE=1``): AdamW, Lion, Adagrad and RMSprop, as
``update`` + ``apply_updates`` and as one fused ``optim.step`` (into fresh
params or donated ones), fp32 and bf16 gradients, constant and scheduled
learning rates, with and without weight decay — the same state structure,
values within about an ulp after several steps (Lion bit for bit); bf16
params with fp32 master weights in one pass; what the kernels do not cover
runs the reference; and the optimizer benchmark's smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardax as sx
from shardax.kernels import OPTIM

pytestmark = pytest.mark.skipif(OPTIM.load() is None, reason="no C++ compiler here")
ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
SCHEDULE = sx.optim.warmup_cosine_decay_schedule(1e-2, 2, STEPS)


def _torch_fuses_multiply_adds() -> bool:
    """Whether torch's ``lerp`` and ``add(alpha=)`` round once (a fused
    multiply-add), as the kernels' ``std::fma`` does — in its vector loops and
    its scalar tail. They do with AVX2/AVX512 builds as shipped; not with
    ``ATEN_CPU_CAPABILITY=default`` or on CPUs without FMA."""
    g = torch.Generator().manual_seed(0)
    for n in (4099, 3):  # a vectorised body and a scalar tail
        a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        w, alpha = torch.tensor(0.1).double(), torch.tensor(0.01).double()  # as fp32 scalars
        want = (a.double() + w * (b - a).double()).float()  # fma(w, b - a, a): one rounding
        lerp = torch.lerp(a, b, 0.1)
        fma = (a.double() + alpha * b.double()).float()
        if not (torch.equal(lerp, want) and torch.equal(torch.add(a, b, alpha=0.01), fma)):
            return False
    return True


FUSED_TORCH = _torch_fuses_multiply_adds()


def _tolerance(exact: bool) -> dict[str, float]:
    """Bit for bit where the kernel and the reference make the same roundings
    (Lion, when torch fuses its multiply-adds as the kernel does); else the
    fused kernel's reordering: a few fp32 roundings per step over 8 steps
    (~8 ulp relative, 1e-6) and their effect on parameters near 0 (2e-7)."""
    if exact and FUSED_TORCH:
        return {"rtol": 0.0, "atol": 0.0}
    return {"rtol": 1e-6, "atol": 2e-7}


# name → (make(lr, wd), kernel, exact): each optimizer the kernels cover
OPTIMIZERS: dict[str, tuple[Callable, str, bool]] = {
    "adamw": (lambda lr, wd: sx.optim.adamw(lr, weight_decay=wd), "sx_adamw", False),
    "adam": (lambda lr, wd: sx.optim.adam(lr, weight_decay=wd), "sx_adam_l2", False),
    "lion": (lambda lr, wd: sx.optim.lion(lr, weight_decay=wd), "sx_lion", True),
    "adagrad": (
        lambda lr, wd: sx.optim.adagrad(lr, weight_decay=wd, eps=1e-8),
        "sx_adagrad",
        False,
    ),
    "rmsprop": (lambda lr, wd: sx.optim.rmsprop(lr, weight_decay=wd), "sx_rmsprop", False),
}


def native(monkeypatch, on: bool) -> None:
    if on:
        monkeypatch.delenv("SHARDAX_NO_NATIVE", raising=False)
    else:
        monkeypatch.setenv("SHARDAX_NO_NATIVE", "1")


def run(opt, via: str, dtype=torch.float32, grad_dtype=None, steps: int = STEPS):
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4099, generator=g).to(dtype),
        "b": torch.randn(3, generator=g).to(dtype),
    }
    state = opt.init(params)
    for _ in range(steps):
        grads = {
            k: torch.randn(v.shape, generator=g).to(grad_dtype or dtype) for k, v in params.items()
        }
        if via == "update":
            updates, state = opt.update(grads, state, params)
            params = sx.optim.apply_updates(params, updates)
        else:
            before = {k: v.data_ptr() for k, v in params.items()}
            params, state = sx.optim.step(opt, grads, state, params, donate=via == "donate")
            assert (via == "donate") == all(v.data_ptr() == before[k] for k, v in params.items())
    return params, state


def spy(monkeypatch, kernel: str) -> list[int]:
    from shardax.optim._fused import _lib

    calls: list[int] = []
    lib = _lib()  # typed: the spy wraps the real, typed function
    real = getattr(lib, kernel)
    # one entry per leaf stepped (a call steps its table's a[1] leaves)
    monkeypatch.setattr(lib, kernel, lambda *a: (calls.extend([1] * a[1]), real(*a))[1])
    return calls


def state_tensors(state) -> list[torch.Tensor]:
    import optree

    return [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("via", ["update", "step", "donate"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("lr", [1e-2, SCHEDULE], ids=["constant-lr", "schedule"])
@pytest.mark.parametrize("grads", [torch.float32, torch.bfloat16], ids=["fp32-grads", "bf16-grads"])
def test_fused_matches_the_reference(monkeypatch, name, via, wd, lr, grads):
    make, kernel, exact = OPTIMIZERS[name]
    covered = not (wd and grads != torch.float32 and name in ("adam", "adagrad", "rmsprop"))
    native(monkeypatch, False)
    ref, rstate = run(make(lr, wd), "update", grad_dtype=grads)
    native(monkeypatch, True)
    calls = spy(monkeypatch, kernel)
    got, state = run(make(lr, wd), via, grad_dtype=grads)
    # the kernel really ran, every step, both leaves — or not at all where the
    # reference rounds differently (it decays bf16 gradients in bf16)
    assert len(calls) == (STEPS * 2 if covered else 0)
    assert [type(s).__name__ for s in state] == [type(s).__name__ for s in rstate]
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, **_tolerance(exact))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **_tolerance(exact))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_many_leaves_of_uneven_sizes_step_in_one_call_split_between_threads(
    monkeypatch, name, threads
):
    """A step's leaves go to the kernel in one call, their elements split
    evenly between the threads across leaf boundaries: sizes that are no
    multiple of a cache line, an empty leaf, a total above the parallel
    threshold — every element stepped once, as the reference steps it."""
    sizes = [70001, 5, 0, 33333, 17, 65536, 1]
    make, kernel, exact = OPTIMIZERS[name]

    def go(on: bool):
        native(monkeypatch, on)
        g = torch.Generator().manual_seed(1)
        params = {f"p{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
        opt = make(1e-2, 0.1)
        state = opt.init(params)
        for _ in range(3):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            if on:
                params, state = sx.optim.step(opt, grads, state, params, donate=True)
            else:
                updates, state = opt.update(grads, state, params)
                params = sx.optim.apply_updates(params, updates)
        return params, state

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, rstate = go(False)
        native(monkeypatch, True)
        calls = spy(monkeypatch, kernel)
        got, state = go(True)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 3 * (len(sizes) - 1)  # every non-empty leaf, every step
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, **_tolerance(exact))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **_tolerance(exact))


def test_an_update_leaves_the_params_alone_and_a_step_without_donate_too():
    opt = sx.optim.adamw(1e-2)
    params = {"w": torch.ones(5)}
    state = opt.init(params)
    new, _ = sx.optim.step(opt, {"w": torch.ones(5)}, state, params)
    assert torch.equal(params["w"], torch.ones(5)) and not torch.equal(new["w"], params["w"])


def test_what_the_kernels_do_not_cover_runs_the_reference(monkeypatch):
    calls = spy(monkeypatch, "sx_adamw")
    cases = [
        ({"dtype": torch.bfloat16}, {}),  # bf16 state
        ({}, {"mask": {"w": True, "b": False}}),  # a mask
        ({}, {"amsgrad": True}),
    ]
    for run_kw, opt_kw in cases:
        for via in ("update", "step"):
            native(monkeypatch, True)
            fused, _ = run(sx.optim.adamw(1e-2, weight_decay=0.1, **opt_kw), via, **run_kw)
            native(monkeypatch, False)
            ref, _ = run(sx.optim.adamw(1e-2, weight_decay=0.1, **opt_kw), "update", **run_kw)
            for k in ref:
                assert torch.equal(fused[k], ref[k]), (run_kw, opt_kw, via, k)
    assert not calls
    for opt in (sx.optim.rmsprop(1e-2, momentum=0.9), sx.optim.rmsprop(1e-2, centered=True)):
        assert opt.step is None  # the chain's own update


def _scripted(monkeypatch, on: bool, meddle) -> tuple[dict, object, list]:
    """Six donated AdamW steps; after the third, ``meddle(params, state)``
    changes what the caller hands back (what the kernels' kept checks must
    notice). Returns the params, the state and the kernel calls."""
    native(monkeypatch, on)
    calls = spy(monkeypatch, "sx_adamw") if on else []
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4099, generator=g), "b": torch.randn(3, generator=g)}
    opt = sx.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    for i in range(6):
        if i == 3:
            meddle(params, state)
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        params, state = sx.optim.step(opt, grads, state, params, donate=True)
    return params, state, calls


def _strided(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x, x], 1)[:, 0]  # equal values, every other element of a buffer


def _swap_state_leaf(params, state):
    state[0].nu["w"] = _strided(state[0].nu["w"])  # another tensor in the same dict


def _move_a_state_leaf(params, state):
    state[0].mu["w"].data = _strided(state[0].mu["w"])  # the same tensor object, new storage


def _swap_a_param(params, state):
    params["b"] = _strided(params["b"])


@pytest.mark.parametrize("meddle", [_swap_state_leaf, _move_a_state_leaf, _swap_a_param])
def test_the_checks_kept_between_steps_follow_what_the_caller_hands_back(monkeypatch, meddle):
    """A step keeps its checks of the state and params for the next (the
    same buffers come back each step); a state leaf or a param swapped for
    a strided one, a state leaf's storage moved: the next step notices (the
    kernels take contiguous buffers: the state's are left to the reference,
    the params' are stepped in a copy) and the values stay the reference's."""
    ref, rstate, _ = _scripted(monkeypatch, False, meddle)
    got, state, calls = _scripted(monkeypatch, True, meddle)
    assert len(calls) == (6 * 2 if meddle is _swap_a_param else 3 * 2)
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-7)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=2e-7)


def test_a_state_its_user_drops_is_freed():
    import gc
    import weakref

    opt = sx.optim.adamw(1e-2)
    params = {"w": torch.zeros(100)}
    state = opt.init(params)
    params, state = sx.optim.step(opt, {"w": torch.ones(100)}, state, params, donate=True)
    nu = weakref.ref(state[0].nu["w"])
    state = opt.init(params)  # e.g. a fresh state, or one loaded from a checkpoint
    gc.collect()
    assert nu() is None
    params, state = sx.optim.step(opt, {"w": torch.ones(100)}, state, params, donate=True)
    assert int(state[0].count) == 1


@pytest.mark.parametrize("donate", [False, True])
def test_bf16_params_with_fp32_master_weights_step_in_one_pass(monkeypatch, donate):
    """``with_master_weights(adamw)``: one kernel call per leaf and step
    updates the fp32 master copy and writes the bf16 params, as the
    reference's update + apply_updates gives them."""

    def go(fused: bool) -> tuple[dict, object]:
        native(monkeypatch, fused)
        g = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(1000, generator=g).to(torch.bfloat16)}
        opt = sx.optim.with_master_weights(sx.optim.adamw(1e-2, weight_decay=0.1))
        state = opt.init(params)
        for _ in range(4):
            grads = {"w": torch.randn(1000, generator=g).to(torch.bfloat16)}
            if fused:
                ptr = params["w"].data_ptr()
                params, state = sx.optim.step(opt, grads, state, params, donate=donate)
                assert (params["w"].data_ptr() == ptr) == donate
            else:
                updates, state = opt.update(grads, state, params)
                params = sx.optim.apply_updates(params, updates)
        return params, state

    calls = spy(monkeypatch, "sx_adamw")
    (fused, fstate), (ref, rstate) = go(True), go(False)
    assert len(calls) == 4
    assert fused["w"].dtype == torch.bfloat16
    torch.testing.assert_close(fstate.master["w"], rstate.master["w"], rtol=1e-6, atol=2e-7)
    assert torch.equal(fused["w"], fstate.master["w"].to(torch.bfloat16))
    # one bf16 rounding apart at most: half an ulp, relative (2**-8 of |w|), on each side
    torch.testing.assert_close(fused["w"].float(), ref["w"].float(), rtol=2**-7, atol=0)


def test_optim_benchmark_smoke(tmp_path):
    out = tmp_path / "optim.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/optim.py", "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert {"shardax_step", "shardax", "shardax_reference", "torch_foreach", "torch_fused"} <= set(
        result["results"]
    )
    assert all(r["ms"] > 0 for r in result["results"].values() if "ms" in r)


@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16-master"])
def test_a_chain_ending_in_a_fused_optimizer_steps_its_last_part_in_one_pass(monkeypatch, master):
    """``chain(clip_by_global_norm, adamw)`` (what ``RunConfig`` builds, under
    ``with_master_weights`` for bf16): the clipping's update, then AdamW's
    one-pass step — the same params as update + apply_updates."""

    def make():
        opt = sx.optim.chain(sx.optim.clip_by_global_norm(0.5), sx.optim.adamw(1e-2))
        return sx.optim.with_master_weights(opt) if master else opt

    dtype = torch.bfloat16 if master else torch.float32
    native(monkeypatch, True)
    calls = spy(monkeypatch, "sx_adamw")
    got, _ = run(make(), "donate", dtype=dtype, steps=4)
    assert len(calls) == 4 * 2
    ref, _ = run(make(), "update", dtype=dtype, steps=4)
    for k in ref:
        torch.testing.assert_close(got[k].float(), ref[k].float(), rtol=1e-6, atol=2e-7)


def test_a_chain_whose_last_step_does_not_cover_the_call_updates_and_applies(monkeypatch):
    native(monkeypatch, False)  # no kernels: the chain's step falls back after the clipping
    opt = sx.optim.chain(sx.optim.clip_by_global_norm(0.5), sx.optim.adamw(1e-2))
    assert opt.step is not None
    got, state = run(opt, "step", steps=3)
    ref, rstate = run(opt, "update", steps=3)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert [type(s).__name__ for s in state] == [type(s).__name__ for s in rstate]
    with pytest.raises(ValueError, match="needs the tuple of their 2 states"):
        sx.optim.step(opt, {"w": torch.ones(1)}, (), {"w": torch.ones(1)})
