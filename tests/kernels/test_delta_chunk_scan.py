"""The chunked delta rule's scan over chunks (kernels/delta_chunk_scan.py) against its
torch loop: every chunk's output and the final state."""

from __future__ import annotations

import pytest
import torch

from kernels.delta_chunk_scan import delta_chunk_scan, delta_chunk_scan_ref


@pytest.mark.parametrize(
    "chunk, k_dim, v_dim",
    [(16, 16, 32), (32, 32, 64), (16, 32, 16), (64, 128, 128)],  # the last: Qwen 3.5's
)
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_scan_matches_the_loop(chunk, k_dim, v_dim, precision, device, rng):
    """Terms as the rule makes them: unit keys, decays in (0, 1], so the state stays O(1)."""
    n, chunks = 3, 4

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(device)

    def unit(*shape):
        x = torch.randn(*shape, generator=rng)
        return (x / x.norm(dim=-1, keepdim=True)).to(device)

    writes, reads = randn(n, chunks, chunk, v_dim), unit(n, chunks, chunk, k_dim) * 0.5
    q_decayed, k_to_end = unit(n, chunks, chunk, k_dim), unit(n, chunks, chunk, k_dim)
    scores = randn(n, chunks, chunk, chunk, scale=chunk**-0.5).tril()
    chunk_decay = torch.rand(n, chunks, generator=rng).to(device)
    state = randn(n, k_dim, v_dim)
    args = (writes, reads, q_decayed, scores, k_to_end, chunk_decay)
    want, want_state = delta_chunk_scan_ref(*args, state)
    before = state.clone()
    got, got_state = delta_chunk_scan(*args, state, precision)
    # tf32 products keep 10 of fp32's 23 mantissa bits (the interpreter's dots stay fp32).
    tol = 1e-4 if precision == "ieee" else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_state, want_state, rtol=tol, atol=tol)
    assert torch.equal(state, before)  # the state passed in is left as it was
