"""Decode attention over the paged KV cache: one query token per sequence."""

from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks_per_seq]
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:context_len]


def paged_attention_decode_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens to attend to (incl. this one)
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]; zeros where context_len == 0
    num_heads = query.shape[1]
    out = torch.zeros_like(query)
    for i, context_len in enumerate(context_lens.tolist()):
        if context_len <= 0:
            continue
        k = gather_kv(k_cache, block_table[i], context_len).float()
        v = gather_kv(v_cache, block_table[i], context_len).float()
        group = num_heads // k.shape[1]  # query heads per kv head (GQA)
        k = k.repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", query[i].float(), k) * scale
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v).to(query.dtype)
    return out
