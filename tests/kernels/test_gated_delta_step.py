"""The gated delta rule's decode step and prompt walk (kernels/gated_delta.py) against
their references: outputs, and every slot's state after them (the rows' written in place,
the rest as they were), including a row that starts from zeros; the walk's reference
against the engine's chunked form."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta import (
    gated_delta_step,
    gated_delta_step_ref,
    gated_delta_tokens,
    gated_delta_tokens_ref,
)
from tests.kernels.walked_sequences import WalkedSequences


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


@pytest.mark.parametrize("seqs", [3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_tokens_in_one_launch_match_reference(dtype, seqs, device, rng):
    """WalkedSequences' sequences and padding: outputs at their tokens, and every slot's
    state after them (the padded sequence's left alone)."""
    num_k_heads, num_v_heads, k_dim, v_dim = 2, 4, 16, 64
    slots_total = 6
    walk = WalkedSequences.of(seqs, device)
    channels = 2 * num_k_heads * k_dim + num_v_heads * v_dim

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(device)

    # As the projection leaves them: column slices of its rows.
    rows = randn(walk.tokens, channels + 2 * num_v_heads + 3).to(dtype)
    conved, a, b = (
        rows[:, :channels],
        rows[:, channels : channels + num_v_heads],
        rows[:, -num_v_heads - 3 : -3],
    )
    a_log, dt_bias = randn(num_v_heads, scale=0.5), randn(num_v_heads).to(dtype)
    state = randn(slots_total, num_v_heads, k_dim, v_dim)
    want_state = state.clone()
    args = (walk.starts, walk.lengths, walk.slots, walk.has_state, num_k_heads)
    want = gated_delta_tokens_ref(conved, a, b, a_log, dt_bias, want_state, *args)
    got = gated_delta_tokens(conved, a, b, a_log, dt_bias, state, *args)
    torch.testing.assert_close(got[: walk.real], want[: walk.real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(state[[1, 2, 5]], want_state[[1, 2, 5]])  # no real sequence's slots


def test_the_token_walk_equals_the_chunked_rule(rng):
    """The reference token by token against the engine's chunked form over a prompt of
    two chunks and a shorter one padded beside it, from their slots' states."""
    from engine.models.gated_delta import CHUNK, chunked_rule
    from kernels.gated_delta import delta_rule_inputs

    num_k_heads, num_v_heads, k_dim, v_dim = 1, 2, 8, 8
    seqs, longest = 2, CHUNK + 9
    channels = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    f64 = dict(generator=rng, dtype=torch.float64)
    conved, a, b = (torch.randn(seqs, longest, n, **f64) for n in (channels, 2, 2))
    a_log, dt_bias = torch.randn(num_v_heads, **f64) * 0.5, torch.randn(num_v_heads, **f64)
    state = torch.randn(3, num_v_heads, k_dim, v_dim, **f64)
    slots, has_state = torch.tensor([2, 0]), torch.tensor([True, True])
    lengths = torch.tensor([longest, 20])
    walked_state = state.clone()
    starts = torch.tensor([0, longest])  # the padded rows laid end to end
    args = (a_log, dt_bias, walked_state, starts, lengths, slots, has_state, num_k_heads)
    flat = (t.flatten(0, 1) for t in (conved, a, b))
    walked = gated_delta_tokens_ref(*flat, *args).unflatten(0, (seqs, longest))
    inputs = delta_rule_inputs(conved.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1), a_log, dt_bias, num_k_heads, k_dim)  # fmt: skip
    q, k, v, g, beta = (t.unflatten(0, (seqs, longest)).transpose(1, 2) for t in inputs)
    pad = (torch.arange(longest) >= lengths[:, None])[:, None]
    g, beta = g.masked_fill(pad, 0.0), beta.masked_fill(pad, 0.0)
    o, final = chunked_rule(q, k, v, g, beta, state[slots])
    o = o.transpose(1, 2)
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(walked[i, :n], o[i, :n])
    torch.testing.assert_close(walked_state[slots], final)
