"""The native libraries shardax builds: one :class:`NativeLibrary` each."""

from __future__ import annotations

from ._build import NativeLibrary

__all__ = ["OPTIM", "SHM"]

SHM = NativeLibrary("shm", "shm.cpp")
"""The shared-memory collectives' core (``kernels/csrc/shm.cpp``)."""

OPTIM = NativeLibrary("optim", "optim.cpp")
"""Fused optimizer steps (``kernels/csrc/optim.cpp``)."""
