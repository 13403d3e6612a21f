"""The MoE's (token, expert) pairs grouped by expert for the grouped GEMMs
(kernels/fused_moe.py): each expert's run padded to a multiple of block_m, so every
block_m-row tile belongs to one expert.

In torch it is a stable argsort and about twenty small ops: a radix sort and some twenty
launches a layer, which at decode batch sizes cost more than the layer's GEMMs. One
program does it in one launch: it sorts the pairs by (expert, pair) in registers, finds
each expert's run in the sorted order, and writes each pair at its run's padded place
(the argsort's stable order: the same output as the torch version). Its work grows with
the pairs alone, not with pairs x experts; steps of more pairs than one program sorts
fast (prefill) keep the torch version, where the grouping is a small part of the layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl, wait_previous

# The one-program kernel sorts up to this many pairs (a step of 512 tokens at top-8):
# timed alone on an H200 it beat the torch version there (76 against 96 us) and lost
# from 6,144 (204 against 134); more, and the torch version groups them.
KERNEL_MAX_PAIRS = 4096


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows every expert's padded run takes in the worst case: a static shape."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


def align_by_expert_ref(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, k) pairs by expert, each expert's run padded to a multiple of block_m.

    Returns sorted_ids [max_padded] (flat pair index t * top_k + k; num_pairs = padding),
    expert_ids [max_padded // block_m] (the expert of each block_m-row tile) and
    num_padded [1] (rows in use). max_padded bounds the worst case, so every shape is
    static for a token count and nothing is read back to the host.
    """
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    device = flat.device
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync for its size
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)  # pair indices, grouped by expert
    sorted_experts = flat[order]
    run_start = counts.cumsum(0) - counts  # first pair of each expert in `order`
    rank = torch.arange(num_pairs, device=device) - run_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.int())
    tile_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, tile_starts, right=True)
    expert_ids = expert_ids.clamp(max=num_experts - 1).int()  # tiles past the end: unused
    return sorted_ids, expert_ids, padded_end[-1:].int()


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _align_kernel(
    ids_ptr,  # [num_pairs]: each pair's expert
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    max_padded,
    block_m,
    PAIRS_P2: tl.constexpr,  # num_pairs rounded up to a power of two (the sort's length)
    FILL: tl.constexpr,  # rows a step of the padding's stores takes
    PDL: tl.constexpr,
):
    # One program: the pairs' expert ids are a few KB, and every step needs all of them.
    wait_previous(PDL)
    offs = tl.arange(0, PAIRS_P2)
    real = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=real, other=num_experts).to(tl.int32)  # the rest last
    # Sorted by expert, then pair: the stable order. i's expert and pair, i in sorted order.
    keys = tl.sort(ids * PAIRS_P2 + offs)
    expert = keys // PAIRS_P2
    pair = keys % PAIRS_P2
    # Each sorted pair's neighbours' experts, through sorted_ids (overwritten below).
    tl.store(sorted_ids_ptr + offs, expert, mask=real)
    tl.debug_barrier()
    before = tl.load(sorted_ids_ptr + offs - 1, mask=real & (offs > 0), other=-1)
    after = tl.load(sorted_ids_ptr + offs + 1, mask=offs + 1 < num_pairs, other=num_experts)
    tl.debug_barrier()
    # A pair's rank in its expert's run; each run's last pair carries the run's padding,
    # and a pair's row is its sorted place plus the padding of the runs before it.
    run_start = tl.associative_scan(tl.where(expert != before, offs, 0), 0, _max)
    rank = offs - run_start
    pad = tl.where(real & (expert != after), (block_m - (rank + 1) % block_m) % block_m, 0)
    row = offs + tl.cumsum(pad, 0) - pad
    tl.store(num_padded_ptr, num_pairs + tl.sum(pad, 0))
    fill = tl.arange(0, FILL)
    for start in range(0, max_padded, FILL):  # every row padding first (value num_pairs)
        padding = tl.zeros([FILL], tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + start + fill, padding, mask=start + fill < max_padded)
    for start in range(0, max_padded // block_m, FILL):  # tiles past the runs: the last expert
        last = tl.zeros([FILL], tl.int32) + num_experts - 1
        tl.store(expert_ids_ptr + start + fill, last, mask=start + fill < max_padded // block_m)
    # The stores below overwrite some of those: a CTA barrier orders them.
    tl.debug_barrier()
    tl.store(sorted_ids_ptr + row, pair, mask=real)
    # Each tile's first row holds a pair of rank 0 mod block_m: it names the tile's expert.
    tl.store(expert_ids_ptr + row // block_m, expert, mask=real & (rank % block_m == 0))


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of `align_by_expert_ref` (the same three tensors, equal) in one
    launch, up to KERNEL_MAX_PAIRS pairs; the reference beyond."""
    num_pairs = topk_ids.numel()
    if num_pairs > KERNEL_MAX_PAIRS or num_pairs == 0:
        return align_by_expert_ref(topk_ids, num_experts, block_m)
    device = topk_ids.device
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    pdl = use_pdl(device)
    pairs_p2 = max(16, triton.next_power_of_2(num_pairs))
    _align_kernel[(1,)](
        topk_ids.contiguous().view(-1),
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        num_experts,
        max_padded,
        block_m,
        PAIRS_P2=pairs_p2,
        FILL=1024,
        PDL=pdl,
        num_warps=4 if pairs_p2 <= 1024 else 8,
        **launch_options(pdl),
    )
    return sorted_ids, expert_ids, num_padded
