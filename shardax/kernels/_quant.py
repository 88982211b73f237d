"""Blockwise int8 and int4 quantization, as ZeRO++ (Wang et al., 2023) sends
weights and gradients: every :data:`BLOCK` consecutive elements share one
fp32 scale, their absolute maximum / 127 (int8) or / 7 (int4), and travel
as ``round(x / scale)`` (to nearest even).

- int8 (quantized weight gathers: :func:`shardax.rules.zero` with
  ``quantize_weights=True``): one byte an element — a quarter of fp32's
  bytes, half of bf16's — plus 4 bytes per block.
- int4 (qgZ's quantized gradient reduction): values in [-7, 7], two an
  unsigned byte — element ``2i`` in the low nibble of byte ``i``, element
  ``2i + 1`` in the high one, each in two's complement; an odd count leaves
  the last high nibble 0 — an eighth of fp32's bytes, plus 4 per block.

On CPU the native kernels (``kernels/csrc/quant.cpp``) run when they build,
else the torch references; on CUDA, int8 runs the NVRTC kernels of
:mod:`shardax.kernels.cuda` when CuPy is installed, int4 (and int8 without
CuPy) the reference. All give the same bits.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from ._build import NativeLibrary
from .cuda import QUANT_BLOCK, dequantize_int8_reference, quantize_int8_reference

__all__ = [
    "BLOCK",
    "QUANT",
    "dequantize_int4",
    "dequantize_int4_reference",
    "dequantize_int8",
    "int4_bytes",
    "quantize_int4",
    "quantize_int4_reference",
    "quantize_int8",
    "scale_count",
]

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


def int4_bytes(n: int) -> int:
    """How many bytes ``n`` int4 values take, packed two a byte.

    >>> int4_bytes(4), int4_bytes(5), int4_bytes(0)
    (2, 3, 0)
    """
    return (n + 1) // 2


def _outputs(
    what: str,
    x: torch.Tensor,
    q: torch.Tensor | None,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
    numel: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers quantizing ``x`` writes: ``q`` (``numel`` of ``dtype``)
    and the fp32 scales, made where not given, checked where given."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"{what} takes fp32, bf16 or fp16; got {x.dtype}")
    count = scale_count(x.numel())
    q = torch.empty(numel, dtype=dtype, device=x.device) if q is None else q
    if scales is None:
        scales = torch.empty(count, dtype=torch.float32, device=x.device)
    if (
        q.numel() != numel
        or scales.numel() != count
        or q.dtype != dtype
        or scales.dtype != torch.float32
    ):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{what} of {x.numel()} elements writes {numel} {name} and {count} fp32 scales; "
            f"got q {q.dtype} x {q.numel()}, scales {scales.dtype} x {scales.numel()}"
        )
    return q, scales


def _native() -> Any:
    lib = QUANT.load()
    if lib is not None and not hasattr(lib, "_sx_typed"):
        lib.sx_quantize_int8.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        lib.sx_dequantize_int8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
        lib.sx_quantize_int8.restype = lib.sx_dequantize_int8.restype = ctypes.c_int
        lib.sx_quantize_int4.argtypes = lib.sx_quantize_int8.argtypes  # q: bytes, packed
        lib.sx_dequantize_int4.argtypes = lib.sx_dequantize_int8.argtypes
        lib.sx_quantize_int4.restype = lib.sx_dequantize_int4.restype = ctypes.c_int
        lib.sx_quant_threads.argtypes = [ctypes.c_int]
        lib.sx_quant_threads.restype = None
        lib._sx_typed = True
    return lib


def _call(lib: Any, name: str, *args: Any) -> None:
    """The native kernel ``sx_<name>`` on ``args``, at torch's thread count;
    a kernel refusing its arguments is an error, never garbage."""
    lib.sx_quant_threads(torch.get_num_threads())
    code = getattr(lib, f"sx_{name}")(*args)
    if code != 0:
        raise RuntimeError(f"the native {name} kernel refused its arguments ({code})")


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
    n = x.numel()
    q, scales = _outputs("quantize_int8", x, q, scales, torch.int8, n)
    flat = x.reshape(-1)
    if x.device.type == "cpu" and n and (lib := _native()) is not None:
        flat = flat.contiguous()
        _call(lib, "quantize_int8", flat.data_ptr(), _DTYPES[x.dtype], n,
              BLOCK, q.data_ptr(), scales.data_ptr())  # fmt: skip
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
        _call(lib, "dequantize_int8", q.data_ptr(), scales.data_ptr(), n,
              BLOCK, out.data_ptr(), _DTYPES[dtype])  # fmt: skip
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


# -- int4 ------------------------------------------------------------------------


def quantize_int4_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int4` in torch, on any device: ``(packed uint8,
    fp32 scales)``.

    >>> q, s = quantize_int4_reference(torch.tensor([1.0, -2.0, 0.5]))
    >>> [hex(b) for b in q.tolist()], round(s.item() * 7, 6)
    (['0x93', '0x2'], 2.0)
    """
    flat = x.reshape(-1).float()
    n = flat.numel()
    blocks = scale_count(n)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    rows = padded.view(blocks, BLOCK)
    peak = rows.abs().amax(dim=1)
    scales = peak / torch.full_like(peak, 7.0)  # a true division, as the kernel's
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.where(scales[:, None] > 0, torch.round(rows / safe[:, None]), torch.zeros_like(rows))
    codes = q.clamp(-7, 7).to(torch.int16).reshape(-1)[: 2 * int4_bytes(n)]  # padding: 0
    codes = codes.bitwise_and(0xF).view(-1, 2)
    packed = codes[:, 0].bitwise_or(codes[:, 1].bitwise_left_shift(4)).to(torch.uint8)
    return packed, scales


