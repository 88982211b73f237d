"""Native kernel builds: a fresh cache builds and loads; a compiler without
OpenMP still builds (single-threaded); no compiler is one warning and a
clean None (the pure-torch paths run), with the reason in the status.

And what the kernels' vectorised loops must keep: the fp16/bf16
conversions bit for bit as torch's, through the optimizer kernel's loops;
an AdamW step written over its param (out is p) the same, bit for bit, as
one into a fresh buffer, and torch's AdamW to rounding; a shared-memory
all_to_all large enough for streaming stores, in uneven pieces at
unaligned offsets, equal to gloo's."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import warnings

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax.kernels import OPTIM, NativeLibrary, find_compiler

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler here")


def _reduce_works(lib) -> bool:
    lib.sx_reduce.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                              ctypes.c_int64, ctypes.c_int, ctypes.c_int]  # fmt: skip
    a, b, out = (
        (ctypes.c_float * 3)(1, 2, 3),
        (ctypes.c_float * 3)(10, 20, 30),
        (ctypes.c_float * 3)(),
    )
    srcs = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
    return lib.sx_reduce(ctypes.addressof(out), srcs, 2, 3, 0, 0) == 0 and list(out) == [11, 22, 33]


def test_a_fresh_cache_builds_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDAX_KERNEL_CACHE", str(tmp_path))
    lib = NativeLibrary("shm-test", "shm.cpp", register=False)
    assert lib.status()["state"] == "buildable"
    assert _reduce_works(lib.load())
    assert lib.status()["state"] == "built" and lib.path.exists()


def test_a_compiler_without_openmp_still_builds(tmp_path, monkeypatch):
    wrapper = tmp_path / "cxx-no-openmp"
    wrapper.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {find_compiler()} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("SHARDAX_KERNEL_CACHE", str(tmp_path / "cache"))
    lib = NativeLibrary("shm-no-omp", "shm.cpp", register=False)
    assert _reduce_works(lib.load())


def test_no_compiler_is_a_clean_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ here
    lib = NativeLibrary("shm-none", "shm.cpp", register=False)
    status = lib.status()
    assert status["state"] == "unavailable" and "no C++ compiler" in status["reason"]
    with pytest.warns(RuntimeWarning, match="native kernels 'shm-none' unavailable"):
        assert lib.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lib.load() is None  # warned once
    assert "no C++ compiler" in lib.status()["reason"]
    assert shutil.which("c++", path=os.environ["PATH"]) is None


# -- the optimizer kernels' loops ----------------------------------------------------------

_CODES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}


def _kernel(name: str, scalars: int):
    """``name`` of the built optimizer library, typed here (a prototype of
    its own: the optimizer's typed functions are left as they are)."""
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                             *[ctypes.c_double] * scalars)  # fmt: skip
    return proto((name, OPTIM.load()))


def _leaf(s0, s1, g, p, out, shadow=None) -> list[int]:
    """One row of the kernels' table (see kernels/csrc/optim.cpp)."""
    return [s0.data_ptr(), s1.data_ptr(), g.data_ptr(), _CODES[g.dtype],
            0 if p is None else p.data_ptr(), out.data_ptr(),
            0 if shadow is None else shadow.data_ptr(),
            0 if shadow is None else _CODES[shadow.dtype], out.numel()]  # fmt: skip


