"""The recurrent layers' convolution step (kernels/conv_step.py) against its reference:
outputs, and every slot's window after it (the rows' moved on in place, the rest as
they were), including a row that starts from zeros; with and without a bias, and without
the SiLU (LFM2's short convolution). Likewise the convolution over a step's tokens end to
end, its reference against the chunked form's (`causal_conv`)."""

from __future__ import annotations

import pytest
import torch

from kernels.conv_step import (
    conv_step_at_slots,
    conv_step_at_slots_ref,
    conv_tokens_at_slots,
    conv_tokens_at_slots_ref,
)


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


@pytest.mark.parametrize(
    "channels, kernel, bias, silu",
    [(300, 4, True, True), (64, 4, False, True), (40, 3, True, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_tokens_match_reference(channels, kernel, bias, silu, dtype, device, rng):
    """Sequences end to end: one longer than the window, two shorter (their new windows
    keep some stored rows, one from zeros), then a graph's padding: two tokens past them
    and a sequence of none at the spare slot, whose window stays as it was."""
    slots_total = 6

    def randn(*shape):
        return torch.randn(*shape, generator=rng).to(device, dtype)

    lengths = torch.tensor([6, 1, 2, 0], device=device, dtype=torch.int32)
    starts = (torch.cumsum(lengths, 0) - lengths).to(torch.int32)
    tokens = int(lengths.sum()) + 2
    token_seqs = torch.tensor([0] * 6 + [1] + [2] * 2 + [3] * 2, device=device)
    x = randn(tokens, channels + 8)[:, :channels]
    weight, b = randn(channels, kernel), randn(channels) if bias else None
    states = randn(slots_total, channels, kernel - 1)
    slots = torch.tensor([4, 0, 2, 5], device=device)
    has_state = torch.tensor([True, True, False, False], device=device)
    want_states = states.clone()
    args = (token_seqs, starts, lengths, slots, has_state, weight, b, silu)
    want = conv_tokens_at_slots_ref(x, want_states, *args)
    got = conv_tokens_at_slots(x, states, *args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[:9], want[:9], rtol=tol, atol=tol)
    # Rows copied: exact. The spare slot 5 too: its sequence of none writes no zeros.
    assert torch.equal(states, want_states)


def test_the_token_reference_equals_the_chunked_forms(rng):
    """conv_tokens_at_slots_ref against causal_conv (the chunked path's) on one sequence
    from its slot's window: outputs and the new window."""
    from engine.models.gated_delta import causal_conv

    channels, kernel, n = 12, 4, 7
    x = torch.randn(n, channels, generator=rng, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=rng, dtype=torch.float64)
    states = torch.randn(2, channels, kernel - 1, generator=rng, dtype=torch.float64)
    want, want_state = causal_conv(x[None], states[1:], weight, torch.tensor([n]))
    one = torch.tensor([0])
    args = (one, one, torch.tensor([n]), torch.tensor([1]), torch.tensor([True]), weight, None)
    got = conv_tokens_at_slots_ref(x, states, *args)
    torch.testing.assert_close(got, want[0])
    torch.testing.assert_close(states[1], want_state[0])
