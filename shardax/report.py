"""``shardax report``: what this machine gives shardax — versions, GPUs,
collective transports, native-kernel toolchain, shared memory, environment —
and why something is unavailable. Every probe is guarded: one that fails
becomes a line saying why, never a crash.

>>> report = collect()
>>> [name for name in ("torch", "gpus", "collectives", "kernels", "shm") if name in report]
['torch', 'gpus', 'collectives', 'kernels', 'shm']
>>> isinstance(report["warnings"], list)
True
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["SHM_WARN_BYTES", "collect", "format_report"]

SHM_WARN_BYTES = 1 << 30
"""Below this, ``/dev/shm`` is flagged: Docker's default of 64 MiB breaks
shared-memory collectives and DataLoader workers (``docker run --shm-size``)."""

ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "THP_MEM_ALLOC_ENABLE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "LD_LIBRARY_PATH",
)
ENV_PREFIXES = ("SHARDAX_", "NCCL_", "TORCH_", "CUDA_", "SLURM_JOB", "OMPI_COMM_WORLD")


def _guard(probe: Callable[[], Any]) -> Any:
    try:
        return probe()
    except Exception as err:  # a probe must never take the report down
        return {"error": f"{type(err).__name__}: {err}"}


def _run(argv: list[str]) -> str | None:
    """First line of a command's output, or None if it cannot run."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _shardax() -> dict[str, Any]:
    return {
        "version": _version("shardax"),
        "location": os.path.dirname(os.path.abspath(__file__)),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
    }


def _torch() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
    }
    if torch.backends.cudnn.is_available():
        out["cudnn"] = torch.backends.cudnn.version()
    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def _gpus() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA device visible"
        return {"count": 0, "devices": [], "why_none": why}
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
            }
        )
    return {"count": len(devices), "devices": devices}


def _cupy() -> dict[str, Any]:
    try:
        import cupy
    except ImportError as err:
        return {"installed": False, "why": f"cannot import cupy ({err})"}
    out: dict[str, Any] = {"installed": True, "version": cupy.__version__}
    try:
        from cupy.cuda import nccl

        out["nccl"] = nccl.get_version()
    except Exception as err:
        out["nccl"] = None
        out["nccl_why"] = f"{type(err).__name__}: {err} (is libnccl installed?)"
    return out


def _collectives() -> dict[str, Any]:
    import torch.distributed as dist

    from .collectives._backend import backend_names, get_backend

    out: dict[str, Any] = {"backends": list(backend_names())}
    try:
        out["selected"] = get_backend().name
    except Exception as err:  # a bad SHARDAX_BACKEND
        out["selected"] = None
        out["selected_why"] = str(err)
    transports: dict[str, dict[str, Any]] = {}
    if not dist.is_available():
        why = "torch was built without torch.distributed"
        return {**out, "transports": {"gloo": {"usable": False, "why": why}}}
    transports["gloo"] = (
        {"usable": True}
        if dist.is_gloo_available()
        else {"usable": False, "why": "torch was built without gloo"}
    )
    import torch

    if not dist.is_nccl_available():
        transports["nccl"] = {"usable": False, "why": "torch was built without NCCL (CPU build)"}
    elif not torch.cuda.is_available():
        transports["nccl"] = {"usable": False, "why": "NCCL is built in, but no GPU is visible"}
    else:
        transports["nccl"] = {"usable": True}
    transports["mpi"] = (
        {"usable": True}
        if dist.is_mpi_available()
        else {"usable": False, "why": "torch was built without MPI"}
    )
    return {**out, "transports": transports}


def _compiler() -> dict[str, Any]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return {"found": True, "path": path, "version": _run([path, "--version"])}
    return {"found": False, "why": "no C++ compiler (c++, g++, clang++, $CXX) on PATH"}


def _kernels() -> dict[str, Any]:
    from . import kernels

    compiler = _compiler()
    return {"compiler": compiler, "kernels": [_guard(k.status) for k in kernels.registry()]}


