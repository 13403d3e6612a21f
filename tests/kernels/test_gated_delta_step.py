"""The gated delta rule's decode step (kernels/gated_delta.py) against its reference:
outputs, and every slot's state after it (the rows' written in place, the rest as they
were), including a row that starts from zeros."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta import gated_delta_step, gated_delta_step_ref


@pytest.mark.parametrize(
    "num_k_heads, num_v_heads, k_dim, v_dim",
    [(2, 4, 16, 8), (2, 6, 32, 64), (1, 1, 16, 16)],  # grouped value heads; split value dims
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_matches_reference(num_k_heads, num_v_heads, k_dim, v_dim, dtype, device, rng):
    rows, slots_total = 5, 9
    channels = 2 * num_k_heads * k_dim + num_v_heads * v_dim

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(device)

    conved = randn(rows, channels).to(dtype)
    a, b = randn(rows, num_v_heads).to(dtype), randn(rows, num_v_heads).to(dtype)
    a_log, dt_bias = randn(num_v_heads, scale=0.5), randn(num_v_heads).to(dtype)
    a[0, 0], a_log[0] = 30.0, -6.0  # softplus's linear branch, at a decay still short of 0
    state = randn(slots_total, num_v_heads, k_dim, v_dim)
    slots = torch.tensor([7, 2, 0, 5, 8], device=device)
    has_state = torch.tensor([True, False, True, True, True], device=device)
    want_state = state.clone()
    args = (a, b, a_log, dt_bias)
    want = gated_delta_step_ref(conved, *args, want_state, slots, has_state, num_k_heads)
    got = gated_delta_step(conved, *args, state, slots, has_state, num_k_heads)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(state[untouched], want_state[untouched])
