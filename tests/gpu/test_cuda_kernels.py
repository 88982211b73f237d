"""The CUDA kernels (shardax.kernels.cuda) against their references on the
GPU: AdamW and Lion against shardax.optim's transforms and torch's fused
AdamW, with fp32/bf16 gradients and bf16/fp16 shadows; int8 quantization bit
for bit against its torch reference."""

from __future__ import annotations

import pytest
import torch

import shardax as sx
from shardax.collectives._cupy_backend import cupy_available
from shardax.kernels import cuda

OK, WHY = cupy_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no CuPy here: {WHY}")
N = 1_000_003  # not a multiple of any block


def _reference(opt, p0, grads):
    params = {"w": p0.clone()}
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update({"w": g}, state, params)
        params = sx.optim.apply_updates(params, updates)
    return params["w"], state


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shadow_dtype", [None, torch.bfloat16, torch.float16])
def test_adamw_matches_the_reference_and_torch(grad_dtype, shadow_dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    p0 = torch.randn(N, device="cuda", generator=gen)
    grads = [torch.randn(N, device="cuda", generator=gen).to(grad_dtype) for _ in range(5)]
    p, m, v = p0.clone(), torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")
    shadow = None if shadow_dtype is None else torch.empty(N, dtype=shadow_dtype, device="cuda")
    for t, g in enumerate(grads, 1):
        cuda.adamw_(p, g, m, v, step=t, lr=1e-2, weight_decay=0.1, shadow=shadow)
    ref, state = _reference(sx.optim.adamw(1e-2, weight_decay=0.1), p0,
                            [g.float() for g in grads])  # fmt: skip
    torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, state[0].mu["w"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, state[0].nu["w"], rtol=1e-6, atol=1e-7)
    if shadow is not None:
        assert torch.equal(shadow, p.to(shadow_dtype))
    tp = torch.nn.Parameter(p0.clone())
    topt = torch.optim.AdamW([tp], lr=1e-2, weight_decay=0.1, fused=True)
    for g in grads:
        tp.grad = g.float()
        topt.step()
    torch.testing.assert_close(p, tp.detach(), rtol=1e-5, atol=1e-6)


def test_lion_matches_the_reference():
    gen = torch.Generator(device="cuda").manual_seed(1)
    p0 = torch.randn(N, device="cuda", generator=gen)
    grads = [torch.randn(N, device="cuda", generator=gen) for _ in range(5)]
    p, m = p0.clone(), torch.zeros(N, device="cuda")
    for g in grads:
        cuda.lion_(p, g, m, lr=1e-3, weight_decay=0.1)
    ref, state = _reference(sx.optim.lion(1e-3, weight_decay=0.1), p0, grads)
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, state[0].mu["w"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_quantization_matches_its_reference_bit_for_bit(dtype):
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(N, device="cuda", generator=gen) * 3).to(dtype)
    x[: cuda.QUANT_BLOCK] = 0
    q, scales = cuda.quantize_int8(x)
    rq, rscales = cuda.quantize_int8_reference(x)
    assert torch.equal(scales, rscales) and torch.equal(q, rq)
    back = cuda.dequantize_int8(q, scales, dtype)
    assert torch.equal(back, cuda.dequantize_int8_reference(rq, rscales, dtype))


def test_bad_buffers_are_refused():
    p = torch.zeros(10, device="cuda")
    with pytest.raises(ValueError, match="param's 10 elements; got 9"):
        cuda.adamw_(p, torch.zeros(9, device="cuda"), p.clone(), p.clone(), step=1, lr=0.1)
    with pytest.raises(ValueError, match="fp32 params"):
        cuda.lion_(p.half(), p.half(), p.clone(), lr=0.1)
