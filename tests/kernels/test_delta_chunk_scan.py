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
def test_scan_matches_the_loop(chunk, k_dim, v_dim, device, rng):
    n, chunks = 3, 4

    def randn(*shape):
        return torch.randn(*shape, generator=rng).to(device)

    writes, reads = randn(n, chunks, chunk, v_dim), randn(n, chunks, chunk, k_dim) * 0.1
    q_decayed, k_to_end = randn(n, chunks, chunk, k_dim) * 0.1, randn(n, chunks, chunk, k_dim)
    scores = randn(n, chunks, chunk, chunk).tril() * 0.1
    chunk_decay = torch.rand(n, chunks, generator=rng).to(device)
    state = randn(n, k_dim, v_dim)
    args = (writes, reads, q_decayed, scores, k_to_end, chunk_decay)
    want, want_state = delta_chunk_scan_ref(*args, state)
    before = state.clone()
    got, got_state = delta_chunk_scan(*args, state)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(state, before)  # the state passed in is left as it was
