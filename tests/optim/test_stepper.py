"""The fused stepper (``optim.fused_step``) against the reference chains of
transforms (``SHARDAX_NO_NATIVE=1``, ``update`` + ``apply_updates``): AdamW,
Adam, Lion, Adagrad and RMSprop, on params laid out like the state and on
ZeRO-1 params (the kernels write the update, ``apply_updates`` the params),
fp32 and bf16 gradients, constant and scheduled learning rates, with and
without weight decay — the same state structure, values within about an
ulp after several steps (Lion bit for bit); AdamW without bias correction
(DeepSpeed's option); bf16 params with fp32 master weights in one pass;
chains ending in a fused optimizer; leaves without a gradient, and leaves
that missed steps stepped with their own counts; what the kernels do not
cover runs the reference. Its contract:
where covered it writes and returns the very buffers it was given; it
rejects what is not an optimizer, and a state from another one, by type;
and the optimizer benchmark's smoke run."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import optree
import pytest
import torch

import shardax as sx
from shardax import Layout, P
from shardax.kernels import OPTIM
from shardax.optim._base import KERNELS, Fusible, GradientTransformation, Kernel
from shardax.optim._native import ALGORITHMS, native
from shardax.shard._placement import Placement

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
    "adamw_no_bias_correction": (  # DeepSpeed's FusedAdam(bias_correction=False)
        lambda lr, wd: sx.optim.adamw(lr, weight_decay=wd, bias_correction=False),
        "sx_adamw",
        False,
    ),
    "lion": (lambda lr, wd: sx.optim.lion(lr, weight_decay=wd), "sx_lion", True),
    "adagrad": (
        lambda lr, wd: sx.optim.adagrad(lr, weight_decay=wd, eps=1e-8),
        "sx_adagrad",
        False,
    ),
    "rmsprop": (lambda lr, wd: sx.optim.rmsprop(lr, weight_decay=wd), "sx_rmsprop", False),
}


def native_on(monkeypatch, on: bool) -> None:
    if on:
        monkeypatch.delenv("SHARDAX_NO_NATIVE", raising=False)
    else:
        monkeypatch.setenv("SHARDAX_NO_NATIVE", "1")


def _zero1(tree: dict) -> dict:
    """ZeRO-1's arrangement at world size 1: replicated params (and
    gradients) whose optimizer state is laid out as P('dp') — unlike them."""
    mesh = sx.Mesh({"dp": 1})
    rep, split = Layout(mesh), Layout(mesh, P("dp"))
    out = {}
    for k, x in tree.items():
        y = sx.shard(x, mesh, P())
        out[k] = sx.Sharded(y.local, y.layout, y.shape, placement=Placement(rep, rep, split))
    return out


def run(opt, via: str, dtype=torch.float32, grad_dtype=None, steps: int = STEPS):
    """``steps`` steps of ``opt``: by ``update`` + ``apply_updates``
    ("update"), or by the fused stepper on plain tensors ("stepper") or on
    ZeRO-1 params ("zero1"). The dense params and the state at the end."""
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4099, generator=g).to(dtype),
        "b": torch.randn(3, generator=g).to(dtype),
    }
    if via == "zero1":
        params = _zero1(params)
    state = opt.init(params)
    stepper = sx.optim.fused_step(opt)
    for _ in range(steps):
        grads = {
            k: torch.randn(v.shape, generator=g).to(grad_dtype or dtype) for k, v in params.items()
        }
        if via == "update":
            updates, state = opt.update(grads, state, params)
            params = sx.optim.apply_updates(params, updates)
            continue
        if via == "zero1":
            grads = sx.shard(grads, sx.Mesh({"dp": 1}), P())
        given = {k: sx.optim._base.local(v) for k, v in params.items()}
        params, state = stepper.step(params, grads, state)
        # donated: every param's own buffer holds its new value
        assert all(sx.optim._base.local(params[k]) is given[k] for k in given)
    return (sx.gather(params) if via == "zero1" else params), state


def spy(monkeypatch, kernel: str) -> list[int]:
    """The leaves ``kernel`` steps, one entry each (its apply flag)."""
    calls: list[int] = []
    functions = native().functions
    real = functions[kernel]
    # a call steps its table's a[1] leaves, a[2]: 1 writes the params, 0 the updates
    monkeypatch.setitem(functions, kernel, lambda *a: (calls.extend([a[2]] * a[1]), real(*a))[1])
    return calls


def state_tensors(state) -> list[torch.Tensor]:
    leaves = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, sx.Sharded))
    return [sx.optim._base.local(x) for x in leaves if isinstance(x, torch.Tensor | sx.Sharded)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("via", ["stepper", "zero1"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("lr", [1e-2, SCHEDULE], ids=["constant-lr", "schedule"])
@pytest.mark.parametrize("grads", [torch.float32, torch.bfloat16], ids=["fp32-grads", "bf16-grads"])
def test_fused_matches_the_reference(monkeypatch, name, via, wd, lr, grads):
    make, kernel, exact = OPTIMIZERS[name]
    covered = not (wd and grads != torch.float32 and name in ("adam", "adagrad", "rmsprop"))
    native_on(monkeypatch, False)
    ref, rstate = run(make(lr, wd), "update", grad_dtype=grads)
    native_on(monkeypatch, True)
    calls = spy(monkeypatch, kernel)
    got, state = run(make(lr, wd), via, grad_dtype=grads)
    # the kernel really ran, every step, both leaves — writing the params in
    # place, or ZeRO-1's updates — or not at all where the reference rounds
    # differently (it decays bf16 gradients in bf16)
    assert calls == ([int(via == "stepper")] * STEPS * 2 if covered else [])
    assert [type(s).__name__ for s in state] == [type(s).__name__ for s in rstate]
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, **_tolerance(exact))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **_tolerance(exact))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_where_covered_the_stepper_writes_and_returns_the_buffers_it_was_given(name):
    """The mutation contract: the same param tensors and the same state
    tensors come back, holding the new values (and the step counts advanced)."""
    make, _, _ = OPTIMIZERS[name]
    opt = make(SCHEDULE, 0.1)
    params = {"w": torch.randn(100), "b": torch.randn(3)}
    state = opt.init(params)
    params0, state0 = dict(params), state_tensors(state)
    values0 = [x.clone() for x in state0]
    grads = {k: torch.randn(v.shape) for k, v in params.items()}
    new_params, new_state = sx.optim.fused_step(opt).step(params, grads, state)
    assert all(new_params[k] is params0[k] for k in params0)
    assert all(a is b for a, b in zip(state_tensors(new_state), state0, strict=True))
    changed = [not torch.equal(a, b) for a, b in zip(state0, values0, strict=True)]
    assert all(changed), changed  # every buffer and count stepped, in place


def test_the_pure_update_runs_no_kernel_and_is_the_reference(monkeypatch):
    """``update`` is the chain of transforms, whatever the kernels: bit for
    bit the ``SHARDAX_NO_NATIVE`` run, and no native call."""
    for name, (make, kernel, _) in OPTIMIZERS.items():
        native_on(monkeypatch, True)
        calls = spy(monkeypatch, kernel)
        got, state = run(make(SCHEDULE, 0.1), "update", steps=3)
        native_on(monkeypatch, False)
        ref, rstate = run(make(SCHEDULE, 0.1), "update", steps=3)
        assert not calls, name
        assert all(torch.equal(got[k], ref[k]) for k in ref), name
        assert all(
            torch.equal(a, b)
            for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True)
        ), name


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
        native_on(monkeypatch, on)
        g = torch.Generator().manual_seed(1)
        params = {f"p{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
        opt = make(1e-2, 0.1)
        state = opt.init(params)
        for _ in range(3):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            if on:
                params, state = sx.optim.fused_step(opt).step(params, grads, state)
            else:
                updates, state = opt.update(grads, state, params)
                params = sx.optim.apply_updates(params, updates)
        return params, state

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, rstate = go(False)
        native_on(monkeypatch, True)
        calls = spy(monkeypatch, kernel)
        got, state = go(True)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 3 * (len(sizes) - 1)  # every non-empty leaf, every step
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, **_tolerance(exact))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **_tolerance(exact))


def test_step_leaves_its_inputs_alone_and_the_stepper_writes_them():
    opt = sx.optim.adamw(1e-2)
    params = {"w": torch.ones(5)}
    state = opt.init(params)
    new, _ = sx.optim.step(opt, {"w": torch.ones(5)}, state, params)
    assert torch.equal(params["w"], torch.ones(5)) and not torch.equal(new["w"], params["w"])
    stepped, _ = sx.optim.fused_step(opt).step(params, {"w": torch.ones(5)}, state)
    assert stepped["w"] is params["w"] and torch.equal(params["w"], new["w"])


def test_what_the_kernels_do_not_cover_runs_the_reference(monkeypatch):
    calls = spy(monkeypatch, "sx_adamw")
    cases = [
        ({"dtype": torch.bfloat16}, {}),  # bf16 state
        ({}, {"mask": {"w": True, "b": False}}),  # a mask
        ({}, {"amsgrad": True}),
    ]
    for run_kw, opt_kw in cases:
        native_on(monkeypatch, True)
        fused, _ = run(sx.optim.adamw(1e-2, weight_decay=0.1, **opt_kw), "stepper", **run_kw)
        native_on(monkeypatch, False)
        ref, _ = run(sx.optim.adamw(1e-2, weight_decay=0.1, **opt_kw), "update", **run_kw)
        for k in ref:
            assert torch.equal(fused[k], ref[k]), (run_kw, opt_kw, k)
    assert not calls
    for opt in (sx.optim.rmsprop(1e-2, momentum=0.9), sx.optim.rmsprop(1e-2, centered=True)):
        assert not isinstance(opt, Fusible)  # the chain's own update


def _scripted(monkeypatch, on: bool, meddle) -> tuple[dict, object, list[int]]:
    """Six AdamW steps; after the third, ``meddle(params, state)`` changes
    what the caller hands back. Returns the params, the state and the
    leaves the kernel stepped at each step."""
    native_on(monkeypatch, on)
    calls = spy(monkeypatch, "sx_adamw") if on else []
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4099, generator=g), "b": torch.randn(3, generator=g)}
    opt = sx.optim.adamw(1e-2, weight_decay=0.1)
    stepper = sx.optim.fused_step(opt)
    state = opt.init(params)
    per_step = []
    for i in range(6):
        if i == 3:
            meddle(params, state)
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        before = len(calls)
        params, state = stepper.step(params, grads, state)
        per_step.append(len(calls) - before)
    return params, state, per_step


def _strided(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x, x], 1)[:, 0]  # equal values, every other element of a buffer


def _swap_state_leaf(params, state):
    state[0].nu["w"] = _strided(state[0].nu["w"])  # another tensor in the same dict


def _move_a_state_leaf(params, state):
    state[0].mu["w"].data = _strided(state[0].mu["w"])  # the same tensor object, new storage


def _swap_a_param(params, state):
    params["b"] = _strided(params["b"])


@pytest.mark.parametrize("meddle", [_swap_state_leaf, _move_a_state_leaf, _swap_a_param])
def test_each_step_checks_what_the_caller_hands_back(monkeypatch, meddle):
    """A state leaf or a param swapped for a strided one, a state leaf's
    storage moved: that step sees it (the kernels take contiguous buffers:
    the state's are left to the reference, the params' are stepped in a
    copy) and the values stay the reference's."""
    ref, rstate, _ = _scripted(monkeypatch, False, meddle)
    got, state, per_step = _scripted(monkeypatch, True, meddle)
    assert per_step[:3] == [2, 2, 2]
    assert per_step[3] == (2 if meddle is _swap_a_param else 0)
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-7)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=2e-7)


