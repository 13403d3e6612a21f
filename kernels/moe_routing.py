"""MoE routing in one launch: softmax over each token's router logits, its top-k experts,
and (renormalize) their probabilities divided by their sum.

`select_experts` (kernels/fused_moe.py) is the contract; in torch it is four or five
small launches (cast, softmax, topk, sum, divide) per MoE layer, which at decode batch
sizes cost more than the arithmetic. One program per token holds the token's logits
(up to a few hundred experts) and picks the top k by repeated argmax, the lower
expert first on a tie.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.fused_moe import select_experts


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,  # [num_tokens, TOP_K] fp32
    ids_ptr,  # [num_tokens, TOP_K] int64
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,  # TOP_K rounded up to a power of two (tl.arange's lengths)
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    mask = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=mask, other=float("-inf"))
    logits = logits.to(tl.float32)
    e = tl.exp(logits - tl.max(logits, 0))
    probs = e / tl.sum(e, 0)
    picks = tl.arange(0, TOP_K_P2)
    chosen = tl.zeros([TOP_K_P2], tl.float32)
    chosen_ids = tl.zeros([TOP_K_P2], tl.int64)
    # NaN rows (a CUDA graph's padding rows hold garbage) rank as -1, padding experts
    # below that: every pick is a real expert.
    left = tl.where(mask, tl.where(probs == probs, probs, -1.0), -3.0)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        best_id = tl.min(tl.where(left == best, experts, BLOCK_E), 0)  # lowest on a tie
        chosen = tl.where(picks == k, best, chosen)
        chosen_ids = tl.where(picks == k, best_id.to(tl.int64), chosen_ids)
        left = tl.where(experts == best_id, -4.0, left)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, 0)
    tl.store(weights_ptr + token * TOP_K + picks, chosen, mask=picks < TOP_K)
    tl.store(ids_ptr + token * TOP_K + picks, chosen_ids, mask=picks < TOP_K)


def topk_softmax(
    router_logits: torch.Tensor,  # [num_tokens, num_experts], last dim contiguous
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] fp32, ids int64
    """Triton version of `select_experts`."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    _topk_softmax_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        TOP_K_P2=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=1 if num_experts <= 128 else 4,
    )
    return weights, ids


def select_experts_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The routing the engine uses on `device`: one Triton launch on CUDA, torch elsewhere."""
    return topk_softmax if device.type == "cuda" else select_experts