def _run(kernel, rows: list[int], apply: int, *scalars: float) -> None:
    table = (ctypes.c_int64 * len(rows))(*rows)
    assert kernel(ctypes.addressof(table), len(rows) // 9, apply, *scalars) == 0


def _all_kinds_of_floats(n: int) -> torch.Tensor:
    """fp32 values of every kind: random bit patterns (NaNs, infinities,
    subnormals included), values near the fp16 and bf16 rounding points and
    overflow, signed zeros."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64)
    near = [65504.0, 65519.99, 65520.0, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1 + 2.0**-11]
    special = torch.tensor(near + [-v for v in near] + [0.0, -0.0, float("inf"), float("nan")])
    scaled = torch.randn(n, generator=g) * torch.logspace(-30, 30, n, base=2.0)
    return torch.cat([bits.to(torch.int32).view(torch.float32), special, scaled])


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_the_kernels_convert_fp16_and_bf16_bit_for_bit_as_torch(low):
    """Adagrad with neither decay nor rate: its param comes out as it went in
    (p + 0) and is rounded into the shadow — every kind of fp32 narrowed as
    torch narrows it (a NaN to a NaN); and every one of the 2^16 gradients
    widened exactly (the accumulator is g·g, as torch squares the widened
    value)."""
    adagrad = _kernel("sx_adagrad", 3)
    p = _all_kinds_of_floats(1 << 20)
    out, shadow = torch.empty_like(p), torch.empty(p.shape, dtype=low)
    acc, acc_out, g = (torch.zeros_like(p) for _ in range(3))
    _run(adagrad, _leaf(acc, acc_out, g, p, out, shadow), 1, 0.0, 1.0, 0.0)
    assert torch.equal(out.view(torch.int32), (p + 0.0).view(torch.int32))
    nan = out.isnan()  # stays NaN; its payload is not torch's (nor need it be)
    assert torch.equal(shadow.isnan(), nan)
    assert torch.equal(shadow[~nan].view(torch.int16), out[~nan].to(low).view(torch.int16))

    g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(low)
    acc, acc_out, update = (torch.zeros(g.shape) for _ in range(3))
    _run(adagrad, _leaf(acc, acc_out, g, None, update), 0, 0.0, 1.0, 0.0)
    widened = g.float()
    torch.testing.assert_close(acc_out, widened * widened, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("grads", [torch.float32, torch.bfloat16, torch.float16])
def test_an_adamw_step_over_its_param_is_the_step_into_a_fresh_buffer(grads, threads):
    """The loop is vectorised with out and p the same buffer: that step (and
    its bf16 shadow) is bit for bit the one written elsewhere, across sizes
    that leave vector tails and leaves split between threads; and it is
    torch's AdamW, to the rounding of a handful of fp32 operations in a
    different order (relative 1e-6 of the step, where the params move by
    ~lr = 1e-2: atol 1e-7 on params near 1)."""
    adamw = _kernel("sx_adamw", 8)
    sizes = [1, 7, 8, 9, 4099, 70001, 200_003]
    gen = torch.Generator().manual_seed(1)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads_ = [torch.randn(n, generator=gen).to(grads) for n in sizes]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    torch_opt = torch.optim.AdamW(ref, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    here = [p.clone() for p in params]
    there = [p.clone() for p in params]
    state = {k: [[torch.zeros(n) for n in sizes] for _ in range(2)] for k in ("here", "there")}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in range(1, 4):
            for r, g in zip(ref, grads_, strict=True):
                r.grad = g.float()
            torch_opt.step()
            scalars = (1 - b1, b2, 1 - b2, (1 - b2**t) ** 0.5, eps, 1 / (1 - b1**t), wd, -lr)
            OPTIM.load().sx_threads(threads)
            shadows = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            mu, nu = state["here"]
            rows = [x for i in range(len(sizes)) for x in
                    _leaf(mu[i], nu[i], grads_[i], here[i], here[i], shadows[i])]  # fmt: skip
            _run(adamw, rows, 1, *scalars)
            fresh = [torch.empty(n) for n in sizes]
            mu, nu = state["there"]
            rows = [x for i in range(len(sizes)) for x in
                    _leaf(mu[i], nu[i], grads_[i], there[i], fresh[i])]  # fmt: skip
            _run(adamw, rows, 1, *scalars)
            there = fresh
            for a, b, s in zip(here, there, shadows, strict=True):
                assert torch.equal(a, b) and torch.equal(s, a.to(torch.bfloat16))
    finally:
        torch.set_num_threads(before)
    for a, r in zip(here, ref, strict=True):
        torch.testing.assert_close(a, r.detach(), rtol=1e-6, atol=1e-7)


# -- the shared-memory all_to_all ------------------------------------------------------------


def big_all_to_all() -> bool:
    """On each rank: pieces of ~8.6 MB for each member (an output past the
    streaming threshold), their lengths odd numbers of bf16 — no multiple
    of a cache line, different for each sender and receiver — so that every
    piece lands at an unaligned offset; the bits gloo delivers."""
    import torch.distributed as dist

    from shardax.collectives import _shm_backend
    from shardax.collectives._backend import comm_of
    from shardax.collectives._torch_backend import TORCH_BACKEND

    mesh = sx.Mesh({"x": -1}, timeout=605.0)
    group = sx.collectives._api._group("x", mesh, "test")
    shm = _shm_backend.ShmBackend(TORCH_BACKEND)
    shm.attach(group.state, dist.distributed_c10d._get_default_store())
    comm_of(group).check = False  # driven directly, outside ``start``
    n, me = group.size, group.index
    splits = [4_300_001 + 26 * me + 10 * d for d in range(n)]  # what this rank sends to d
    recv = [4_300_001 + 26 * j + 10 * me for j in range(n)]  # what j sends here
    g = torch.Generator().manual_seed(me)
    src = torch.randint(-(2**15), 2**15, (sum(splits),), generator=g, dtype=torch.int32)
    src = src.to(torch.int16).view(torch.bfloat16)
    got, want = (torch.empty(sum(recv), dtype=torch.bfloat16) for _ in range(2))
    shm.all_to_all(got, src, recv, splits, group).wait()
    TORCH_BACKEND.all_to_all(want, src, recv, splits, group).wait()
    return torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.world_size(2)
def test_a_large_all_to_all_in_uneven_pieces_is_gloos():
    from shardax.collectives import _shm_backend

    if not _shm_backend.shm_available()[0]:
        pytest.skip("no /dev/shm here")
    assert run_ranks(big_all_to_all, world_size=2) == [True, True]
