"""Native kernels, each with a pure-torch reference (to come).

Fused optimizer steps (CPU C++/OpenMP; GPU via CuPy ``RawKernel``), a
shared-memory reduce for the CPU collective backend, flatten/pack and
quantize/dequantize for compressed communication; a builder with a cache and a
clean fallback when there is no compiler or GPU.
"""
