"""Native kernels, each with a pure-torch reference used automatically when
the native one is unavailable.

Built on first use by the system C++ compiler into a per-version cache
(``SHARDAX_KERNEL_CACHE``; ``SHARDAX_NO_NATIVE=1`` turns them off); a
missing compiler is one warning and the pure-torch paths, never an import
error. ``shardax report`` lists each library's status.

- ``shm``: the shared-memory collective backend's core (a barrier over a
  shared segment, reductions of fp32/fp64/fp16/bf16/int32/int64).
- ``optim``: fused optimizer steps — AdamW's and Lion's update in one pass
  over gradient, moments and parameter — used by :func:`shardax.optim.adamw`
  and :func:`shardax.optim.lion` for fp32 CPU tensors.
"""

from __future__ import annotations

from ._build import NativeLibrary, cache_dir, find_compiler, registry

__all__ = ["OPTIM", "SHM", "NativeLibrary", "cache_dir", "find_compiler", "registry"]

SHM = NativeLibrary("shm", "shm.cpp")
"""The shared-memory collectives' core (``kernels/csrc/shm.cpp``)."""

OPTIM = NativeLibrary("optim", "optim.cpp")
"""Fused optimizer steps (``kernels/csrc/optim.cpp``)."""
