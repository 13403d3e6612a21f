"""Mamba-2's decode step (kernels/mamba2_step.py) against its reference: outputs, and
every slot's state after it (the rows' written in place, the rest as they were),
including a row that starts from zeros; groups of heads sharing B and C; dt clamped."""

from __future__ import annotations

import pytest
import torch

from kernels.mamba2_step import mamba2_step, mamba2_step_ref


@pytest.mark.parametrize(
    "heads, groups, d_state, head_dim, dt_limit",
    [
        (4, 2, 16, 8, (0.0, float("inf"))),  # two heads a group
        (3, 1, 32, 64, (0.0, 0.5)),  # one group; head dims split; dt clamped above
        (2, 2, 16, 16, (0.2, float("inf"))),  # and below
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_matches_reference(heads, groups, d_state, head_dim, dt_limit, dtype, device, rng):
    rows, slots_total = 5, 9
    channels = heads * head_dim + 2 * groups * d_state

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(device)

    conved = randn(rows, channels).to(dtype)
    dt = randn(rows, heads).to(dtype)
    a_log, dt_bias, d = randn(heads, scale=0.5), randn(heads).to(dtype), randn(heads)
    dt[0, 0], a_log[0] = 30.0, -6.0  # softplus's linear branch, at a decay still short of 0
    state = randn(slots_total, heads, d_state, head_dim)
    slots = torch.tensor([7, 2, 0, 5, 8], device=device)
    has_state = torch.tensor([True, False, True, True, True], device=device)
    want_state = state.clone()
    args = (dt, a_log, dt_bias, d)
    want = mamba2_step_ref(conved, *args, want_state, slots, has_state, dt_limit)
    got = mamba2_step(conved, *args, state, slots, has_state, dt_limit)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(state[untouched], want_state[untouched])
