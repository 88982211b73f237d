"""CUDA kernels for GPU ranks, compiled by NVRTC through CuPy on first use
and cached (by CuPy, on disk, per source): fused AdamW and Lion steps over
torch CUDA tensors — fp32 params, or fp32 master weights with their bf16 /
fp16 params written in the same pass — and int8 blockwise quantization for
compressed communication. Each has a pure-torch reference here
(``*_reference``) that the GPU tests compare it with.

The sources are rendered from templates per dtype (:func:`render`), which
needs neither CuPy nor a GPU; compiling and launching does. Tensors are
handed to CuPy by ``__cuda_array_interface__`` (no copy, no CuPy memory
pool) and the kernels run on torch's current stream.

>>> "sx_adamw_bf16_grad_bf16_shadow" in render("adamw", grad="bf16", shadow="bf16")
True
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "QUANT_BLOCK",
    "adamw_",
    "dequantize_int8",
    "dequantize_int8_reference",
    "kernel_name",
    "lion_",
    "quantize_int8",
    "quantize_int8_reference",
    "render",
]

QUANT_BLOCK = 256  # elements per int8 block (one fp32 scale each)

_CTYPES = {"fp32": "float", "bf16": "__nv_bfloat16", "fp16": "__half"}
_TO_FLOAT = {"fp32": "{}", "bf16": "__bfloat162float({})", "fp16": "__half2float({})"}
_FROM_FLOAT = {"bf16": "__float2bfloat16({})", "fp16": "__float2half({})"}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define SX_FOR_EACH(i, n) \\
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \\
       i += (long long)blockDim.x * gridDim.x)
"""

# AdamW as shardax.optim.adamw's reference orders it: moments in place,
# decoupled decay, the learning rate last; the param (fp32: the master
# copy) in place, and its low-precision shadow when there is one.
_ADAMW = """
extern "C" __global__ void NAME(float* p, const GRAD* g, float* m, float* v, SHADOW_ARG
                                long long n, float w1, float b2, float w2, float sbc2,
                                float eps, float inv_bc1, float wd, float neg_lr) {
  SX_FOR_EACH(i, n) {
    const float gi = LOAD_G;
    const float mi = m[i] + w1 * (gi - m[i]);
    const float vi = fmaf(w2 * gi, gi, v[i] * b2);
    const float d = sqrtf(vi) / sbc2 + eps;
    float u = (mi / d) * inv_bc1;
    if (wd != 0.0f) u = fmaf(wd, p[i], u);
    const float out = p[i] + u * neg_lr;
    m[i] = mi;
    v[i] = vi;
    p[i] = out;
    STORE_SHADOW
  }
}
"""

# Lion: the sign of the interpolation w1, then the momentum by w2.
_LION = """
extern "C" __global__ void NAME(float* p, const GRAD* g, float* m, SHADOW_ARG long long n,
                                float w1, float w2, float wd, float neg_lr) {
  SX_FOR_EACH(i, n) {
    const float gi = LOAD_G;
    const float c = m[i] + w1 * (gi - m[i]);
    float u = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);
    if (wd != 0.0f) u = fmaf(wd, p[i], u);
    const float out = p[i] + u * neg_lr;
    m[i] = m[i] + w2 * (gi - m[i]);
    p[i] = out;
    STORE_SHADOW
  }
}
"""

# One block of QUANT elements per thread block: the block's absolute maximum
# by a shared-memory reduction, scale = max / 127, q = round(x / scale).
_QUANT = """
extern "C" __global__ void NAME(const SRC* x, signed char* q, float* scales, long long n) {
  __shared__ float peak[QUANT];
  const long long base = (long long)blockIdx.x * QUANT;
  const int t = threadIdx.x;
  const float xi = base + t < n ? LOAD_X : 0.0f;
  peak[t] = fabsf(xi);
  __syncthreads();
  for (int s = QUANT / 2; s > 0; s >>= 1) {
    if (t < s) peak[t] = fmaxf(peak[t], peak[t + s]);
    __syncthreads();
  }
  const float scale = peak[0] / 127.0f;
  if (t == 0) scales[blockIdx.x] = scale;
  if (base + t < n) {
    const float r = scale > 0.0f ? rintf(xi / scale) : 0.0f;
    q[base + t] = (signed char)fminf(fmaxf(r, -127.0f), 127.0f);
  }
}
"""

_DEQUANT = """
extern "C" __global__ void NAME(const signed char* q, const float* scales, DST* x, long long n) {
  SX_FOR_EACH(i, n) {
    const float value = (float)q[i] * scales[i / QUANT];
    x[i] = STORE_X;
  }
}
"""

_TEMPLATES = {"adamw": _ADAMW, "lion": _LION, "quantize": _QUANT, "dequantize": _DEQUANT}