def test_the_stepper_keeps_no_state_alive():
    import gc
    import weakref

    opt = sx.optim.adamw(1e-2)
    stepper = sx.optim.fused_step(opt)
    params = {"w": torch.zeros(100)}
    state = opt.init(params)
    params, state = stepper.step(params, {"w": torch.ones(100)}, state)
    nu = weakref.ref(state[0].nu["w"])
    state = opt.init(params)  # e.g. a fresh state, or one loaded from a checkpoint
    gc.collect()
    assert nu() is None
    params, state = stepper.step(params, {"w": torch.ones(100)}, state)
    assert int(state[0].count["w"]) == 1


@pytest.mark.parametrize("zero1", [False, True], ids=["laid-out-alike", "zero1"])
def test_bf16_params_with_fp32_master_weights_step_in_one_pass(monkeypatch, zero1):
    """``with_master_weights(adamw)``: one kernel call per leaf and step
    updates the fp32 master copy and writes the bf16 params — in the same
    pass, or (ZeRO-1: the master copy laid out unlike the params) from the
    stepped copy — as the reference's update + apply_updates gives them."""

    def go(fused: bool) -> tuple[dict, object]:
        native_on(monkeypatch, fused)
        g = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(1000, generator=g).to(torch.bfloat16)}
        if zero1:
            params = _zero1(params)
        opt = sx.optim.with_master_weights(sx.optim.adamw(1e-2, weight_decay=0.1))
        stepper = sx.optim.fused_step(opt)
        state = opt.init(params)
        for _ in range(4):
            grads = {"w": torch.randn(1000, generator=g).to(torch.bfloat16)}
            if zero1:
                grads = sx.shard(grads, sx.Mesh({"dp": 1}), P())
            if fused:
                given = sx.optim._base.local(params["w"])
                params, state = stepper.step(params, grads, state)
                assert sx.optim._base.local(params["w"]) is given
            else:
                updates, state = opt.update(grads, state, params)
                params = sx.optim.apply_updates(params, updates)
        return sx.gather(params), sx.gather(state.master)

    calls = spy(monkeypatch, "sx_adamw")
    (fused, fmaster), (ref, rmaster) = go(True), go(False)
    assert calls == [1] * 4  # one leaf, four steps, the (master) params written
    assert fused["w"].dtype == torch.bfloat16
    torch.testing.assert_close(fmaster["w"], rmaster["w"], rtol=1e-6, atol=2e-7)
    assert torch.equal(fused["w"], fmaster["w"].to(torch.bfloat16))
    # one bf16 rounding apart at most: half an ulp, relative (2**-8 of |w|), on each side
    torch.testing.assert_close(fused["w"].float(), ref["w"].float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16-master"])
def test_a_chain_ending_in_a_fused_optimizer_steps_its_last_part_in_one_pass(monkeypatch, master):
    """``chain(clip_by_global_norm, adamw)`` (what ``RunConfig`` builds, under
    ``with_master_weights`` for bf16): the clipping's update, then AdamW's
    one-pass step — the same params as update + apply_updates."""

    def make():
        opt = sx.optim.chain(sx.optim.clip_by_global_norm(0.5), sx.optim.adamw(1e-2))
        return sx.optim.with_master_weights(opt) if master else opt

    dtype = torch.bfloat16 if master else torch.float32
    native_on(monkeypatch, True)
    calls = spy(monkeypatch, "sx_adamw")
    got, _ = run(make(), "stepper", dtype=dtype, steps=4)
    assert len(calls) == 4 * 2
    ref, _ = run(make(), "update", dtype=dtype, steps=4)
    for k in ref:
        torch.testing.assert_close(got[k].float(), ref[k].float(), rtol=1e-6, atol=2e-7)


def test_a_chain_whose_last_step_is_not_covered_updates_and_applies(monkeypatch):
    native_on(monkeypatch, False)  # no kernels: the stepper runs update and apply_updates
    opt = sx.optim.chain(sx.optim.clip_by_global_norm(0.5), sx.optim.adamw(1e-2))
    assert isinstance(opt, Fusible)
    got, state = run(opt, "stepper", steps=3)
    ref, rstate = run(opt, "update", steps=3)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert [type(s).__name__ for s in state] == [type(s).__name__ for s in rstate]
    native_on(monkeypatch, True)
    with pytest.raises(ValueError, match="needs the tuple of their 2 states"):
        sx.optim.fused_step(opt).step({"w": torch.ones(1)}, {"w": torch.ones(1)}, ())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_leaf_without_a_gradient_is_left_as_it_is(monkeypatch, name):
    """As ``optim.step``: a leaf whose gradient is None keeps its value and
    its state (the same tensors, untouched, its step count too); the others
    are stepped by the kernel; the schedule's step still advances."""
    make, kernel, exact = OPTIMIZERS[name]
    calls = spy(monkeypatch, kernel)
    opt = make(SCHEDULE, 0.1)
    g = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(50, generator=g), "frozen": torch.randn(4, generator=g)}
    grads = {"a": torch.randn(50, generator=g), "frozen": None}
    state = opt.init(params)
    ref, rstate = sx.optim.step(opt, grads, opt.init(params), params)
    frozen = params["frozen"].clone()
    frozen_state = [x for x in state_tensors(state) if x.shape == (4,)]
    before = [x.clone() for x in frozen_state]
    got, state = sx.optim.fused_step(opt).step(params, grads, state)
    assert len(calls) == 1  # the leaf with a gradient
    assert got["frozen"] is params["frozen"] and torch.equal(got["frozen"], frozen)
    after = [x for x in state_tensors(state) if x.shape == (4,)]
    assert all(
        a is b and torch.equal(a, c) for a, b, c in zip(after, frozen_state, before, strict=True)
    )
    torch.testing.assert_close(got["a"], ref["a"], **_tolerance(exact))
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, **_tolerance(exact))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("via", ["stepper", "zero1"])
def test_leaves_that_missed_steps_are_stepped_with_their_own_counts(monkeypatch, name, via):
    """A leaf without a gradient at steps 1 and 2, then with one: the
    kernels step it with its own step count (Adam's bias correction: a
    second launch for it where the counts differ), as the reference does —
    on params laid out like the state and on ZeRO-1's (the updates
    written, then applied around the kept leaf)."""
    make, kernel, exact = OPTIMIZERS[name]
    opt = make(SCHEDULE, 0.1)
    g = torch.Generator().manual_seed(5)
    dense = {"a": torch.randn(50, generator=g), "b": torch.randn(7, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in dense.items()} for _ in range(4)]
    for i in (1, 2):
        grads[i]["b"] = None
    native_on(monkeypatch, False)
    ref, rstate = dict(dense), opt.init(dense)
    for gs in grads:
        ref, rstate = sx.optim.step(opt, gs, rstate, ref)
    native_on(monkeypatch, True)
    calls = spy(monkeypatch, kernel)
    params = _zero1(dense) if via == "zero1" else {k: v.clone() for k, v in dense.items()}
    state = opt.init(params)
    for gs in grads:
        if via == "zero1":
            gs = {
                k: None if v is None else sx.shard(v, sx.Mesh({"dp": 1}), P())
                for k, v in gs.items()
            }
        kept, before = params["b"], sx.optim._base.local(params["b"]).clone()
        params, state = sx.optim.fused_step(opt).step(params, gs, state)
        if gs["b"] is None:  # the very tensor, as it was
            assert params["b"] is kept and torch.equal(sx.optim._base.local(kept), before)
    assert len(calls) == 2 + 1 + 1 + 2  # the leaves stepped, each step
    got = sx.gather(params) if via == "zero1" else params
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **_tolerance(exact))
    for a, b in zip(state_tensors(state), state_tensors(rstate), strict=True):
        torch.testing.assert_close(a, b, **_tolerance(exact))


