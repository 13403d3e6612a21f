"""The one-launch MoE routing against select_experts (its torch contract)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import select_experts
from kernels.moe_routing import select_experts_for, topk_softmax


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
