"""add_norm (Triton) against add_norm_ref: residual add + LayerNorm / RMSNorm."""

from __future__ import annotations

import pytest
import torch

from kernels.norms import add_norm, add_norm_for, add_norm_ref


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(
    ("hidden", "dtype"), [(64, torch.float32), (96, torch.float32), (768, torch.float16)]
)
def test_add_norm_matches_reference(rms, with_residual, hidden, dtype, rng, device):
    num_tokens = 7
    x = torch.randn(num_tokens, hidden, generator=rng).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=rng).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype)
    bias = None if rms else (0.1 * torch.randn(hidden, generator=rng)).to(dtype)
    want, want_sum = add_norm_ref(x, residual, weight, bias, 1e-5, rms)

    on = [t if t is None else t.to(device) for t in (x, residual, weight, bias)]
    got, got_sum = add_norm(*on, 1e-5, rms)
    assert got.dtype == dtype and got_sum.dtype == dtype
    assert torch.equal(got_sum.cpu(), want_sum)  # the sum is rounded once, as `x + residual`
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


def test_add_norm_reads_strided_rows(rng, device):
    # The residual stream can be a row-strided view; each row must still be read in place.
    wide = torch.randn(5, 2, 64, generator=rng)
    x, residual = wide[:, 0], wide[:, 1]
    weight = torch.ones(64)
    want, _ = add_norm_ref(x, residual, weight, None, 1e-6, True)
    got, _ = add_norm(x.to(device), residual.to(device), weight.to(device), None, 1e-6, True)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_add_norm_for_picks_reference_off_cuda():
    assert add_norm_for(torch.device("cpu")) is add_norm_ref
