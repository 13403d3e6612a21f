"""Causal attention for chunks of new tokens over the paged KV cache (varlen batch);
bidirectional (causal=False) for an encoder's prompts, each whole in one step.
Causal with `horizons`, a query may also see keys after it, up to its horizon: Gemma 3's
image tokens see their whole image (engine/images.py), which is in the same step.

An FP8 cache is read as in the decode kernel (kernels/paged_attention.py).

Each sequence's new tokens are the last `query_len` of its `seq_len` tokens;
their K/V are already in the cache, so one path serves plain prefill, chunked
prefill and prefix-cache hits alike.

A tile's rows are BLOCK_Q queries times the query heads that share one kv head (as in
vLLM's unified attention), so each K/V tile loaded serves the whole group. A step of few
tiles (a speculative verify step, a short chunk after a cached prefix) also splits each
tile's keys among programs, as decode does, and merges their partial softmaxes after.

The Triton kernel's grid depends on the token and sequence counts only, never
on the query lengths: a step with prefill tokens can then be captured in one
CUDA graph per token bucket (engine.model_runner), its sequences padded with
empty ones. Query tiles are numbered across the batch: sequence s owns tiles
from query_start_loc[s] // BLOCK_Q + s on (at least as many as its query needs),
and each program finds its sequence by binary search; where no query is longer
than a tile, tile s is simply sequence s's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.attention_ref import paged_prefill_attention_ref
from kernels.decode_config import decode_workspace, merge_splits
from kernels.fp8 import FP8_DTYPE
from kernels.paged_attention import LOG2E, NO_WINDOW, dot_precision
from kernels.prefill_config import PrefillConfig, prefill_config, tile_sequence
from kernels.score_mods import sink_start, soft_cap


@triton.jit
def _attend(
    q,
    acc,
    l_i,
    m_i,
    k_cache_ptr,
    v_cache_ptr,
    block_row_ptr,  # the sequence's block table row
    head_offs,  # [1, HEAD_DIM_P2] offsets of the KV head's dims within a token
    dim_mask,
    q_pos,  # [BLOCK_M] absolute positions of the tile's queries
    q_see,  # [BLOCK_M] the last position each query sees (q_pos, or its horizon)
    kv_lo,  # first visible key (the window's)
    kv_end,  # one past the last key the tile may see
    start,
    stop,  # the keys of this call: [start, stop), multiples of BLOCK_N but stop
    stride_cb,
    stride_co,
    qk_scale,
    window,
    chunk,
    softcap,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every query sees every key of [start, stop)
    CHUNKED: tl.constexpr,  # a query sees the keys of its chunk only
    KV_FP8: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for kv_start in range(start, stop, BLOCK_N):
        tokens = kv_start + tl.arange(0, BLOCK_N)
        if MASKED:
            token_mask = (tokens < kv_end) & (tokens >= kv_lo)
            blocks = tl.load(block_row_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        else:
            blocks = tl.load(block_row_ptr + tokens // BLOCK_SIZE)
        kv_offs = (
            blocks.to(tl.int64)[:, None] * stride_cb + (tokens % BLOCK_SIZE)[:, None] * stride_co
        )
        kv_offs += head_offs
        if MASKED:
            kv_mask = token_mask[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_P2]
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        elif HEAD_DIM == HEAD_DIM_P2:
            k = tl.load(k_cache_ptr + kv_offs)
            v = tl.load(v_cache_ptr + kv_offs)
        else:
            k = tl.load(k_cache_ptr + kv_offs, mask=dim_mask[None, :], other=0.0)
            v = tl.load(v_cache_ptr + kv_offs, mask=dim_mask[None, :], other=0.0)
        if KV_FP8:  # e4m3 -> the query's dtype is exact; the scales are applied outside
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP:
            scores = soft_cap(scores, softcap)
        if MASKED:
            visible = token_mask[None, :] & (tokens[None, :] <= q_see[:, None])
            visible &= tokens[None, :] > q_pos[:, None] - window
            if CHUNKED:
                visible &= tokens[None, :] >= (q_pos - q_pos % chunk)[:, None]
            scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = m_new
        if MASKED:
            # With a window a row may see no key of a tile (m_new = -inf): subtracting 0
            # then keeps -inf - -inf (NaN) away; its p and alpha are 0 until a key shows.
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    horizons_ptr,
    out_ptr,
    split_out_ptr,
    split_lse_ptr,
    qk_scale,  # softmax scale * LOG2E (* k_scale for an FP8 cache)
    out_scale,  # v_scale for an FP8 cache, else 1
    window,  # a query sees keys at most `window - 1` positions behind it
    chunk,  # CHUNKED: a query sees keys from the start of its chunk of `chunk` on
    softcap,  # SOFT_CAP: the soft-cap in the scores' log2 units (softcap * LOG2E)
    num_splits,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bts,
    stride_ot,
    stride_oh,
    stride_st,
    stride_sh,
    stride_sp,
    stride_lt,
    stride_lh,
    num_seqs,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: BLOCK_Q queries x the GROUP heads of one kv head
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,  # a sliding window or chunks: every tile is masked
    ONE_TILE: tl.constexpr,  # no query is longer than BLOCK_Q: tile i is sequence i's
    IS_SPLIT: tl.constexpr,  # partials per split into split_out/split_lse
    KV_FP8: tl.constexpr,  # the cache is e4m3
    SOFT_CAP: tl.constexpr,  # scores -> softcap * tanh(scores / softcap)
    SINKS: tl.constexpr,  # a sink logit per head in the softmax's denominator
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,  # False: both ways (with a window: `window` = 2 x half-width + 1)
    HORIZONS: tl.constexpr,  # causal: a query sees keys up to its horizon
    CHUNKED: tl.constexpr,  # causal: chunked attention
):
    # One program per (query tile of the batch, kv head, key split), the last tiles first
    # (under causality they see the most keys). A tile's rows are BLOCK_Q queries times
    # the query heads that share the kv head, so each K/V tile loaded serves all of them.
    # The tile's sequence is the last s whose first tile, query_start_loc[s] // BLOCK_Q
    # + s, is not past it; tiles past a sequence's queries (and every tile of an empty
    # sequence) exit at once.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_TILE:  # a padded sequence's programs exit after one round trip
        seq = tile
    else:
        seq = tile_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = 0 if ONE_TILE else tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M)
    rows = q_tile * BLOCK_Q + r // GROUP  # each row's query within the sequence's
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (rows < query_len)
    first_pos = seq_len - query_len + q_tile * BLOCK_Q  # the tile's first query position
    q_pos = seq_len - query_len + rows  # absolute positions of its rows' queries
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_offs = (q_start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_P2]

    if not CAUSAL:  # both ways: each query seen as a causal one further on
        if WINDOWED:  # |key - query| <= W, window = 2W + 1: a causal window W ahead
            q_pos += (window - 1) // 2
            first_pos += (window - 1) // 2
        else:  # as if every query were the last: the mask then only bounds seq_len
            q_pos = tl.zeros_like(q_pos) + seq_len - 1
            first_pos = seq_len - 1
    # Causality bounds the keys by the tile's last query position, the window by its first.
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    q_see = q_pos
    if HORIZONS:  # or by the furthest any of its queries sees
        q_see = tl.maximum(tl.load(horizons_ptr + q_start + rows, mask=row_mask, other=0), q_pos)
        kv_end = tl.minimum(seq_len, tl.maximum(kv_end, tl.max(q_see, 0) + 1))
    kv_lo = tl.maximum(first_pos - window + 1, 0)
    if CHUNKED:  # and the chunk of its first query
        kv_lo = tl.maximum(kv_lo, first_pos - first_pos % chunk)
    keys_from = (kv_lo // BLOCK_N) * BLOCK_N
    # This split's keys: an equal share of whole BLOCK_N tiles (the sink counts once).
    seg_start = keys_from
    seg_end = kv_end
    if IS_SPLIT:
        share = tl.cdiv(tl.cdiv(kv_end - keys_from, num_splits), BLOCK_N) * BLOCK_N
        seg_start = keys_from + split * share
        seg_end = tl.minimum(seg_start + share, kv_end)
    m_i, l_i = sink_start(  # running max (log2 units) and denominator
        sinks_ptr, heads, row_mask, split == 0, SINKS, BLOCK_M
    )
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    head_offs = kv_head * stride_ch + dims[None, :]
    block_row_ptr = block_table_ptr + seq * stride_bts
    masked_from = seg_start
    if not WINDOWED:  # keys up to the first query's position: visible to every query
        masked_from = tl.maximum(((first_pos + 1) // BLOCK_N) * BLOCK_N, seg_start)
        acc, l_i, m_i = _attend(
            q, acc, l_i, m_i, k_cache_ptr, v_cache_ptr, block_row_ptr, head_offs, dim_mask,
            q_pos, q_see, kv_lo, kv_end, seg_start, tl.minimum(masked_from, seg_end), stride_cb,
            stride_co, qk_scale, window, chunk, softcap, HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE,
            BLOCK_N, False, CHUNKED, KV_FP8, SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip
    acc, l_i, m_i = _attend(
        q, acc, l_i, m_i, k_cache_ptr, v_cache_ptr, block_row_ptr, head_offs, dim_mask,
        q_pos, q_see, kv_lo, kv_end, masked_from, seg_end, stride_cb, stride_co, qk_scale, window,
        chunk, softcap, HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, BLOCK_N, True, CHUNKED, KV_FP8,
        SOFT_CAP, DOT_PRECISION,
    )  # fmt: skip

    tokens = q_start + rows
    if IS_SPLIT:  # a split may see no key of a row: its lse is -inf, its weight 0
        seen = l_i > 0
        result = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        lse_offs = tokens * stride_lt + heads * stride_lh + split
        tl.store(split_lse_ptr + lse_offs, lse, mask=row_mask)
        part_offs = tokens[:, None] * stride_st + heads[:, None] * stride_sh + dims[None, :]
        part_mask = q_mask & seen[:, None]
        tl.store(split_out_ptr + part_offs + split * stride_sp, result * out_scale, mask=part_mask)
    else:
        result = acc / l_i[:, None]
        if KV_FP8:
            result = result * out_scale
        out_offs = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, last dim contiguous
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_query_len: int,
    sliding_window: int = 0,  # > 0: a query sees the last `sliding_window` positions only
    k_scale: float = 1.0,  # FP8 cache only: it holds K / k_scale
    v_scale: float = 1.0,
    config: PrefillConfig | None = None,
    softcap: float = 0.0,  # > 0: scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads], contiguous
    causal: bool = True,  # False: both ways within each sequence (sliding_window: either side)
    horizons: torch.Tensor | None = None,  # [num_tokens] int32: see the reference
    chunk: int = 0,  # > 0, causal only: a query sees the keys of its chunk only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton version of `paged_prefill_attention_ref` (flash attention over the paged cache).

    Writes the rows of tokens 0 .. query_start_loc[-1] - 1 only. Padding is allowed
    on both axes: rows past query_start_loc[-1], and trailing sequences with no query
    (query_start_loc flat at the end). max_query_len picks the tile height only: a
    CUDA graph captured with a bound on it replays for any shorter queries.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert query.stride(2) == 1 and block_table.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    if not kv_fp8:
        k_scale = v_scale = 1.0
    window = sliding_window if causal else 2 * sliding_window + 1  # the kernel's: see CAUSAL
    group = num_heads // num_kv_heads
    if config is None:
        context = window if sliding_window > 0 else block_table.shape[1] * block_size
        context = min(context, chunk) if chunk > 0 else context  # keys a query sees at most
        config = prefill_config(
            max_query_len, head_dim, group, num_tokens, num_kv_heads, context, query.device,
            query.element_size(),
        )  # fmt: skip
    block_q = max(config.block_m // group, 1)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    num_splits = config.num_splits
    head_dim_p2 = triton.next_power_of_2(head_dim)
    split_out, split_lse = decode_workspace(
        num_tokens, num_heads, head_dim, num_splits, query.device
    )
    # Every sequence's tiles, and spares; a program per kv head and split. Programs of
    # padded tiles still cost their launch and their shared memory: where no query is
    # longer than a tile (verify steps, small prefill buckets), a tile per sequence.
    one_tile = max_query_len <= block_q
    tiles = num_seqs if one_tile else num_tokens // block_q + num_seqs
    grid = (tiles, num_kv_heads, num_splits)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_table,
        query_start_loc,
        seq_lens,
        query if sinks is None else sinks,  # a placeholder without sinks (SINKS=False)
        seq_lens if horizons is None else horizons,  # the same (HORIZONS=False)
        out,
        split_out,
        split_lse,
        scale * LOG2E * k_scale,
        v_scale,
        window if sliding_window > 0 else NO_WINDOW,
        chunk if chunk > 0 else NO_WINDOW,
        softcap * LOG2E,
        num_splits,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        split_out.stride(0),
        split_out.stride(1),
        split_out.stride(2),
        split_lse.stride(0),
        split_lse.stride(1),
        num_seqs,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        WINDOWED=sliding_window > 0 or chunk > 0,
        ONE_TILE=one_tile,
        IS_SPLIT=num_splits > 1,
        KV_FP8=kv_fp8,
        SOFT_CAP=softcap > 0,
        SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        CAUSAL=causal,
        HORIZONS=horizons is not None,
        CHUNKED=chunk > 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        merge_splits(split_out, split_lse, out, num_splits, pdl=False)
    return out


def paged_prefill_attention_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The prefill attention the engine uses on `device`: Triton on CUDA, the reference elsewhere."""
    return paged_prefill_attention if device.type == "cuda" else paged_prefill_attention_ref