def test_fused_step_of_something_else_is_a_type_error():
    with pytest.raises(TypeError, match=r"fused_step takes a GradientTransformation.*got a dict"):
        sx.optim.fused_step({"init": None, "update": None})  # type: ignore[arg-type]


def test_a_state_from_another_optimizer_is_a_type_error_before_anything_is_written():
    params = {"w": torch.ones(3)}
    lion_state = sx.optim.lion(1e-2).init(params)
    with pytest.raises(TypeError, match="scale_by_adam expects its ScaleByAdamState"):
        sx.optim.fused_step(sx.optim.adamw(1e-2)).step(params, {"w": torch.ones(3)}, lion_state)
    assert torch.equal(params["w"], torch.ones(3))


def test_fusible_keeps_the_optax_contract():
    """Two fields, unpacked as ``init, update``; a copy keeps the kernel;
    ``_replace`` — new functions — gives a plain GradientTransformation."""
    opt = sx.optim.adamw(1e-2)
    init, update = opt
    assert init is opt.init
    assert isinstance(opt, GradientTransformation) and len(opt) == 2
    assert copy.deepcopy(opt).fusion == opt.fusion
    replaced = opt._replace(update=update)
    assert type(replaced) is GradientTransformation
    assert not isinstance(sx.optim.chain(opt, sx.optim.scale(1.0)), Fusible)
    assert set(ALGORITHMS) == set(KERNELS)  # every kernel a Kernel can name has its algorithm
    with pytest.raises(ValueError, match="must be in"):
        Kernel(name="adamx", lr=1e-3, core=0, length=3)  # type: ignore[arg-type]


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
    muon = result["muon"]  # Muon beside torch.optim.Muon, and the state each keeps
    assert muon["shardax_muon_gpt_leaves"]["ms"] > 0 and muon["torch_muon_gpt_leaves"]["ms"] > 0
    held = muon["state_bytes_per_param"]
    assert held["shardax_muon"] == held["explain"] < 4.5 and held["adamw"] == 8
