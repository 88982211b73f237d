"""Native kernel builds: a fresh cache builds and loads; a compiler without
OpenMP still builds (single-threaded); no compiler is one warning and a
clean None (the pure-torch paths run), with the reason in the status."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import warnings

import pytest

from shardax.kernels import NativeLibrary, find_compiler

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
