"""Blockwise int8 quantization, as ZeRO++'s quantized weight gathers use it
(:func:`shardax.rules.zero` with ``quantize_weights=True``): every
:data:`BLOCK` consecutive elements share one fp32 scale, their absolute
maximum / 127, and travel as ``round(x / scale)`` in int8 — a quarter of
fp32's bytes, half of bf16's, plus 4 bytes per block.

On CPU the native kernel (``kernels/csrc/quant.cpp``) runs when it builds,
else the torch reference; on CUDA the NVRTC kernels of
:mod:`shardax.kernels.cuda` when CuPy is installed, else the reference. All
give the same bits.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from ._build import NativeLibrary
from .cuda import QUANT_BLOCK, dequantize_int8_reference, quantize_int8_reference

__all__ = ["BLOCK", "QUANT", "dequantize_int8", "quantize_int8", "scale_count"]

BLOCK = QUANT_BLOCK
"""Elements per block (one fp32 scale each)."""

QUANT = NativeLibrary("quant", "quant.cpp")
"""The CPU quantization kernels (``kernels/csrc/quant.cpp``)."""

_DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}


def scale_count(n: int) -> int:
    """How many scales ``n`` elements take (at least one).

    >>> scale_count(256), scale_count(257), scale_count(0)
    (1, 2, 1)
    """
    return max(1, math.ceil(n / BLOCK))


def _native() -> Any:
    lib = QUANT.load()
    if lib is not None and not hasattr(lib, "_sx_typed"):
        lib.sx_quantize_int8.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        lib.sx_dequantize_int8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
        lib.sx_quantize_int8.restype = lib.sx_dequantize_int8.restype = ctypes.c_int
        lib.sx_quant_threads.argtypes = [ctypes.c_int]
        lib.sx_quant_threads.restype = None
        lib._sx_typed = True
    return lib


def _cuda_kernels() -> Any:
    try:
        import cupy  # noqa: F401

        from . import cuda
    except ImportError:
        return None
    return cuda


def quantize_int8(
    x: torch.Tensor, q: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: ``x`` (fp32, bf16 or fp16, any shape, read flat) as
    int8 in blocks of :data:`BLOCK` elements with one fp32 scale each;
    written into ``q`` (``x.numel()`` int8) and ``scales``
    (:func:`scale_count` fp32) when given.

    >>> q, s = quantize_int8(torch.tensor([1.0, -2.0, 0.5]))
    >>> q.tolist(), round(s.item() * 127, 6)
    ([64, -127, 32], 2.0)
    """
    if x.dtype not in _DTYPES:
        raise ValueError(f"quantize_int8 takes fp32, bf16 or fp16; got {x.dtype}")
    n = x.numel()
    q = torch.empty(n, dtype=torch.int8, device=x.device) if q is None else q
    scales = (
        torch.empty(scale_count(n), dtype=torch.float32, device=x.device)
        if scales is None
        else scales
    )
    if (
        q.numel() != n
        or scales.numel() != scale_count(n)
        or q.dtype != torch.int8
        or scales.dtype != torch.float32
    ):
        raise ValueError(
            f"quantize_int8 of {n} elements writes {n} int8 and {scale_count(n)} fp32 scales; "
            f"got q {q.dtype} x {q.numel()}, scales {scales.dtype} x {scales.numel()}"
        )
    flat = x.reshape(-1)
    if x.device.type == "cpu" and n and (lib := _native()) is not None:
        flat = flat.contiguous()
        lib.sx_quant_threads(torch.get_num_threads())
        code = lib.sx_quantize_int8(flat.data_ptr(), _DTYPES[x.dtype], n, BLOCK, q.data_ptr(),
                                    scales.data_ptr())  # fmt: skip
        if code != 0:
            raise RuntimeError(f"the native quantize_int8 kernel refused its arguments ({code})")
        return q, scales
    cuda = _cuda_kernels() if x.device.type == "cuda" else None
    made = cuda.quantize_int8(flat) if cuda is not None else quantize_int8_reference(flat)
    q.copy_(made[0].reshape(-1))
    scales.copy_(made[1].reshape(-1))
    return q, scales


def dequantize_int8(
    q: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inverse of :func:`quantize_int8`: ``q * scale`` of its block, in
    ``dtype`` (flat), written into ``out`` when given.

    >>> q, s = quantize_int8(torch.tensor([1.0, -2.0, 0.5]))
    >>> dequantize_int8(q, s)
    tensor([ 1.0079, -2.0000,  0.5039])
    """
    dtype = out.dtype if out is not None else dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dequantize_int8 makes fp32, bf16 or fp16; got {dtype}")
    n = q.numel()
    if scales.numel() != scale_count(n):
        raise ValueError(
            f"{n} quantized elements have {scale_count(n)} scales; got {scales.numel()}"
        )
    out = torch.empty(n, dtype=dtype, device=q.device) if out is None else out
    if out.numel() != n:
        raise ValueError(f"dequantize_int8 of {n} elements writes {n}; out has {out.numel()}")
    if q.device.type == "cpu" and n and out.is_contiguous() and (lib := _native()) is not None:
        q, scales = q.contiguous(), scales.contiguous()
        lib.sx_quant_threads(torch.get_num_threads())
        code = lib.sx_dequantize_int8(q.data_ptr(), scales.data_ptr(), n, BLOCK, out.data_ptr(),
                                      _DTYPES[dtype])  # fmt: skip
        if code != 0:
            raise RuntimeError(f"the native dequantize_int8 kernel refused its arguments ({code})")
        return out
    cuda = _cuda_kernels() if q.device.type == "cuda" else None
    flat = q.reshape(-1)
    made = (
        cuda.dequantize_int8(flat, scales, dtype)
        if cuda is not None
        else dequantize_int8_reference(flat, scales, dtype)
    )
    out.view(-1).copy_(made) if out.is_contiguous() else out.copy_(made.view(out.shape))
    return out