def _cpu() -> dict[str, Any]:
    out: dict[str, Any] = {"count": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        out["usable"] = len(os.sched_getaffinity(0))
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return out
    if m := re.search(r"^model name\s*:\s*(.+)$", info, re.M):
        out["model"] = m.group(1).strip()
    if m := re.search(r"^flags\s*:\s*(.+)$", info, re.M):
        flags = set(m.group(1).split())
        out["simd"] = [
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma") if f in flags
        ]
    return out


def _memory() -> dict[str, Any]:
    found: dict[str, float] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = round(int(value.split()[0]) / 2**20, 1)  # kB → GiB
    return {"total_gib": found.get("MemTotal"), "available_gib": found.get("MemAvailable")}


def _shm() -> dict[str, Any]:
    if not os.path.isdir("/dev/shm"):
        return {"present": False, "why": "no /dev/shm on this system"}
    st = os.statvfs("/dev/shm")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return {
        "present": True,
        "size_gib": round(size / 2**30, 2),
        "free_gib": round(free / 2**30, 2),
        "small": size < SHM_WARN_BYTES,
    }


def _environment() -> dict[str, str]:
    return {
        k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)
    }


_PROBES: dict[str, Callable[[], Any]] = {
    "shardax": _shardax,
    "torch": _torch,
    "gpus": _gpus,
    "cupy": _cupy,
    "collectives": _collectives,
    "kernels": _kernels,
    "cpu": _cpu,
    "memory": _memory,
    "shm": _shm,
    "environment": _environment,
}


def collect() -> dict[str, Any]:
    """Every probe's findings (a failed probe: ``{"error": ...}``) and the
    ``warnings`` they add up to; JSON-serialisable."""
    report = {name: _guard(probe) for name, probe in _PROBES.items()}
    warnings = []
    for name, value in report.items():
        if isinstance(value, dict) and "error" in value:
            warnings.append(f"the {name} probe failed: {value['error']}")
    shm = report["shm"]
    if isinstance(shm, dict) and shm.get("small"):
        warnings.append(
            f"/dev/shm is {shm['size_gib']} GiB: shared-memory collectives and DataLoader workers "
            "need more (Docker: --shm-size=8g; Kubernetes: an emptyDir with medium: Memory)"
        )
    kernels = report["kernels"]
    if isinstance(kernels, dict) and not kernels.get("compiler", {}).get("found", True):
        warnings.append("no C++ compiler: native kernels cannot be built (pure torch runs)")
    report["warnings"] = warnings
    return report


def _lines(value: Any, indent: int) -> list[str]:
    pad = "  " * indent
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{k}:")
                out += _lines(v, indent + 1)
            else:
                out.append(f"{pad}{k}: {_scalar(v)}")
        return out
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, dict):
                out.append(f"{pad}- " + ", ".join(f"{k}={_scalar(v)}" for k, v in item.items()))
            else:
                out.append(f"{pad}- {_scalar(item)}")
        return out
    return [f"{pad}{_scalar(value)}"]


def _scalar(v: Any) -> str:
    if v is True:
        return "yes"
    if v is False:
        return "no"
    if v is None:
        return "-"
    if isinstance(v, (list, dict)):
        return "none" if not v else json.dumps(v)
    return str(v)


def format_report(report: dict[str, Any]) -> str:
    """The report as text: one section per probe, warnings last.

    >>> print(format_report({"shm": {"present": True, "small": False}, "warnings": []}))
    shm
      present: yes
      small: no
    warnings: none
    """
    out = []
    for name, value in report.items():
        if name == "warnings":
            continue
        out.append(name)
        if isinstance(value, (dict, list)):
            out += _lines(value, 1) or ["  none"]
        else:
            out.append(f"  {_scalar(value)}")
    warnings = report.get("warnings") or []
    out += ["warnings:", *(f"  ! {w}" for w in warnings)] if warnings else ["warnings: none"]
    return "\n".join(out)


def report_command_impl(as_json: bool) -> str:
    """The text ``shardax report`` prints."""
    report = collect()
    return json.dumps(report, indent=2, default=str) if as_json else format_report(report)
