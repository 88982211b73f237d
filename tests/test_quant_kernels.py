"""Blockwise int4 quantization (ZeRO++'s qgZ sends gradients so): the native
CPU kernels give the torch reference's bits for every input dtype, odd
counts and all-zero blocks; values are packed two a byte, low nibble first;
a value comes back within half its block's scale; misfit buffers are
errors. The int8 kernels keep the reference's bits beside them."""

from __future__ import annotations

import pytest
import torch

from shardax.kernels import QUANT, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from shardax.kernels._quant import (
    BLOCK,
    dequantize_int4_reference,
    int4_bytes,
    quantize_int4_reference,
    scale_count,
)
from shardax.kernels.cuda import dequantize_int8_reference, quantize_int8_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (1, 2, 3, 255, 256, 257, 511, 1001, 70_001)  # 70_001: the kernel's threaded path


def _input(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Blocks of different magnitudes, an all-zero block (when there are
    several), and exact ties: a block whose values over its scale are k + 1/2."""
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=g) * (1 + torch.arange(n) // BLOCK % 5) ** 2
    if n > 2 * BLOCK:
        x[BLOCK : 2 * BLOCK] = 0  # an all-zero block
    if n > 3 * BLOCK:  # scale 1 exactly (peak 7): x / scale lands on ties, rounded to even
        ties = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 6.5])
        x[2 * BLOCK : 3 * BLOCK] = ties.repeat(BLOCK // len(ties) + 1)[:BLOCK]
    return x.to(dtype)


def test_the_native_kernels_are_built():
    # otherwise the comparisons below would compare the reference with itself
    assert QUANT.load() is not None, QUANT.status()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_blocks_are_bit_for_bit_the_reference(dtype):
    for n in LENGTHS:
        x = _input(n, dtype)
        q, s = quantize_int4(x)
        q_ref, s_ref = quantize_int4_reference(x)
        assert q.dtype == torch.uint8 and q.numel() == int4_bytes(n) == (n + 1) // 2
        assert s.numel() == scale_count(n)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), (dtype, n)
        for out in DTYPES:
            back = dequantize_int4(q, s, out, numel=n)
            assert torch.equal(back, dequantize_int4_reference(q, s, n, out)), (dtype, n, out)


def test_int4_packs_two_values_a_byte_low_nibble_first_in_twos_complement():
    # peak 7: scale 1 exactly, so the codes are the values
    q, s = quantize_int4(torch.tensor([1.0, -1.0, 7.0, -7.0, 0.0]))
    assert s.tolist() == [1.0]
    assert [hex(b) for b in q.tolist()] == ["0xf1", "0x97", "0x0"]  # odd count: high nibble 0
    assert dequantize_int4(q, s, numel=5).tolist() == [1.0, -1.0, 7.0, -7.0, 0.0]
    # ties round to even, as torch.round does: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -3.5 -> -4
    q, _ = quantize_int4(torch.tensor([7.0, 0.5, 1.5, 2.5, -3.5, 6.5]))
    codes = [((b >> shift & 0xF) ^ 8) - 8 for b in q.tolist() for shift in (0, 4)]
    assert codes == [7, 0, 2, 2, -4, 6]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_round_trip_is_within_half_a_step(dtype):
    """``|x - q·s| <= s/2`` exactly for q = round(x / s); fp32 adds at most
    one rounding of x / s and one of q·s (|q| <= 7): 1e-6 of s covers both."""
    for n in (257, 1001, 70_001):
        x = _input(n, dtype, seed=1)
        q, s = quantize_int4(x)
        back = dequantize_int4(q, s, numel=n)
        step = s[torch.arange(n) // BLOCK]
        err = (back - x.float()).abs()
        assert bool((err <= step * (0.5 + 1e-6)).all()), (dtype, n, float((err / step).max()))
        assert bool((back[x == 0] == 0).all())  # the all-zero block (scale 0) comes back zero


def test_int4_writes_into_given_buffers_and_reads_any_layout():
    x = _input(1001, torch.float32)
    q, s = torch.empty(501, dtype=torch.uint8), torch.empty(4)
    assert quantize_int4(x, q, s) == (q, s)
    assert torch.equal(q, quantize_int4_reference(x)[0])
    y = x.view(7, 143).t()  # not contiguous: read flat as a torch reshape would
    assert torch.equal(quantize_int4(y)[0], quantize_int4_reference(y.reshape(-1))[0])
    out = torch.empty(1001, dtype=torch.bfloat16)
    assert dequantize_int4(q, s, out=out) is out  # the count is out's
    assert torch.equal(out, dequantize_int4_reference(q, s, 1001, torch.bfloat16))
    assert dequantize_int4(*quantize_int4(torch.ones(0))).numel() == 0


def test_int4_misfits_are_errors_naming_the_sizes():
    x = torch.ones(5)
    with pytest.raises(ValueError, match=r"takes fp32, bf16 or fp16; got torch\.int32"):
        quantize_int4(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="writes 3 uint8 and 1 fp32 scales"):
        quantize_int4(x, q=torch.empty(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="writes 3 uint8"):
        quantize_int4(x, q=torch.empty(3, dtype=torch.int8))
    q, s = quantize_int4(x)
    with pytest.raises(ValueError, match="4 int4 elements are 2 packed uint8 bytes; got"):
        dequantize_int4(q, s, numel=4)
    with pytest.raises(ValueError, match=r"have 1 fp32 scales; got torch\.float32 x 2"):
        dequantize_int4(q, torch.ones(2), numel=5)
    with pytest.raises(ValueError, match="makes fp32, bf16 or fp16"):
        dequantize_int4(q, s, torch.int32, numel=5)


def test_int8_blocks_still_match_their_reference():
    for dtype in DTYPES:
        x = _input(1001, dtype)
        q, s = quantize_int8(x)
        q_ref, s_ref = quantize_int8_reference(x)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
        assert torch.equal(dequantize_int8(q, s), dequantize_int8_reference(q, s, torch.float32))
