"""Native kernels, each with a pure-torch reference used automatically when
the native one is unavailable.

Built on first use by the system C++ compiler into a per-version cache
(``SHARDAX_KERNEL_CACHE``; ``SHARDAX_NO_NATIVE=1`` turns them off); a
missing compiler is one warning and the pure-torch paths, never an import
error. ``shardax report`` lists each library's status.

- ``shm``: the shared-memory collective backend's core — every collective
  in one call, pipelined in cache-sized chunks through per-member rings with
  counters (reductions of fp32/fp64/fp16/bf16/int32/int64).
- ``optim``: fused optimizer steps — AdamW, Lion, Adagrad and RMSprop in one
  pass over gradient, state and parameter (writing the update, or the new
  param and its bf16/fp16 copy), every leaf of a step in one call — used by
  :mod:`shardax.optim` for fp32 CPU state (:func:`shardax.optim.fused_step`).
- ``quant``: blockwise int8 and int4 quantization (:func:`quantize_int8`,
  :func:`dequantize_int8`, :func:`quantize_int4`, :func:`dequantize_int4`;
  one fp32 scale per 256 elements), as ZeRO++ sends parameters (int8,
  ``rules.zero(3, quantize_weights=True)``) and gradients (int4,
  :func:`shardax.collectives.quantized_psum_scatter`).
- :mod:`shardax.kernels.cuda`: CUDA kernels compiled by NVRTC through CuPy
  (``pip install 'shardax[gpu]'``) on first use — fused AdamW and Lion steps
  (fp32, or fp32 master weights with their bf16/fp16 params in one pass) and
  int8 blockwise quantization, each with a torch reference. Rendering the
  sources needs neither CuPy nor a GPU.
"""

from ._build import NativeLibrary as NativeLibrary
from ._build import cache_dir as cache_dir
from ._build import find_compiler as find_compiler
from ._build import registry as registry
from ._libraries import OPTIM as OPTIM
from ._libraries import SHM as SHM
from ._quant import QUANT as QUANT
from ._quant import dequantize_int4 as dequantize_int4
from ._quant import dequantize_int8 as dequantize_int8
from ._quant import quantize_int4 as quantize_int4
from ._quant import quantize_int8 as quantize_int8

__all__ = [
    "OPTIM",
    "QUANT",
    "SHM",
    "dequantize_int4",
    "dequantize_int8",
    "quantize_int4",
    "quantize_int8",
    "NativeLibrary",
    "cache_dir",
    "find_compiler",
    "registry",
]
