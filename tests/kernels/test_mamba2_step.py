"""Mamba-2's decode step and prompt walk (kernels/mamba2_step.py) against their
references: outputs, and every slot's state after them (the rows' written in place, the
rest as they were), including a row that starts from zeros; groups of heads sharing B
and C; dt clamped; the walk's reference against the engine's chunked form."""

from __future__ import annotations

import pytest
import torch

from kernels.mamba2_step import mamba2_step, mamba2_step_ref, mamba2_tokens, mamba2_tokens_ref
from tests.kernels.walked_sequences import WalkedSequences


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


@pytest.mark.parametrize("seqs", [3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_tokens_in_one_launch_match_reference(dtype, seqs, device, rng):
    """WalkedSequences' sequences and padding, with dt clamped: outputs at their tokens,
    every slot's state after (the padding's alone)."""
    heads, groups, d_state, head_dim, dt_limit = 4, 2, 16, 64, (0.0, 0.5)
    slots_total = 6
    walk = WalkedSequences.of(seqs, device)
    channels = heads * head_dim + 2 * groups * d_state

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(device)

    rows = randn(walk.tokens, channels + heads + 5).to(dtype)  # column slices, as projected
    conved, dt = rows[:, :channels], rows[:, channels : channels + heads]
    a_log, dt_bias, d = randn(heads, scale=0.5), randn(heads).to(dtype), randn(heads)
    state = randn(slots_total, heads, d_state, head_dim)
    want_state = state.clone()
    args = (walk.starts, walk.lengths, walk.slots, walk.has_state, dt_limit)
    want = mamba2_tokens_ref(conved, dt, a_log, dt_bias, d, want_state, *args)
    got = mamba2_tokens(conved, dt, a_log, dt_bias, d, state, *args)
    torch.testing.assert_close(got[: walk.real], want[: walk.real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(state[[1, 2, 5]], want_state[[1, 2, 5]])  # no real sequence's slots


def test_the_token_walk_equals_the_chunked_rule(rng):
    """The reference token by token against the engine's chunked form (Mamba-2's rule as
    the DeltaNet's without its delta term) over two chunks and a shorter prompt."""
    from engine.models.gated_delta import CHUNK, chunked_rule
    from kernels.mamba2_step import mamba2_inputs

    heads, groups, d_state, head_dim, dt_limit = 2, 1, 8, 4, (0.0, float("inf"))
    seqs, longest = 2, CHUNK + 9
    channels = heads * head_dim + 2 * groups * d_state
    conved = torch.randn(seqs, longest, channels, generator=rng)
    dt = torch.randn(seqs, longest, heads, generator=rng)
    a_log, dt_bias, d = (torch.randn(heads, generator=rng) * 0.5 for _ in range(3))
    state = torch.randn(3, heads, d_state, head_dim, generator=rng)
    slots, has_state = torch.tensor([2, 0]), torch.tensor([True, True])
    lengths = torch.tensor([longest, 20])
    walked_state = state.clone()
    starts = torch.tensor([0, longest])  # the padded rows laid end to end
    args = (a_log, dt_bias, d, walked_state, starts, lengths, slots, has_state, dt_limit)
    walked = mamba2_tokens_ref(conved.flatten(0, 1), dt.flatten(0, 1), *args)
    walked = walked.unflatten(0, (seqs, longest))
    x, b, c, step, log_decay = mamba2_inputs(conved, dt, a_log, dt_bias, d_state, dt_limit, groups)
    pad = (torch.arange(longest) >= lengths[:, None])[:, :, None]
    step, log_decay = step.masked_fill(pad, 0.0), log_decay.masked_fill(pad, 0.0)
    q, k, v = (t.transpose(1, 2) for t in (c, b, step[..., None] * x))
    o, final = chunked_rule(q, k, v, log_decay.transpose(1, 2), None, state[slots])
    o = o.transpose(1, 2) + d[:, None] * x
    for i, n in enumerate(lengths.tolist()):  # fp32 (mamba2_inputs' dtype)
        torch.testing.assert_close(walked[i, :n], o[i, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(walked_state[slots], final, rtol=1e-4, atol=1e-4)
