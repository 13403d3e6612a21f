"""The recurrent layers' gated RMSNorm (kernels/gated_norm.py) against its reference, in
both orders: the DeltaNet's (one weight for every head) and Mamba-2's (by groups)."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_norm import gated_rms_norm, gated_rms_norm_ref


@pytest.mark.parametrize(
    "width, group, shared_weight, norm_first",
    [(48, 12, True, True), (96, 48, False, False), (100, 100, False, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_matches_reference(width, group, shared_weight, norm_first, dtype, device, rng):
    rows = 5

    def randn(*shape):
        return torch.randn(*shape, generator=rng).to(device, dtype)

    x = randn(rows, width)
    gate = randn(rows, width + 7)[:, 3 : 3 + width]  # a slice of a projection's rows
    weight = randn(group if shared_weight else width)
    want = gated_rms_norm_ref(x, gate, weight, 1e-6, group, norm_first)
    got = gated_rms_norm(x, gate, weight, 1e-6, group, norm_first)
    # bf16: the sums' order may move a rounding by one place (torch's default bf16 rtol).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
