"""MoE routing in one launch: softmax over each token's router logits, its top-k experts,
and (renormalize) their probabilities divided by their sum, times a scale.

`select_experts` (kernels/fused_moe.py) is the contract; in torch it is four or five
small launches (cast, softmax, topk, sum, divide) per MoE layer, which at decode batch
sizes cost more than the arithmetic. One program per token holds the token's logits
(up to a few hundred experts) and picks the top k by repeated argmax, the lower
expert first on a tie. DeepSeek-V2's routing (`limited_topk`) is the same kernel with
its scale and, for `group_limited_greedy`, the experts outside the token's best groups
zeroed before the picks.
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
    scale,  # on the chosen weights, after renormalizing
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,  # TOP_K rounded up to a power of two (tl.arange's lengths)
    RENORMALIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,  # > 1: experts in NUM_GROUPS equal runs, of which only
    TOPK_GROUPS: tl.constexpr,  # the TOPK_GROUPS with the best expert are picked from
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
    if NUM_GROUPS > 1:
        group = experts // (num_experts // NUM_GROUPS)
        best = tl.full([BLOCK_E], -5.0, tl.float32)  # each expert's group's best
        for g in tl.static_range(NUM_GROUPS):
            best = tl.where(group == g, tl.max(tl.where(group == g, left, -5.0), 0), best)
        kept = experts < 0
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(tl.where(kept, -5.0, best), 0)
            top_group = tl.min(tl.where((best == top) & ~kept, group, NUM_GROUPS), 0)
            kept = kept | (group == top_group)
        # Zeroed, as limited_topk's masked_fill: still above NaN rows and padding.
        left = tl.where(kept | ~mask, left, 0.0)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        best_id = tl.min(tl.where(left == best, experts, BLOCK_E), 0)  # lowest on a tie
        chosen = tl.where(picks == k, best, chosen)
        chosen_ids = tl.where(picks == k, best_id.to(tl.int64), chosen_ids)
        left = tl.where(experts == best_id, -4.0, left)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, 0)
    chosen = chosen * scale
    tl.store(weights_ptr + token * TOP_K + picks, chosen, mask=picks < TOP_K)
    tl.store(ids_ptr + token * TOP_K + picks, chosen_ids, mask=picks < TOP_K)


def limited_topk(
    logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    num_groups: int,
    topk_groups: int,  # < num_groups: only the best groups' experts (by their best)
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] fp32, ids
    """DeepSeek-V2's routing, greedy (one group) or group-limited."""
    scores = logits.float().softmax(dim=-1)
    if topk_groups < num_groups:
        tokens, experts = scores.shape
        per_group = experts // num_groups
        best = scores.view(tokens, num_groups, per_group).max(dim=-1).values
        groups = best.topk(topk_groups, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
        scores = scores.masked_fill(~kept.repeat_interleave(per_group, dim=1), 0.0)
    weights, ids = scores.topk(top_k, dim=-1, sorted=False)
    return weights * scale, ids


def topk_softmax(
    router_logits: torch.Tensor,  # [num_tokens, num_experts], last dim contiguous
    top_k: int,
    renormalize: bool,
    scale: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] fp32, ids int64
    """Triton version of `select_experts` (the defaults) and of `limited_topk`
    (renormalize False), picking in order of weight."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1
    assert num_experts % num_groups == 0 and 1 <= topk_groups <= num_groups
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
        scale,
        TOP_K=top_k,
        TOP_K_P2=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        NUM_GROUPS=num_groups if topk_groups < num_groups else 1,
        TOPK_GROUPS=topk_groups,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=1 if num_experts <= 128 else 4,
    )
    return weights, ids


def select_experts_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The routing the engine uses on `device`: one Triton launch on CUDA, torch elsewhere."""
    return topk_softmax if device.type == "cuda" else select_experts


def limited_topk_triton(
    logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`limited_topk` in one launch, its arguments in its order."""
    return topk_softmax(logits, top_k, False, scale, num_groups, topk_groups)


def limited_topk_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """DeepSeek-V2's routing on `device`: the one launch on CUDA, torch elsewhere."""
    return limited_topk_triton if device.type == "cuda" else limited_topk
