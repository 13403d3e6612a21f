"""Batched KV append: every new token's K and V into the paged cache, one launch."""

from __future__ import annotations

import torch


def kv_store_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int; slot = block * block_size + offset; < 0 = padding
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(v_cache.dtype)
