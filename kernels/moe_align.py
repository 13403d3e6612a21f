"""The MoE's (token, expert) pairs grouped by expert for the grouped GEMMs
(kernels/fused_moe.py): each expert's run padded to a multiple of block_m, so every
block_m-row tile belongs to one expert.

In torch it is a stable argsort and about twenty small ops: a radix sort and some twenty
launches a layer, which at decode batch sizes cost more than the layer's GEMMs. One
program does it in one launch: it counts the pairs per expert, lays out the padded runs,
and writes each pair at its expert's next row, in pair order (the argsort's stable order:
the same output as the torch version). Its work grows with pairs x experts, so larger
steps (prefill) keep the torch version, where the sort is a small part of the layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl, wait_previous

# The one-program kernel groups up to this many pairs x experts (padded to a power of
# two): 2,048 pairs of 64 experts, 1,024 of 128. Timed alone on an H200, it took 9-60 us
# there against the torch version's 44-92; at twice that it was slower.
KERNEL_MAX_VALUES = 1 << 17
# A chunk's one-hot [pairs, experts] tile holds about this many values.
CHUNK_VALUES = 8192
# Rows of padding one step of the fill stores: the padded rows run to thousands (every
# expert's run rounded up to a tile), and a chunk's few dozen a step left the fill as long
# as the grouping itself.
FILL_ROWS = 2048


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
def _align_kernel(
    ids_ptr,  # [num_pairs]: each pair's expert
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    max_padded,
    block_m,
    EXPERTS_P2: tl.constexpr,
    CHUNK: tl.constexpr,  # pairs (and tiles) a step of the one-hot loops takes
    FILL: tl.constexpr,  # rows a step of the padding's stores takes
    PDL: tl.constexpr,
):
    # One program: the pairs' expert ids are a few KB, and every step needs all of them.
    wait_previous(PDL)
    experts = tl.arange(0, EXPERTS_P2)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_P2], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # A tile's expert: how many experts' runs end at or before its first row (the
    # torch version's searchsorted), the tiles past the last run given the last expert.
    num_tiles = max_padded // block_m
    for start in range(0, num_tiles, CHUNK):
        tiles = start + offs
        ended = (padded_end[None, :] <= (tiles * block_m)[:, None]) & (experts < num_experts)
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(expert_ids_ptr + tiles, expert, mask=tiles < num_tiles)
    fill = tl.arange(0, FILL)
    for start in range(0, max_padded, FILL):  # every row padding first (value num_pairs)
        padding = tl.zeros([FILL], tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + start + fill, padding, mask=start + fill < max_padded)
    # The pairs' stores below may overwrite those rows: a CTA barrier orders them.
    tl.debug_barrier()
    next_row = padded_end - padded  # each expert's next free row
    for start in range(0, num_pairs, CHUNK):
        pairs = start + offs
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS_P2]
        # A pair's row: its expert's next row, plus the chunk's earlier pairs of its expert.
        rows = next_row[None, :] + tl.cumsum(hit, axis=0) - 1
        dest = tl.sum(tl.where(hit > 0, rows, 0), axis=1)
        tl.store(sorted_ids_ptr + dest, pairs, mask=pairs < num_pairs)
        next_row += tl.sum(hit, axis=0)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of `align_by_expert_ref` (the same three tensors, equal) in one
    launch, up to KERNEL_MAX_VALUES pairs x experts; the reference beyond."""
    num_pairs = topk_ids.numel()
    experts_p2 = triton.next_power_of_2(num_experts)
    if num_pairs * experts_p2 > KERNEL_MAX_VALUES or num_pairs == 0:
        return align_by_expert_ref(topk_ids, num_experts, block_m)
    device = topk_ids.device
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    pdl = use_pdl(device)
    _align_kernel[(1,)](
        topk_ids.contiguous().view(-1),
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        num_experts,
        max_padded,
        block_m,
        EXPERTS_P2=experts_p2,
        CHUNK=max(16, CHUNK_VALUES // experts_p2),
        FILL=FILL_ROWS,
        PDL=pdl,
        **launch_options(pdl),
    )
    return sorted_ids, expert_ids, num_padded
