"""FP8 quantization and the FP8 linear: round-trip error bounds, the Triton per-token
quantizer against its reference (in the interpreter on CPU), the reference linear
against full-precision matmuls."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    fp8_linear_ref,
    quantize_per_channel,
    quantize_per_token,
    quantize_per_token_ref,
)

# e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of itself (normal
# range); a row's largest value maps to 448, so its scale is amax / 448 and the absolute
# error is at most 16 * scale = amax / 28 (the step is 32 in [256, 448]).
REL_STEP = 1 / 16


def test_per_channel_round_trip_within_half_a_step(rng: torch.Generator) -> None:
    # Rows of very different magnitudes, a zero row and an outlier column.
    w = torch.randn(48, 96, generator=rng) * torch.logspace(-4, 2, 48)[:, None]
    w[5] = 0
    w[:, 7] *= 30
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (48,) and scale.dtype == torch.float32
    back = dequantize_fp8(q, scale[:, None])
    amax = w.abs().amax(dim=1, keepdim=True)
    assert ((back - w).abs() <= amax / 28 + 1e-30).all()
    # Values in e4m3's normal range relative to the row: within 1/16 of themselves.
    normal = w.abs() >= amax * 2**-6 / FP8_MAX * 2**8
    assert ((back - w).abs() <= REL_STEP * w.abs())[normal].all()
    assert torch.equal(back[5], torch.zeros(96))  # a zero row stays zero, finite
    assert (q.float().abs().amax(dim=1)[amax[:, 0] > 0] == FP8_MAX).all()  # full range used


def test_per_token_round_trip(rng: torch.Generator) -> None:
    x = torch.randn(7, 256, generator=rng) * torch.tensor([1e-3, 1, 10, 0, 300, 1, 5])[:, None]
    q, scale = quantize_per_token_ref(x)
    assert scale.shape == (7, 1)
    back = dequantize_fp8(q, scale)
    assert ((back - x).abs() <= x.abs().amax(dim=1, keepdim=True) / 28).all()
    assert not back.isnan().any()


# Rows held whole, and one past ONE_TILE_K (the two-pass loop).
@pytest.mark.parametrize(("num_tokens", "k"), [(5, 300), (3, 64), (2, 4096 + 48), (2, 32768 + 48)])
def test_per_token_kernel_matches_reference(
    num_tokens: int, k: int, rng: torch.Generator, device: torch.device
) -> None:
    scales = torch.tensor([1e-3, 1.0, 0.0, 300.0, 7.0])[:num_tokens, None]
    x = torch.randn(num_tokens, k, generator=rng) * scales
    x[0, 1] = 1e-30  # a subnormal of e4m3 after scaling
    want_q, want_scale = quantize_per_token_ref(x)
    q, scale = quantize_per_token(x.to(device))
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=1e-6, atol=0)
    if device.type == "cpu":  # the interpreter: exactly the reference's bytes
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    else:  # the GPU's division may round differently by one step, rarely
        mismatch = (q.cpu().float() != want_q.float()).float().mean()
        assert mismatch < 1e-3
        torch.testing.assert_close(q.cpu().float(), want_q.float(), rtol=REL_STEP, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_reference_close_to_full_precision(
    dtype: torch.dtype, rng: torch.Generator
) -> None:
    """Per-token x per-channel FP8 on Gaussian data: each operand's rounding error is
    ~2.5% RMS of its value, so the output's relative error is ~3.5% (sqrt(2) x 2.5%),
    whatever K: far below the worst case of 1/16 + 1/16 per product."""
    m, k, n = 16, 512, 96
    x = torch.randn(m, k, generator=rng).to(dtype)
    w = (torch.randn(n, k, generator=rng) * 0.02).to(dtype)
    bias = torch.randn(n, generator=rng).to(dtype)
    q, scale = quantize_per_channel(w)
    out = fp8_linear_ref(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    exact = x.float() @ w.float().t() + bias.float()
    err = (out.float() - exact).norm() / (exact - bias.float()).norm()
    assert err < 0.045
    # Against the dequantized weight the only error left is the activations' rounding.
    deq = x.float() @ dequantize_fp8(q, scale[:, None]).t() + bias.float()
    assert (out.float() - deq).norm() / (deq - bias.float()).norm() < 0.032
