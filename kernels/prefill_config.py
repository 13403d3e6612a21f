"""The prefill kernel's launch: the config (tile, warps, stages, key splits), a function
of shapes only, so that a CUDA graph captured for a token bucket replays for any batch
that fits it (kernels/prefill_attention.py); and how a query tile finds its sequence,
which the MLA kernel's query tiles share (kernels/mla.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.decode_config import num_sms_of

MAX_SPLITS = 16  # a split's partials cost num_tokens x num_heads x head_dim floats


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and launch of the prefill kernel (a function of shapes only)."""

    block_m: int  # rows: queries x the query heads of one kv head (GQA packed)
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 1  # key splits per tile; > 1 merges them in a second kernel


def prefill_config(
    max_query_len: int,
    head_dim: int,
    group: int = 1,
    num_tokens: int = 0,
    num_kv_heads: int = 1,
    max_context: int = 0,
    device: torch.device | None = None,
    itemsize: int = 2,  # of the query and cache dtype
) -> PrefillConfig:
    """Default launch config; the numbers are measured (docs/kernels.md).

    A step of few query tiles (speculative verifies, a short chunk after a cached
    prefix) splits its keys as decode does, so that the grid fills the GPU however long
    the context: the split count follows from num_tokens (the fewest tiles a step of them
    has) and max_context, never from the step's actual lengths."""
    rows = min(max_query_len, 64) * group
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 64 if block_m > 16 or head_dim <= 64 else 32
    block_q = max(block_m // group, 1)
    num_splits = 1
    if num_tokens and device is not None:
        programs, num_sms = triton.cdiv(num_tokens, block_q) * num_kv_heads, num_sms_of(device)
        if programs < num_sms:  # less than a wave
            most = max(triton.cdiv(max_context, block_n), 1)
            num_splits = max(1, min(triton.cdiv(4 * num_sms, programs), most, MAX_SPLITS))
    if head_dim >= 512:  # Gemma 4's global heads: tiles that fit shared memory, unpipelined
        block_m = min(block_m, 32 if itemsize <= 2 else 16)
        return PrefillConfig(block_m, 32, num_warps=8, num_stages=1, num_splits=num_splits)
    return PrefillConfig(block_m, block_n, num_splits=num_splits)


@triton.jit
def tile_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence a query tile belongs to, where sequence s's tiles start at
    query_start_loc[s] // BLOCK_Q + s: the last s whose first tile is not past it."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1
