"""The CUDA kernels' CPU half: every source renders (and parses as C++
against a tiny shim of the CUDA built-ins, where a compiler is present), bad
dtypes are refused by name, and the int8 quantization reference keeps its
error within half a step of each block's scale. The kernels themselves run
in tests/gpu against these references."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardax.kernels import cuda

STEPS = [(k, g, s) for k in ("adamw", "lion") for g in ("fp32", "bf16", "fp16")
         for s in (None, "bf16", "fp16")]  # fmt: skip
QUANT = [(k, d) for k in ("quantize", "dequantize") for d in ("fp32", "bf16", "fp16")]

# Enough of CUDA for a host C++ compiler to parse the kernels' sources.
SHIM = """
#include <math.h>
struct Dim { unsigned x; };
static Dim blockIdx, blockDim, threadIdx, gridDim;
struct __nv_bfloat16 { unsigned short x; };
struct __half { unsigned short x; };
inline float __bfloat162float(__nv_bfloat16) { return 0; }
inline __nv_bfloat16 __float2bfloat16(float) { return {}; }
inline float __half2float(__half) { return 0; }
inline __half __float2half(float) { return {}; }
inline void __syncthreads() {}
#define __global__
#define __shared__ static
"""


def _sources() -> list[tuple[str, str]]:
    out = [(cuda.kernel_name(k, grad=g, shadow=s), cuda.render(k, grad=g, shadow=s))
           for k, g, s in STEPS]  # fmt: skip
    out += [(cuda.kernel_name(k, dtype=d), cuda.render(k, dtype=d)) for k, d in QUANT]
    return out


def test_every_kernel_renders_with_its_own_name():
    sources = _sources()
    assert len({name for name, _ in sources}) == len(STEPS) + len(QUANT)
    for name, src in sources:
        assert f'extern "C" __global__ void {name}(' in src
        assert "GRAD" not in src and "SHADOW" not in src and "LOAD_" not in src, name
    assert "shadow[i] = __float2half(out);" in cuda.render("adamw", grad="bf16", shadow="fp16")
    assert "__bfloat162float(g[i])" in cuda.render("lion", grad="bf16")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
def test_every_source_parses_as_cpp(tmp_path):
    for name, src in _sources():
        text = SHIM + src.replace("#include <cuda_bf16.h>", "").replace(
            "#include <cuda_fp16.h>", ""
        )
        path = tmp_path / f"{name}.cpp"
        path.write_text(text)
        done = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", "-w", str(path)],
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, f"{name}:\n{done.stderr}"


def test_bad_kinds_and_dtypes_are_named():
    with pytest.raises(ValueError, match="no CUDA kernel 'sgd'"):
        cuda.render("sgd")
    with pytest.raises(ValueError, match="adamw: grad 'fp8' is not one of"):
        cuda.render("adamw", grad="fp8")
    with pytest.raises(ValueError, match="adamw: shadow 'fp32' is not one of"):
        cuda.render("adamw", shadow="fp32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_int8_reference_stays_within_half_a_step(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3 * cuda.QUANT_BLOCK + 17, generator=g) * 5).to(dtype)
    x[: cuda.QUANT_BLOCK] = 0  # an all-zero block: scale 0, exact zeros back
    q, scales = cuda.quantize_int8_reference(x)
    assert q.dtype == torch.int8 and scales.shape == (4,) and scales[0] == 0
    back = cuda.dequantize_int8_reference(q, scales, torch.float32)
    step = scales[torch.arange(x.numel()) // cuda.QUANT_BLOCK]
    assert torch.all((back - x.float()).abs() <= step / 2 + 1e-6)
    assert torch.equal(back[: cuda.QUANT_BLOCK], torch.zeros(cuda.QUANT_BLOCK))
    assert int(q.abs().max()) == 127  # each block's largest maps to ±127


def test_the_gpu_optim_benchmark_smoke(tmp_path):
    """``benchmarks/optim.py --device cuda``: on a GPU it times the kernel;
    here it says why it skipped — either way it runs and writes its JSON."""
    out = tmp_path / "cuda.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/optim.py", "--device", "cuda", "--smoke", "--json", str(out)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    if torch.cuda.is_available() and "skipped" not in result:
        assert {"shardax_cuda_adamw", "torch_fused", "copy"} <= set(result["results"])
    else:
        assert result["skipped"]
