"""Causal attention for chunks of new tokens over the paged KV cache (varlen batch).

Each sequence's new tokens are the last `query_len` of its `seq_len` tokens;
their K/V are already in the cache, so one path serves plain prefill, chunked
prefill and prefix-cache hits alike.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import gather_kv


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new tokens
    scale: float,
    max_query_len: int,  # host-side bound on query lengths (sizes a kernel grid)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_heads = query.shape[1]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        if query_len == 0:
            continue
        k = gather_kv(k_cache, block_table[i], seq_len).float()
        v = gather_kv(v_cache, block_table[i], seq_len).float()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [query_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out
