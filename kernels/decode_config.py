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
) -> DecodeConfig:
    """Default launch config for a decode shape; the numbers are measured (docs/kernels.md)."""
    # A grid of half a program per SM already streams K/V fast enough that a split's
    # reduce costs more than it gains; a smaller one splits until it holds ~4 per SM.
    programs, num_sms = num_seqs * num_kv_heads, num_sms_of(device)
    unsplit = 2 * programs >= num_sms
    # Longer tiles keep more bytes in flight: for small heads shared by a group of
    # queries, and for one-byte (FP8) K/V when each program streams a whole sequence.
    fp8_streams = kv_fp8 and unsplit
    block_n = 128 if (head_dim <= 64 and group > 1) or fp8_streams else 64
    max_tiles = triton.cdiv(max_blocks_per_seq * block_size, block_n)
    num_splits = 1 if unsplit else triton.cdiv(4 * num_sms, programs)
    if head_dim >= 512:  # Gemma 4's global heads: tiles that fit shared memory in fp32
        max_tiles = triton.cdiv(max_blocks_per_seq * block_size, 32)
        return DecodeConfig(max(1, min(num_splits, max_tiles, 128)), 32, num_stages=2)
    return DecodeConfig(
        num_splits=max(1, min(num_splits, max_tiles, 128)),
        block_n=block_n,
        # An e4m3 tile costs its conversions more than its bytes: two warps a program
        # and two stages let more programs share an SM (three stages measured slower).
        num_warps=2 if fp8_streams else 4,
        num_stages=2 if fp8_streams else 3,
    )


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
