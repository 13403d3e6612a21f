"""Decode attention's launch: the config (KV splits, tile, warps, stages) and the split-KV
workspace, each a function of shapes only, so CUDA graphs capture one launch per batch
size and replay it whatever the contexts (kernels/paged_attention.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class DecodeConfig:
    """Launch config of the decode kernel; a function of shapes only (CUDA-graph safe)."""

    num_splits: int  # KV splits per (sequence, kv head); 1 skips the reduce kernel
    block_n: int = 64  # tokens per K/V tile
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
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
    programs, num_sms = num_seqs * num_kv_heads, _num_sms(device)
    unsplit = 2 * programs >= num_sms
    # Longer tiles keep more bytes in flight: for small heads shared by a group of
    # queries, and for one-byte (FP8) K/V when each program streams a whole sequence.
    block_n = 128 if (head_dim <= 64 and group > 1) or (kv_fp8 and unsplit) else 64
    max_tiles = triton.cdiv(max_blocks_per_seq * block_size, block_n)
    num_splits = 1 if unsplit else triton.cdiv(4 * num_sms, programs)
    return DecodeConfig(num_splits=max(1, min(num_splits, max_tiles, 128)), block_n=block_n)


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
