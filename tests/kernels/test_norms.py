"""add_norm (Triton) against add_norm_ref: residual add + LayerNorm / RMSNorm."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import quantize_per_token
from kernels.norms import add_norm, add_norm_for, add_norm_ref
from kernels.splits import SplitKPartials


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


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize(
    ("hidden", "dtype"), [(96, torch.float32), (768, torch.float16), (768, torch.bfloat16)]
)
def test_add_norm_quantizes_its_output_as_the_quantizer_would(rms, hidden, dtype, rng, device):
    """fp8_out: the norm quantized per token in the same launch, bit for bit what the
    quantizer's launch makes of the norm the kernel would otherwise store; the sum is
    the same."""
    x, residual = (4 * torch.randn(2, 5, hidden, generator=rng)).to(dtype).to(device)
    residual[2] = -x[2]  # a zero sum: RMSNorm's row of zeros takes the smallest scale
    weight = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype).to(device)
    bias = None if rms else (0.1 * torch.randn(hidden, generator=rng)).to(dtype).to(device)
    out, total = add_norm(x, residual, weight, bias, 1e-5, rms)
    rows, total_fp8 = add_norm(x, residual, weight, bias, 1e-5, rms, fp8_out=True)
    q, scale = quantize_per_token(out)
    assert rows.dtype == dtype and torch.equal(total_fp8, total)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.scale, scale)


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


@pytest.mark.parametrize("fp8_out", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_add_norm_sums_a_projections_splits(rms, fp8_out, rng, device):
    """x as a split-K projection's three unsummed splits (SplitKPartials): summed in split
    order and rounded to the model dtype, as the projection's own launch would store
    them, then added and normalized: the same sum and norm as from that output.
    (fp16: the interpreter rounds to bf16 by truncation.)"""
    hidden, dtype = 96, torch.float16
    parts = torch.randn(3, 5, hidden, generator=rng).to(device)
    x = SplitKPartials(parts, dtype)
    residual = torch.randn(5, hidden, generator=rng).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype).to(device)
    bias = None if rms else (0.1 * torch.randn(hidden, generator=rng)).to(dtype).to(device)
    output = (parts[0] + parts[1] + parts[2]).to(dtype)
    want, want_sum = add_norm(output, residual, weight, bias, 1e-5, rms, fp8_out)
    got, got_sum = add_norm(x, residual, weight, bias, 1e-5, rms, fp8_out)
    assert got_sum.dtype == dtype and torch.equal(got_sum, want_sum)
    if fp8_out:
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    else:
        assert torch.equal(got, want)
    _, ref_sum = add_norm_ref(x, residual, weight, bias, 1e-5, rms)
    torch.testing.assert_close(ref_sum, want_sum, atol=2e-3, rtol=2e-3)