def dequantize_int4_reference(
    q: torch.Tensor, scales: torch.Tensor, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_int4` of ``n`` elements in torch, on any device.

    >>> q, s = quantize_int4_reference(torch.tensor([1.0, -2.0, 0.5]))
    >>> dequantize_int4_reference(q, s, 3, torch.float32)
    tensor([ 0.8571, -2.0000,  0.5714])
    """
    byte = q.reshape(-1).to(torch.int16)
    nibbles = torch.stack([byte.bitwise_and(0xF), byte.bitwise_right_shift(4).bitwise_and(0xF)], 1)
    values = nibbles.bitwise_xor(8).sub(8).reshape(-1)[:n]  # two's complement
    index = torch.arange(n, device=q.device) // BLOCK
    return (values.float() * scales[index]).to(dtype)


def quantize_int4(
    x: torch.Tensor, q: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: ``x`` (fp32, bf16 or fp16, any shape, read flat) as
    int4 in [-7, 7], two values a byte (the module docstring gives the
    packing), in blocks of :data:`BLOCK` elements with one fp32 scale each
    (absolute maximum / 7); written into ``q`` (:func:`int4_bytes` uint8)
    and ``scales`` (:func:`scale_count` fp32) when given. A value comes
    back within half its block's scale (:func:`dequantize_int4`).

    >>> q, s = quantize_int4(torch.tensor([1.0, -2.0, 0.5]))
    >>> [hex(b) for b in q.tolist()], round(s.item() * 7, 6)
    (['0x93', '0x2'], 2.0)
    """
    n = x.numel()
    q, scales = _outputs("quantize_int4", x, q, scales, torch.uint8, int4_bytes(n))
    flat = x.reshape(-1)
    if (
        x.device.type == "cpu"
        and n
        and q.is_contiguous()
        and scales.is_contiguous()
        and (lib := _native()) is not None
    ):
        flat = flat.contiguous()
        _call(lib, "quantize_int4", flat.data_ptr(), _DTYPES[x.dtype], n,
              BLOCK, q.data_ptr(), scales.data_ptr())  # fmt: skip
        return q, scales
    made = quantize_int4_reference(flat)
    q.copy_(made[0].view(q.shape))
    scales.copy_(made[1].view(scales.shape))
    return q, scales


def dequantize_int4(
    q: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    *,
    numel: int | None = None,
) -> torch.Tensor:
    """The inverse of :func:`quantize_int4`: each value times the scale of
    its block, in ``dtype`` (flat), written into ``out`` when given. The
    element count is ``out``'s, else ``numel``, else two a byte (pass
    ``numel`` for an odd count).

    >>> q, s = quantize_int4(torch.tensor([1.0, -2.0, 0.5]))
    >>> dequantize_int4(q, s, numel=3)
    tensor([ 0.8571, -2.0000,  0.5714])
    """
    dtype = out.dtype if out is not None else dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dequantize_int4 makes fp32, bf16 or fp16; got {dtype}")
    n = out.numel() if out is not None else (2 * q.numel() if numel is None else numel)
    if q.dtype != torch.uint8 or q.numel() != int4_bytes(n):
        raise ValueError(
            f"{n} int4 elements are {int4_bytes(n)} packed uint8 bytes; got q {q.dtype} x "
            f"{q.numel()}" + (f" (out has {n} elements)" if out is not None else "")
        )
    if scales.numel() != scale_count(n) or scales.dtype != torch.float32:
        raise ValueError(
            f"{n} quantized elements have {scale_count(n)} fp32 scales; got {scales.dtype} x "
            f"{scales.numel()}"
        )
    out = torch.empty(n, dtype=dtype, device=q.device) if out is None else out
    if q.device.type == "cpu" and n and out.is_contiguous() and (lib := _native()) is not None:
        q, scales = q.contiguous(), scales.contiguous()
        _call(lib, "dequantize_int4", q.data_ptr(), scales.data_ptr(), n,
              BLOCK, out.data_ptr(), _DTYPES[dtype])  # fmt: skip
        return out
    made = dequantize_int4_reference(q, scales.reshape(-1), n, dtype)
    out.view(-1).copy_(made) if out.is_contiguous() else out.copy_(made.view(out.shape))
    return out
