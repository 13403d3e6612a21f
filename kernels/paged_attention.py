"""Decode attention over the paged KV cache: one query token per sequence.

The kernel also does the step's work around it that would otherwise be two launches per
layer: given a Rope, it rotates the query and the new K as the rotary kernel would, and
it stores the new K/V before attending. An FP8 cache (e4m3, holding K / k_scale and
V / v_scale) is read as the query's dtype, exactly, with k_scale folded into the softmax
scale and v_scale into the output. Gemma 2's attention soft-cap (scores -> cap *
tanh(scores / cap) before the softmax) and GPT-OSS's attention sinks (a learned logit per
head that joins every softmax's denominator and adds no value) are arguments here and in
the prefill kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.attention_ref import paged_attention_decode_ref
from kernels.decode_config import (
    DecodeConfig,
    decode_config,
    decode_workspace,
    merge_splits,
    num_sms_of,
)
from kernels.fp8 import FP8_DTYPE, round_to_fp8
from kernels.pdl import launch_options, use_pdl, wait_previous
from kernels.rotary import Rope, rope_cos_sin, rope_load
from kernels.score_mods import sink_start, soft_cap

LOG2E = 1.4426950408889634  # kernels use exp2: exp(x) == exp2(x * LOG2E)
NO_WINDOW = 1 << 30  # the kernels' window when sliding_window is off: longer than any context


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would run as tf32 by default (~1e-3 error); keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    context_lens_ptr,
    new_k_ptr,
    new_v_ptr,
    slot_mapping_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    sinks_ptr,
    out_ptr,
    split_out_ptr,
    split_lse_ptr,
    qk_scale,  # softmax scale * LOG2E (* k_scale for an FP8 cache)
    out_scale,  # v_scale for an FP8 cache, else 1
    k_scale_inv,  # FP8 cache: 1 / k_scale, for the new K it stores
    v_scale_inv,
    norm_eps,
    softcap,  # SOFT_CAP: the soft-cap in the scores' log2 units (softcap * LOG2E)
    num_splits,
    window,  # keys older than the last `window` tokens are not attended to
    chunk,  # keys before the start of the new token's chunk are not attended to
    stride_qs,
    stride_qh,
    stride_nks,
    stride_nkh,
    stride_nvs,
    stride_nvh,
    stride_cos_sin,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bts,
    stride_os,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_ls,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    PACK: tl.constexpr,  # kv heads a program reads, for one query head each (GROUP == 1)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,  # num_splits > 1: write partials for the reduce kernel
    STORE_NEW: tl.constexpr,  # store this step's K/V (new_k, new_v) at slot_mapping first
    KV_FP8: tl.constexpr,  # the cache is e4m3
    ROPE: tl.constexpr,  # rotate q and the new K first (kernels/rotary.py's Rope)
    ROPE_NORM: tl.constexpr,  # RMS-norm each head of q and of the new K before that
    SOFT_CAP: tl.constexpr,  # scores -> softcap * tanh(scores / softcap)
    SINKS: tl.constexpr,  # a sink logit per head in the softmax's denominator
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (sequence, kv head, split): the whole query-head group of the kv head
    # shares each K/V tile it loads. The group is padded to GROUP_PAD >= 16 rows for tl.dot.
    # With PACK > 1 (multi-head attention: a query head per kv head) a program reads PACK
    # adjacent kv heads as one row of PACK * HEAD_DIM (the cache is contiguous), and query
    # row r holds head r's query in its own HEAD_DIM columns, zeros elsewhere: its scores
    # are head r's alone, and of its output row only those columns are head r's.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) * PACK  # the first of the program's kv heads
    split = tl.program_id(2)
    group_rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group_rows
    head_mask = group_rows < GROUP * PACK
    dims = tl.arange(0, PACK * HEAD_DIM_P2)  # with PACK > 1 HEAD_DIM is a power of two
    dim_mask = dims < PACK * HEAD_DIM
    if PACK > 1:
        head_dims = dims % HEAD_DIM  # a column's dim within its head, row dims // HEAD_DIM's
        q_mask = (dims // HEAD_DIM)[None, :] == group_rows[:, None]
    else:
        head_dims = dims
        q_mask = head_mask[:, None] & dim_mask[None, :]
    q_heads = query_ptr + seq * stride_qs + heads[:, None] * stride_qh

    # The step's metadata (contexts, slots, positions: written before the forward's first
    # kernel) and the cos/sin table are read before waiting for the kernel ahead, which
    # writes q and the new K/V: under PDL, while it still runs (kernels/pdl.py).
    # This split's share of the window's tiles (BLOCK_N tokens each); only here do
    # context_lens values matter, so the launch grid stays graph-replayable.
    context_len = tl.load(context_lens_ptr + seq)
    kv_start = tl.maximum(context_len - window, (context_len - 1) // chunk * chunk)
    kv_start = tl.maximum(kv_start, 0)
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    if STORE_NEW:
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)  # int64: slot * row size can pass 2**31
    if ROPE:
        # As the rotary kernel would have left q and the new K in place: each program
        # rotates the q heads it reads; the owner of the new token rotates K as it stores.
        cos, sin = rope_cos_sin(
            positions_ptr + seq, cos_sin_ptr, stride_cos_sin, dims, HEAD_DIM,
            query_ptr.dtype.element_ty,
        )  # fmt: skip
    # Running max (log2 units) and softmax denominator; split 0 counts the sinks.
    m_i, l_i = sink_start(sinks_ptr, heads, head_mask, split == 0, SINKS, GROUP_PAD)
    wait_previous(PDL)
    if ROPE:
        q = rope_load(q_heads, dims, q_mask, q_norm_ptr, cos, sin, norm_eps, ROPE_NORM, HEAD_DIM)
    else:
        q = tl.load(q_heads + head_dims[None, :], mask=q_mask, other=0.0)
    if KV_FP8 and q.dtype == tl.bfloat16:
        # The tiles' dots in fp16: e4m3 -> fp16 is one conversion per pair of values, e4m3
        # -> bf16 several, enough to make an FP8 tile cost about what a bf16 one does.
        # Queries are taken to be within fp16's range (|q| < 65504), as attention queries
        # are; the probabilities are <= 1.
        q = q.to(tl.float16)

    if STORE_NEW:
        # The new token is the context's last, so only the split whose tiles hold position
        # context_len - 1 reads it: that split stores it, once per (sequence, kv head).
        # The clamps give context_len 0 an owner too (split 0), so a slot is never skipped.
        owner = tl.maximum(num_tiles - 1 - first_tile, 0) // tl.maximum(tiles_per_split, 1)
        if (slot >= 0) & (split == owner):
            new_offs = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
            new_offs += kv_head * stride_ch + dims
            if PACK > 1:
                new_heads = kv_head + dims // HEAD_DIM
            else:
                new_heads = kv_head
            new_k_row = new_k_ptr + seq * stride_nks + new_heads * stride_nkh
            new_v = tl.load(
                new_v_ptr + seq * stride_nvs + new_heads * stride_nvh + head_dims, mask=dim_mask
            )
            if ROPE:
                k_head = new_k_row + tl.zeros([1, 1], tl.int32)  # one head: [1, D] out
                new_k = rope_load(
                    k_head, dims, dim_mask[None, :], k_norm_ptr, cos, sin, norm_eps, ROPE_NORM,
                    HEAD_DIM,
                )  # fmt: skip
                new_k = tl.reshape(new_k, (HEAD_DIM_P2,))
            else:
                new_k = tl.load(new_k_row + head_dims, mask=dim_mask)
            if KV_FP8:
                new_k = round_to_fp8(new_k.to(tl.float32) * k_scale_inv)
                new_v = round_to_fp8(new_v.to(tl.float32) * v_scale_inv)
            tl.store(k_cache_ptr + new_offs, new_k.to(k_cache_ptr.dtype.element_ty), mask=dim_mask)
            tl.store(v_cache_ptr + new_offs, new_v.to(v_cache_ptr.dtype.element_ty), mask=dim_mask)
        # The tile loop loads that row with other threads than stored it: a CTA barrier
        # (bar.sync, which orders global memory within the CTA) makes the stores visible.
        tl.debug_barrier()

    acc = tl.zeros([GROUP_PAD, PACK * HEAD_DIM_P2], tl.float32)
    head_offs = kv_head * stride_ch + dims[None, :]
    for tile in range(tile_start, tile_end):
        tokens = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        token_mask = (tokens < context_len) & (tokens >= kv_start)  # the window only
        blocks = tl.load(
            block_table_ptr + seq * stride_bts + tokens // BLOCK_SIZE, mask=token_mask, other=0
        )
        kv_offs = (
            blocks.to(tl.int64)[:, None] * stride_cb + (tokens % BLOCK_SIZE)[:, None] * stride_co
        )
        kv_offs += head_offs
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_P2]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if KV_FP8:  # e4m3 -> the dot's dtype is exact; the scales are applied outside
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP:
            scores = soft_cap(scores, softcap)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        # Every tile holds >= 1 valid token, so m_new is finite and no NaN can arise.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # context_len 0 (or an empty split) gives zeros
    result = acc / l_safe[:, None]
    if KV_FP8:
        result = result * out_scale
    if not IS_SPLIT:
        out_offs = seq * stride_os + heads[:, None] * stride_oh + head_dims[None, :]
        tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        split_offs = (
            seq * stride_ss + heads[:, None] * stride_sh + split * stride_sp + head_dims[None, :]
        )
        tl.store(split_out_ptr + split_offs, result, mask=q_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(split_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=head_mask)


def head_pack(
    num_seqs: int, num_kv_heads: int, group: int, head_dim: int, rope: bool, num_sms: int
) -> int:
    """Kv heads one decode program reads: for multi-head attention with heads of 64 dims
    or fewer (GPT-2's), enough adjacent heads for rows of 128 values, once the grid is
    crowded (a program per head would make 16 or more an SM): fewer, longer programs then
    stream their rows closer to copy bandwidth. Measured on GPT-2's heads, packed pairs
    were faster at 256 sequences (23 programs an SM unpacked) and slower at 128 (12) and
    64 (6), where the halved grid leaves SMs short of work. Not with rotary embeddings
    (each head rotated alone)."""
    crowded = num_seqs * num_kv_heads >= 16 * num_sms
    if not crowded or group > 1 or rope or head_dim > 64 or head_dim & (head_dim - 1):
        return 1
    pack = 128 // head_dim
    while num_kv_heads % pack:
        pack //= 2
    return pack


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, last dim contiguous
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    config: DecodeConfig | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,  # see decode_workspace
    new_k: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim], last dim contiguous
    new_v: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, head_dim], last dim contiguous
    slot_mapping: torch.Tensor | None = None,  # [num_seqs] int; < 0 = padding
    sliding_window: int = 0,  # > 0: attend to the last `sliding_window` tokens only
    k_scale: float = 1.0,  # FP8 cache only: it holds K / k_scale
    v_scale: float = 1.0,
    rope: Rope | None = None,  # with slot_mapping: rotate query and new_k first
    softcap: float = 0.0,  # > 0: scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads], contiguous
    chunk: int = 0,  # > 0: attend to the keys of the new token's chunk only
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Triton version of `paged_attention_decode_ref` (split-KV flash decoding).

    The launch depends only on shapes, and the launcher never syncs with the host, so a
    CUDA graph can capture it and replay it with new context_lens and block tables.
    Given new_k/new_v/slot_mapping, the kernel stores them itself: no kv_store launch;
    given rope too, it rotates query and new_k as it reads them (query is not written):
    no rotary launch.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert query.stride(2) == 1 and block_table.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    store_new = slot_mapping is not None
    if store_new:
        assert new_k.stride(2) == 1 and new_v.stride(2) == 1
    else:  # placeholders the kernel never reads (STORE_NEW=False compiles the store out)
        new_k, new_v, slot_mapping = query, query, context_lens
    if rope is not None:
        assert store_new and rope.cos_sin.is_contiguous() and rope.cos_sin.shape[1] == head_dim
        norm = rope.norm
        positions, cos_sin = rope.positions, rope.cos_sin
        q_norm, k_norm = (query, query) if norm is None else (norm.q_weight, norm.k_weight)
    else:  # placeholders again (ROPE=False)
        norm, positions, cos_sin, q_norm, k_norm = None, context_lens, query, query, query
    group = num_heads // num_kv_heads
    pack = head_pack(
        num_seqs, num_kv_heads, group, head_dim, rope is not None, num_sms_of(query.device)
    )
    if config is None:  # a pack's program reads as one kv head of pack * head_dim would
        config = decode_config(
            num_seqs,
            num_kv_heads // pack,
            block_table.shape[1],
            block_size,
            query.device,
            group * pack,
            head_dim * pack,
            k_cache.dtype == FP8_DTYPE,
            min((w for w in (sliding_window, chunk) if w > 0), default=0),
        )
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if workspace is None:
        workspace = decode_workspace(num_seqs, num_heads, head_dim, config.num_splits, query.device)
    split_out, split_lse = workspace
    head_dim_p2 = triton.next_power_of_2(head_dim)
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    if not kv_fp8:
        k_scale = v_scale = 1.0
    pdl = use_pdl(query.device)
    _decode_kernel[(num_seqs, num_kv_heads // pack, config.num_splits)](
        query,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        new_k,
        new_v,
        slot_mapping,
        positions,
        cos_sin,
        q_norm,
        k_norm,
        query if sinks is None else sinks,  # a placeholder without sinks (SINKS=False)
        out,
        split_out,
        split_lse,
        scale * LOG2E * k_scale,
        v_scale,
        1.0 / k_scale,
        1.0 / v_scale,
        0.0 if norm is None else norm.eps,
        softcap * LOG2E,  # in the scores' log2 units (k_scale is in them already)
        config.num_splits,
        sliding_window if sliding_window > 0 else NO_WINDOW,
        chunk if chunk > 0 else NO_WINDOW,
        query.stride(0),
        query.stride(1),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        cos_sin.stride(0),
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
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group * pack)),
        PACK=pack,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        IS_SPLIT=config.num_splits > 1,
        STORE_NEW=store_new,
        KV_FP8=kv_fp8,
        ROPE=rope is not None,
        ROPE_NORM=norm is not None,
        SOFT_CAP=softcap > 0,
        SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        # In fp32 a multiply-add contraction would round the rotation once where the
        # rotary kernel rounds three times (other dtypes round each product explicitly).
        enable_fp_fusion=rope is None or query.dtype != torch.float32,
        **launch_options(pdl),
    )
    if config.num_splits > 1:
        merge_splits(split_out, split_lse, out, config.num_splits, pdl)
    return out


def paged_attention_decode_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The decode attention the engine uses on `device`: Triton on CUDA, the reference elsewhere."""
    return paged_attention_decode if device.type == "cuda" else paged_attention_decode_ref
