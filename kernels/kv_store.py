"""Batched KV append: every new token's K and V into the paged cache, one launch.

An FP8 (e4m3) cache stores K / k_scale and V / v_scale, rounded and saturated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, quantize_fp8_ref, round_to_fp8


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x as `cache` holds it: quantized by 1 / scale into an FP8 cache, else just cast."""
    if cache.dtype == FP8_DTYPE:
        return quantize_fp8_ref(x.float() * (1.0 / scale), 1.0)
    return x.to(cache.dtype)


def from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:  # fp32
    """A cache's values in fp32: times scale where they are FP8."""
    return x.float() * scale if x.dtype == FP8_DTYPE else x.float()


def kv_store_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int; slot = block * block_size + offset; < 0 = padding
    k_scale: float = 1.0,  # FP8 cache only: it holds key / k_scale
    v_scale: float = 1.0,
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache(key[valid], k_cache, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache(value[valid], v_cache, v_scale)


@triton.jit
def _kv_store_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_inv,  # FP8 cache: 1 / k_scale
    v_scale_inv,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # One program per token: all of its heads' K and V in one tile each.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * row size can pass 2**31
    if slot < 0:  # padding token
        return
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    cache_offs = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    cache_offs += heads * stride_ch + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if KV_FP8:
        key = round_to_fp8(key.to(tl.float32) * k_scale_inv)
        value = round_to_fp8(value.to(tl.float32) * v_scale_inv)
    tl.store(k_cache_ptr + cache_offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_store(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int; < 0 = padding
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of `kv_store_ref`: one launch, no host sync."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_tokens == 0:
        return
    heads_p2, head_dim_p2 = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _kv_store_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=heads_p2,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=k_cache.shape[1],
        KV_FP8=k_cache.dtype == FP8_DTYPE,
        # Up to 8 elements (16 bytes at fp16) per thread; a 2 x 64 tile needs only one warp.
        num_warps=min(4, max(1, heads_p2 * head_dim_p2 // 256)),
    )


def kv_store_for(device: torch.device) -> Callable[..., None]:
    """The KV append the engine uses on `device`: Triton on CUDA, the reference elsewhere."""
    return kv_store if device.type == "cuda" else kv_store_ref