def kernel_name(kind: str, **types: str) -> str:
    """The kernel's name for ``kind`` and its dtypes (``grad``/``shadow`` for
    the steps, ``dtype`` for quantization)."""
    parts = [f"sx_{kind}"]
    for key in ("grad", "shadow", "dtype"):
        if key in types and types[key] is not None:
            parts.append(f"{types[key]}_{key}")
    return "_".join(parts)


def render(kind: str, *, grad: str = "fp32", shadow: str | None = None,
           dtype: str = "fp32") -> str:  # fmt: skip
    """The CUDA source of one kernel: ``kind`` one of adamw, lion, quantize,
    dequantize; ``grad`` the gradients' dtype and ``shadow`` the low-precision
    copy written beside fp32 master params (None: none), for the steps;
    ``dtype`` the quantized tensor's, for quantization. Dtypes: fp32, bf16,
    fp16 (a shadow: bf16 or fp16)."""
    if kind not in _TEMPLATES:
        raise ValueError(f"no CUDA kernel {kind!r}; choose one of {sorted(_TEMPLATES)}")
    for what, value, allowed in (
        ("grad", grad, _CTYPES),
        ("shadow", shadow, (None, *_FROM_FLOAT)),
        ("dtype", dtype, _CTYPES),
    ):
        if value not in allowed:
            raise ValueError(f"{kind}: {what} {value!r} is not one of {list(allowed)}")
    if kind in ("adamw", "lion"):
        name = kernel_name(kind, grad=grad, shadow=shadow)
        body = _TEMPLATES[kind].replace("GRAD", _CTYPES[grad])
        body = body.replace("LOAD_G", _TO_FLOAT[grad].format("g[i]"))
        if shadow is None:
            body = body.replace("SHADOW_ARG", "").replace("STORE_SHADOW", "")
        else:
            body = body.replace("SHADOW_ARG", f"{_CTYPES[shadow]}* shadow,")
            body = body.replace("STORE_SHADOW", f"shadow[i] = {_FROM_FLOAT[shadow].format('out')};")
    else:
        name = kernel_name(kind, dtype=dtype)
        body = _TEMPLATES[kind].replace("QUANT", str(QUANT_BLOCK))
        body = body.replace("SRC", _CTYPES[dtype]).replace("DST", _CTYPES[dtype])
        body = body.replace("LOAD_X", _TO_FLOAT[dtype].format("x[base + t]"))
        store = "value" if dtype == "fp32" else _FROM_FLOAT[dtype].format("value")
        body = body.replace("STORE_X", store)
    return _HEADER + body.replace("NAME", name)


# -- launching -----------------------------------------------------------------

_COMPILED: dict[tuple[str, str], Any] = {}


def _kernel(kind: str, **types: Any) -> Any:
    import cupy

    source = render(kind, **types)
    name = kernel_name(kind, **types)
    kernel = _COMPILED.get((name, source))
    if kernel is None:
        kernel = cupy.RawKernel(source, name, options=("--std=c++17",))
        _COMPILED[(name, source)] = kernel
    return kernel


def _cp(t: torch.Tensor) -> Any:
    """``t`` as a CuPy array over the same memory (no copy, no pool)."""
    import cupy

    if not (t.is_cuda and t.is_contiguous()):
        raise ValueError(f"the CUDA kernels take contiguous CUDA tensors; got {t.device} {t.shape}")
    if t.dtype == torch.bfloat16:  # CuPy has no bfloat16: the same bits as int16
        t = t.view(torch.int16)
    return cupy.asarray(t)


def _launch(kernel: Any, n: int, args: tuple, blocks: int | None = None) -> None:
    """Launch on torch's current stream: 256 threads a block, ``blocks`` of
    them (default: enough for ``n`` elements, capped; the kernels stride)."""
    import cupy

    threads = 256
    if blocks is None:
        blocks = max(1, min(math.ceil(n / threads), 65535 * 4))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        kernel((blocks,), (threads,), args)


