"""The recurrent layers' convolution step (kernels/conv_step.py) against its reference:
outputs, and every slot's window after it (the rows' moved on in place, the rest as
they were), including a row that starts from zeros; with and without a bias, and without
the SiLU (LFM2's short convolution)."""

from __future__ import annotations

import pytest
import torch

from kernels.conv_step import conv_step_at_slots, conv_step_at_slots_ref


@pytest.mark.parametrize(
    "channels, kernel, bias, silu",
    [(300, 4, True, True), (64, 4, False, True), (40, 2, True, True), (300, 3, True, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_matches_reference(channels, kernel, bias, silu, dtype, device, rng):
    rows, slots_total = 5, 9

    def randn(*shape):
        return torch.randn(*shape, generator=rng).to(device, dtype)

    x = randn(rows, channels + 8)[:, :channels]  # a slice of a wider projection's rows
    weight, b = randn(channels, kernel), randn(channels) if bias else None
    states = randn(slots_total, channels, kernel - 1)
    slots = torch.tensor([7, 2, 0, 5, 8], device=device)
    has_state = torch.tensor([True, False, True, True, True], device=device)
    want_states = states.clone()
    want = conv_step_at_slots_ref(x, want_states, slots, has_state, weight, b, silu)
    got = conv_step_at_slots(x, states, slots, has_state, weight, b, silu)
    assert silu or (want < 0).any()  # no SiLU: negative outputs stay
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(states, want_states)  # the windows move by copies: exact
