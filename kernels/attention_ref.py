"""The torch references of the attention kernels, side by side: what decode attention
(kernels/paged_attention.py) and prefill attention (kernels/prefill_attention.py)
compute, and what the engine runs off CUDA. Both read the paged cache; the masks
(causal, sliding window, Llama 4's chunks, Gemma 3's horizons, both ways for encoders)
and score modifiers (soft-cap, sinks) are the kernels' arguments."""

from __future__ import annotations

import torch

from kernels.kv_store import from_cache, kv_store_ref
from kernels.rotary import Rope, rotary_ref
from kernels.score_mods import soft_cap_ref, softmax_with_sinks


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
    *,
    new_k: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim], this step's K
    new_v: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor | None = None,  # [num_seqs] int; < 0 = padding, not stored
    sliding_window: int = 0,  # > 0: attend to the last `sliding_window` tokens only
    k_scale: float = 1.0,  # FP8 cache only: it holds K / k_scale
    v_scale: float = 1.0,
    rope: Rope | None = None,  # with slot_mapping: rotate query and new_k first
    softcap: float = 0.0,  # > 0: scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads]: each head's sink logit (GPT-OSS)
    chunk: int = 0,  # > 0: attend to the keys of this token's chunk of `chunk` only (Llama 4)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]; zeros where context_len == 0
    """With slot_mapping, sequence i's new K/V go into the cache first, then it attends."""
    if rope is not None:
        assert slot_mapping is not None
        num_seqs = query.shape[0]
        q, k = rotary_ref(
            rope.positions, query.reshape(num_seqs, -1), new_k.reshape(num_seqs, -1),
            rope.cos_sin, rope.norm,
        )  # fmt: skip
        query, new_k = q.view(query.shape), k.view(new_k.shape)
    if slot_mapping is not None:
        kv_store_ref(new_k, new_v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_heads = query.shape[1]
    out = torch.zeros_like(query)
    for i, context_len in enumerate(context_lens.tolist()):
        if context_len <= 0:
            continue
        k = from_cache(gather_kv(k_cache, block_table[i], context_len), k_scale)
        v = from_cache(gather_kv(v_cache, block_table[i], context_len), v_scale)
        if sliding_window > 0:
            k, v = k[-sliding_window:], v[-sliding_window:]
        if chunk > 0:  # the keys of the chunk holding position context_len - 1
            keep = (context_len - 1) % chunk + 1
            k, v = k[-keep:], v[-keep:]
        group = num_heads // k.shape[1]  # query heads per kv head (GQA)
        k = k.repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = soft_cap_ref(torch.einsum("hd,thd->ht", query[i].float(), k) * scale, softcap)
        out[i] = torch.einsum("ht,thd->hd", softmax_with_sinks(scores, sinks), v).to(query.dtype)
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new tokens
    scale: float,
    max_query_len: int,  # host-side bound on query lengths (sizes a kernel grid)
    sliding_window: int = 0,  # > 0: a query sees the last `sliding_window` positions only
    k_scale: float = 1.0,  # FP8 cache only: it holds K / k_scale
    v_scale: float = 1.0,
    softcap: float = 0.0,  # > 0: scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads]: each head's sink logit (GPT-OSS)
    # False: every query sees every key of its sequence (an encoder's), or with a
    # sliding_window, those at most sliding_window positions away either side (ModernBERT's).
    causal: bool = True,
    # [num_tokens] int32, causal only: the last position each query sees (>= its own).
    horizons: torch.Tensor | None = None,
    chunk: int = 0,  # > 0, causal only: a query sees the keys of its chunk only (Llama 4)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_heads = query.shape[1]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        if query_len == 0:
            continue
        # Keys from the first query's window on (all of them without a window).
        lo = max(seq_len - query_len - sliding_window + 1, 0) if sliding_window > 0 else 0
        if not causal:  # a window of sliding_window keys either side
            lo = max(seq_len - query_len - sliding_window, 0)
        if chunk > 0:  # and from the first query's chunk on
            lo = max(lo, (seq_len - query_len) // chunk * chunk)
        k = from_cache(gather_kv(k_cache, block_table[i], seq_len)[lo:], k_scale)
        v = from_cache(gather_kv(v_cache, block_table[i], seq_len)[lo:], v_scale)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [query_len, num_heads, head_dim]
        scores = soft_cap_ref(torch.einsum("qhd,khd->hqk", q, k) * scale, softcap)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(lo, seq_len, device=query.device)
        distance = k_pos[None, :] - q_pos[:, None]  # [query_len, seq_len]
        if causal:
            hidden = distance > 0
            if horizons is not None:
                hidden = k_pos[None, :] > horizons[start:end, None]
            if sliding_window > 0:
                hidden |= distance <= -sliding_window
            if chunk > 0:
                hidden |= k_pos[None, :] < (q_pos - q_pos % chunk)[:, None]
        else:
            hidden = distance.abs() > (sliding_window if sliding_window > 0 else seq_len)
        scores.masked_fill_(hidden[None], float("-inf"))
        probs = softmax_with_sinks(scores, sinks)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
