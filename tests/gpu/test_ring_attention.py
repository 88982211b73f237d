"""Ring attention's blocks on the GPU (one rank: the block computations and
their merge, which on CUDA run in plain matmuls) against PyTorch's SDPA:
values and gradients, causal or not, grouped-query heads, bf16 inside fp32
tolerance. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardax as sx

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention_blocks_on_cuda_match_sdpa(causal, kv_heads, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype, generator=g)
    k, v = torch.randn(2, 2, kv_heads, 256, 64, device="cuda", dtype=dtype, generator=g)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 8)
    grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    got = sx.ring_attention(q, k, v, mesh=sx.Mesh({"cp": 1}), is_causal=causal)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got, want, **tol)
    for mine, theirs in zip(
        torch.autograd.grad(got.float().square().sum(), (q, k, v)), grads, strict=True
    ):
        torch.testing.assert_close(mine, theirs, **tol)
