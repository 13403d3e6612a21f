"""Decode attention's launch: the config (KV splits, tile, warps, stages) and the split-KV
workspace, each a function of shapes only, so CUDA graphs capture one launch per batch
size and replay it whatever the contexts (kernels/paged_attention.py); and the kernel
that merges the splits' partial softmaxes."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, wait_previous


@dataclass(frozen=True)
class DecodeConfig:
    """Launch config of the decode kernel; a function of shapes only (CUDA-graph safe)."""

    num_splits: int  # KV splits per (sequence, kv head); 1 skips the reduce kernel
    block_n: int = 64  # tokens per K/V tile
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache
def num_sms_of(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # Triton interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_config(
    num_seqs: int,
    num_kv_heads: int,
    max_blocks_per_seq: int,
    block_size: int,
    device: torch.device,
    group: int = 1,
    head_dim: int = 128,
    kv_fp8: bool = False,
    window: int = 0,
) -> DecodeConfig:
    """Default launch config for a decode shape; the numbers are measured (docs/kernels.md).

    Each (sequence, kv head) program streams its keys alone, so a grid of few programs
    leaves most SMs with one or none: the keys split until the grid holds about four
    programs an SM (six for e4m3 caches, whose tiles cost more in conversions than in
    bytes; two for 256-wide heads, whose programs are twice the work), by powers of two.
    A split is decided from shapes only, never from the contexts, so a long-context step
    and a short one replay the same graph. `window` (> 0: a sliding window or attention
    chunk) bounds the keys a query reads: each split gets two of its 64-token tiles or
    more, as a window of a few tiles is read faster whole than split and merged.
    """
    programs, num_sms = num_seqs * num_kv_heads, num_sms_of(device)
    if head_dim >= 512:  # Gemma 4's global heads: tiles that fit shared memory in fp32
        max_tiles = triton.cdiv(max_blocks_per_seq * block_size, 32)
        num_splits = 1 if 2 * programs >= num_sms else triton.cdiv(4 * num_sms, programs)
        return DecodeConfig(max(1, min(num_splits, max_tiles, 128)), 32, num_stages=2)
    wide_heads = head_dim > 128
    per_sm = 2 if wide_heads else 6 if kv_fp8 else 4
    num_splits = 1 << max(0, (per_sm * num_sms // programs).bit_length() - 1)
    num_splits = min(num_splits, triton.cdiv(max_blocks_per_seq * block_size, 64), 64)
    if window > 0:
        num_splits = min(num_splits, max(1, window // 128))
    if wide_heads:
        # Two warps spill a 256-wide tile of 128 tokens: bf16 takes 64-token tiles on 4
        # warps or more and 2 stages; e4m3 128-token tiles on 4 warps and 2 stages, but
        # 64-token tiles on 2 warps and 3 stages unsplit past ~3 programs an SM.
        if not kv_fp8:
            return DecodeConfig(num_splits, 64, num_warps=4 if num_splits > 1 else 8, num_stages=2)
        if num_splits == 1 and programs >= 3 * num_sms:
            return DecodeConfig(1, 64, num_warps=2, num_stages=3)
        return DecodeConfig(num_splits, 128, num_warps=4, num_stages=2)
    if kv_fp8:
        # Two warps and two stages let more programs share an SM (an e4m3 tile is bound
        # by its work, not its bytes); 128-token tiles keep more bytes in flight, except
        # where the splits leave each program few tiles or crowd the SMs past ~4 each.
        if num_splits == 1:
            wide = head_dim <= 64  # small heads: 4 warps and 3 stages measured faster
            return DecodeConfig(1, 128, num_warps=4 if wide else 2, num_stages=3 if wide else 2)
        few_tiles = num_splits > 8 or programs * num_splits > 4 * num_sms
        return DecodeConfig(num_splits, 64 if few_tiles else 128, num_warps=2, num_stages=2)
    if num_splits > 1:
        return DecodeConfig(num_splits, 64, num_warps=2)
    # Unsplit: 128-token tiles for small heads shared by a group of queries, and while
    # the grid is under ~3 programs an SM; past that the smaller tile's buffers let more
    # programs reside at once.
    wide = (head_dim <= 64 and group > 1) or programs < 3 * num_sms
    return DecodeConfig(1, 128 if wide else 64)


def decode_workspace(
    num_seqs: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials: each split's normalized output and its log2-sum-exp (fp32).

    With one split they go unused, so they shrink to a single element.
    """
    if num_splits == 1:
        num_seqs = num_heads = head_dim = 1
    f32 = torch.float32
    split_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=f32, device=device)
    split_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=f32, device=device)
    return split_out, split_lse


@triton.jit
def _decode_reduce_kernel(
    split_out_ptr,
    split_lse_ptr,
    out_ptr,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (sequence, query head): merge the splits' partial softmaxes.
    wait_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, HEAD_DIM_P2)
    split_mask = splits < NUM_SPLITS
    lse = tl.load(
        split_lse_ptr + seq * stride_ls + head * stride_lh + splits,
        mask=split_mask,
        other=float("-inf"),
    )
    # Empty splits (lse = -inf) weigh exp2(-inf) = 0; a finite max keeps -inf - -inf away.
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0))
    part_offs = seq * stride_ss + head * stride_sh + splits[:, None] * stride_sp + dims[None, :]
    # An empty split may have left its partial unwritten: never read it.
    part_mask = (split_mask & (lse > float("-inf")))[:, None] & (dims[None, :] < HEAD_DIM)
    parts = tl.load(
        split_out_ptr + part_offs, mask=part_mask, other=0.0
    )  # [SPLITS_P2, HEAD_DIM_P2]
    denom = tl.sum(weights, 0)
    result = tl.sum(weights[:, None] * parts, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def merge_splits(
    split_out: torch.Tensor,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    split_lse: torch.Tensor,  # [num_seqs, num_heads, num_splits] fp32
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    num_splits: int,
    pdl: bool,
) -> None:
    """out: the splits' partials (decode_workspace's, filled by the decode kernel) merged."""
    num_seqs, num_heads, head_dim = out.shape
    head_dim_p2 = triton.next_power_of_2(head_dim)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        split_out,
        split_lse,
        out,
        split_out.stride(0),
        split_out.stride(1),
        split_out.stride(2),
        split_lse.stride(0),
        split_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_P2=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        PDL=pdl,
        **launch_options(pdl),
    )
