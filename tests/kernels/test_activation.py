"""act_and_mul (Triton) against act_and_mul_ref: SiLU and tanh-GELU gated MLP activations."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import FP8_ONE_TILE, act_and_mul, act_and_mul_for, act_and_mul_ref
from kernels.fp8 import quantize_per_token

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("inter", [128, 1500])  # one column block; two, the last partial
def test_act_and_mul_matches_reference(activation, inter, dtype, rng, device):
    x = (3 * torch.randn(7, 2 * inter, generator=rng)).to(dtype)
    want = act_and_mul_ref(x, activation)
    got = act_and_mul(x.to(device), activation)
    assert got.shape == (7, inter) and got.dtype == dtype and got.is_contiguous()
    # The activation's exp (and tanh) are not torch's to the last bit: rounded to the
    # dtype, an activation can land one ulp away, which the multiply by up carries.
    eps = torch.finfo(dtype).eps
    rtol = 1e-6 if dtype == torch.float32 else 2 * eps
    torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
# Rows in one tile (Llama-3-8B's 14,336 among them); past FP8_ONE_TILE, the quantizer after.
@pytest.mark.parametrize("inter", [128, 1500, 14336, FP8_ONE_TILE + 1])
def test_act_and_mul_quantizes_its_rows_as_the_quantizer_would(
    activation, inter, dtype, rng, device
):
    """fp8_out: each row quantized per token in the same launch, bit for bit what the
    quantizer's launch makes of the rows the kernel would otherwise store (on a GPU both
    divide by the scale the same approximate way, so the reference would differ)."""
    x = (3 * torch.randn(3, 2 * inter, generator=rng)).to(dtype).to(device)
    x[1, inter:] = 0  # a row of zeros: the smallest scale, every value 0
    rows = act_and_mul(x, activation, fp8_out=True)
    q, scale = quantize_per_token(act_and_mul(x, activation))
    assert rows.dtype == dtype and rows.q.shape == (3, inter)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.scale, scale)


def test_act_and_mul_reads_strided_rows(rng, device):
    wide = torch.randn(5, 3 * 64, generator=rng)
    x = wide[:, : 2 * 64]  # rows strided, columns contiguous
    got = act_and_mul(x.to(device), "silu")
    torch.testing.assert_close(got.cpu(), act_and_mul_ref(x, "silu"))


def test_act_and_mul_of_no_tokens(device):
    got = act_and_mul(torch.empty(0, 256, device=device), "silu")
    assert got.shape == (0, 128)


def test_act_and_mul_for_picks_reference_off_cuda():
    assert act_and_mul_for(torch.device("cpu")) is act_and_mul_ref