def _check_step(p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
                shadow: torch.Tensor | None) -> None:  # fmt: skip
    if p.dtype != torch.float32 or any(s.dtype != torch.float32 for s in states):
        raise ValueError("the fused CUDA steps take fp32 params (or master weights) and state")
    if g.dtype not in _DTYPE_NAMES:
        raise ValueError(f"gradients must be fp32, bf16 or fp16; got {g.dtype}")
    for t in (g, *states, *([] if shadow is None else [shadow])):
        if t.numel() != p.numel():
            raise ValueError(
                f"every buffer must have the param's {p.numel()} elements; got {t.numel()}"
            )
    if shadow is not None and shadow.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"a shadow is bf16 or fp16; got {shadow.dtype}")


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
           lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
           weight_decay: float = 0.0, shadow: torch.Tensor | None = None) -> None:  # fmt: skip
    """One AdamW step in place on CUDA tensors (``step``: this step's number,
    from 1): fp32 ``p`` (or master weights), ``m``, ``v``; fp32/bf16/fp16
    ``g``; ``shadow`` (bf16/fp16) receives the new ``p`` rounded."""
    _check_step(p, g, [m, v], shadow)
    bc1, bc2 = 1.0 - b1**step, 1.0 - b2**step
    grad = _DTYPE_NAMES[g.dtype]
    kernel = _kernel(
        "adamw", grad=grad, shadow=None if shadow is None else _DTYPE_NAMES[shadow.dtype]
    )
    import numpy as np

    f = np.float32
    head = (_cp(p), _cp(g), _cp(m), _cp(v)) + (() if shadow is None else (_cp(shadow),))
    scalars = (np.int64(p.numel()), f(1 - b1), f(b2), f(1 - b2), f(bc2**0.5), f(eps),
               f(1 / bc1), f(weight_decay), f(-lr))  # fmt: skip
    _launch(kernel, p.numel(), head + scalars)


def lion_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, *, lr: float, b1: float = 0.9,
          b2: float = 0.99, weight_decay: float = 0.0,
          shadow: torch.Tensor | None = None) -> None:  # fmt: skip
    """One Lion step in place on CUDA tensors, as :func:`adamw_`."""
    _check_step(p, g, [m], shadow)
    grad = _DTYPE_NAMES[g.dtype]
    kernel = _kernel(
        "lion", grad=grad, shadow=None if shadow is None else _DTYPE_NAMES[shadow.dtype]
    )
    import numpy as np

    f = np.float32
    head = (_cp(p), _cp(g), _cp(m)) + (() if shadow is None else (_cp(shadow),))
    scalars = (np.int64(p.numel()), f(1 - b1), f(1 - b2), f(weight_decay), f(-lr))
    _launch(kernel, p.numel(), head + scalars)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: ``x`` (fp32/bf16/fp16, CUDA) as int8 in blocks of
    :data:`QUANT_BLOCK` elements, each with its fp32 scale (its absolute
    maximum / 127); as :func:`quantize_int8_reference`."""
    if x.dtype not in _DTYPE_NAMES:
        raise ValueError(f"quantize_int8 takes fp32, bf16 or fp16; got {x.dtype}")
    n = x.numel()
    blocks = max(1, math.ceil(n / QUANT_BLOCK))
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    import numpy as np

    kernel = _kernel("quantize", dtype=_DTYPE_NAMES[x.dtype])  # one block of threads per block
    _launch(kernel, n, (_cp(x.reshape(-1)), _cp(q), _cp(scales), np.int64(n)), blocks=blocks)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize_int8` (``q * scale`` per block), in ``dtype``."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dequantize_int8 makes fp32, bf16 or fp16; got {dtype}")
    x = torch.empty(q.numel(), dtype=dtype, device=q.device)
    import numpy as np

    kernel = _kernel("dequantize", dtype=_DTYPE_NAMES[dtype])
    _launch(kernel, q.numel(), (_cp(q), _cp(scales), _cp(x), np.int64(q.numel())))
    return x


# -- references ------------------------------------------------------------------


def quantize_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8` in torch, on any device.

    >>> q, s = quantize_int8_reference(torch.tensor([1.0, -2.0, 0.5]))
    >>> q.tolist(), round(s.item() * 127, 6)
    ([64, -127, 32], 2.0)
    """
    flat = x.reshape(-1).float()
    n = flat.numel()
    blocks = max(1, math.ceil(n / QUANT_BLOCK))
    padded = torch.zeros(blocks * QUANT_BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    rows = padded.view(blocks, QUANT_BLOCK)
    peak = rows.abs().amax(dim=1)
    # A true division, as the kernel's: on CUDA, dividing by a Python number
    # multiplies by its rounded reciprocal (1 ulp off for ~5 % of values).
    scales = peak / torch.full_like(peak, 127.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.where(scales[:, None] > 0, torch.round(rows / safe[:, None]), torch.zeros_like(rows))
    return q.clamp(-127, 127).to(torch.int8).reshape(-1)[:n], scales


def dequantize_int8_reference(q: torch.Tensor, scales: torch.Tensor,
                              dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """:func:`dequantize_int8` in torch, on any device.

    >>> q, s = quantize_int8_reference(torch.tensor([1.0, -2.0, 0.5]))
    >>> dequantize_int8_reference(q, s, torch.float32)
    tensor([ 1.0079, -2.0000,  0.5039])
    """
    index = torch.arange(q.numel(), device=q.device) // QUANT_BLOCK
    return (q.float() * scales[index]).to(dtype)
