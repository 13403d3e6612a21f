"""The one-launch MoE routing against select_experts and limited_topk (its torch contracts)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import select_experts
from kernels.moe_routing import (
    limited_topk,
    limited_topk_for,
    limited_topk_triton,
    select_experts_for,
    topk_softmax,
)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "renormalize"),
    [(8, 2, True), (128, 8, True), (128, 8, False), (32, 4, True), (60, 6, True), (6, 1, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_select_experts(num_experts, top_k, renormalize, dtype, rng, device):
    # Qwen3-MoE's 128/8, gpt-oss-20b's 32/4, Mixtral's 8/2, and shapes off powers of two.
    logits = (torch.randn(37, num_experts, generator=rng) * 2).to(dtype).to(device)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    want_weights, want_ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == want_ids.dtype and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_a_tie_goes_to_the_lower_expert(device):
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, -1.0]], device=device)
    weights, ids = topk_softmax(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 3, 2]]
    torch.testing.assert_close(weights, logits.softmax(-1)[:, [1, 3, 2]])


def test_routing_for_picks_reference_off_cuda():
    assert select_experts_for(torch.device("cpu")) is select_experts


def test_rows_of_nan_or_inf_still_pick_real_experts(device):
    # A CUDA graph's padding rows hold whatever the buffers held: their picks are
    # discarded, but an expert id past the last would break the MoE launch after.
    logits = torch.tensor(
        [[float("nan")] * 6, [float("inf")] * 6, [float("-inf")] * 6], device=device
    )
    _, ids = topk_softmax(logits, 4, renormalize=True)
    assert ids.min() >= 0 and ids.max() < 6
    assert all(len(set(row)) == 4 for row in ids.tolist())


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's picks sorted by expert id: limited_topk's topk leaves them unordered."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize(
    ("num_experts", "top_k", "num_groups", "topk_groups", "scale"),
    # DeepSeek-V2-Lite (greedy), V2 (160 experts, 8 groups of which 3), smaller groupings.
    [(64, 6, 1, 1, 1.0), (160, 6, 8, 3, 16.0), (16, 3, 4, 2, 1.5), (12, 4, 3, 1, 2.0)],
)
def test_matches_limited_topk(num_experts, top_k, num_groups, topk_groups, scale, rng, device):
    logits = (torch.randn(41, num_experts, generator=rng) * 2).to(device)
    weights, ids = limited_topk_triton(logits, top_k, num_groups, topk_groups, scale)
    want_weights, want_ids = by_expert(*limited_topk(logits, top_k, num_groups, topk_groups, scale))
    weights, ids = by_expert(weights, ids)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    if topk_groups < num_groups:  # the limit binds: some rows' global top-k leave its groups
        free = by_expert(*limited_topk(logits, top_k, 1, 1, scale))[1]
        assert not torch.equal(ids, free)


def test_limited_routing_for_picks_reference_off_cuda():
    assert limited_topk_for(torch.device("cpu")) is limited_topk
    assert limited_topk_for(torch.device("cuda")) is limited_topk_triton
