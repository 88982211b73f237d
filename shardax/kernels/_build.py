"""Building native kernels: C++ sources compiled with the system compiler
(OpenMP, vectorised for this CPU) on first use into a per-version cache,
loaded with ctypes — no torch headers, so a build takes a second or two —
and a registry that says, per library, whether it is built, buildable or
unavailable, and why. A missing compiler is a clean fallback (one warning,
pure-torch implementations run), never an import error.

Several ranks may build the same library at once: the build holds a file
lock and publishes the result with an atomic rename.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

__all__ = ["NativeLibrary", "cache_dir", "find_compiler", "registry"]

_SOURCES = Path(__file__).resolve().parent / "csrc"
_REGISTRY: dict[str, NativeLibrary] = {}


def find_compiler() -> str | None:
    """``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` on ``PATH``."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def cache_dir() -> Path:
    """Where built libraries live: ``$SHARDAX_KERNEL_CACHE``, else
    ``~/.cache/shardax/kernels``, one folder per shardax version, Python and
    machine."""
    root = os.environ.get("SHARDAX_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardax", "kernels"
    )
    try:
        version = importlib.metadata.version("shardax")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    tag = f"{version}-py{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}"
    return Path(root) / tag


class NativeLibrary:
    """One C++ source file in ``kernels/csrc``, built into a shared library.

    >>> lib = NativeLibrary("shm", "shm.cpp", register=False)
    >>> lib.status()["state"] in ("built", "buildable", "unavailable")
    True
    """

    def __init__(
        self, name: str, source: str, *, openmp: bool = True, register: bool = True
    ) -> None:
        self.name, self.source, self.openmp = name, _SOURCES / source, openmp
        self._lib: Any = None
        self._error: str | None = None
        self._lock = threading.Lock()
        if register:  # listed by registry() (shardax report)
            _REGISTRY[name] = self

    @property
    def path(self) -> Path:
        """The built library's path: named by a hash of the source, the
        headers beside it and the flags."""
        headers = b"".join(h.read_bytes() for h in sorted(self.source.parent.glob("*.h")))
        digest = hashlib.sha256(self.source.read_bytes() + headers + repr(self._flags()).encode())
        return cache_dir() / f"{self.name}-{digest.hexdigest()[:16]}.so"

    def _flags(self) -> list[str]:
        # Values are rounded exactly as written (-ffp-contract=off: no fused
        # multiply-add the source does not ask for); no errno and no trapping
        # (nothing reads the floating-point flags) lets the vectoriser compute
        # both sides of a select, as the kernels' branch-free loops need.
        flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno",
                 "-fno-trapping-math"]  # fmt: skip
        if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
            flags.append(
                "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"
            )
        if self.openmp:
            flags.append("-fopenmp")
        return flags

    def status(self) -> dict[str, Any]:
        """``{"name", "state": built|buildable|unavailable, "reason"?, "path"?}``."""
        if self._lib is not None or self.path.exists():
            return {"name": self.name, "state": "built", "path": str(self.path)}
        if self._error is not None:
            return {"name": self.name, "state": "unavailable", "reason": self._error}
        if os.environ.get("SHARDAX_NO_NATIVE"):
            return {"name": self.name, "state": "unavailable", "reason": "SHARDAX_NO_NATIVE is set"}
        compiler = find_compiler()
        if compiler is None:
            return {"name": self.name, "state": "unavailable",
                    "reason": "no C++ compiler (c++, g++, clang++, $CXX) on PATH"}  # fmt: skip
        return {"name": self.name, "state": "buildable", "compiler": compiler}

    def load(self) -> Any:
        """The loaded library (built first if needed), or None when it cannot
        be: the reason is warned once and kept in :meth:`status`."""
        if self._lib is not None or self._error is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self._error is None:
                try:
                    self._lib = ctypes.CDLL(str(self._build()))
                except (OSError, RuntimeError) as err:
                    self._error = str(err)
                    warnings.warn(
                        f"shardax: native kernels '{self.name}' unavailable ({err}); "
                        "using the pure-torch implementations",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        return self._lib

    def _build(self) -> Path:
        if os.environ.get("SHARDAX_NO_NATIVE"):
            raise RuntimeError("SHARDAX_NO_NATIVE is set")
        target = self.path
        if target.exists():
            return target
        compiler = find_compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler (c++, g++, clang++, $CXX) on PATH")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it
            if target.exists():
                return target
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            try:
                flags = self._flags()
                result = self._compile(compiler, flags, tmp)
                # An old compiler, or one without OpenMP (clang without libomp):
                # retry without what it may lack — single-threaded still works.
                for drop in ("-march=native", "-mcpu=native", "-fopenmp"):
                    if result.returncode == 0:
                        break
                    if drop in flags:
                        flags = [f for f in flags if f != drop]
                        result = self._compile(compiler, flags, tmp)
                if result.returncode != 0:
                    tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
                    raise RuntimeError(f"building {self.source.name} failed: " + " | ".join(tail))
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return target

    def _compile(self, compiler: str, flags: list[str], out: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [compiler, *flags, str(self.source), "-o", out],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )


def registry() -> list[NativeLibrary]:
    """Every native library shardax knows, for ``shardax report``."""
    return list(_REGISTRY.values())
