"""Multi-head latent attention (MLA) over a latent paged cache (engine/models/deepseek.py).

The cache holds one row a token: MLA's latent c (kv_lora_rank values, normed) then its
rotary key k_pe (qk_rope_head_dim, rotated), [num_blocks, block_size, 1, latent + rope].
With kv_b_proj's per-head halves absorbed into the query (q_lat = q_nope @ W_UK) and the
output (out_lat @ W_UV), every query head attends to that one row:

    score = (q_lat . c + q_pe . k_pe) * scale,    out_lat = sum softmax(score) * c

so the attention is multi-query, K the whole row and V its first `latent` values, each
row read once for all the heads. An FP8 cache (e4m3) holds the row / kv_scale, one
scale for the layer, as vLLM's; it is read as the query's dtype, exactly, the scale
folded into the softmax scale and the output. One kernel serves every step: a query
tile is BLOCK_Q tokens of one sequence times a block of heads (decode: one token, each
sequence's own tile), causal by position, its keys split among programs where the grid
is small, as decode attention's are (kernels/decode_config.py merges them). A decode
step's kernel also finishes and stores the step's new rows (kernels/mla_store.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_ref import gather_kv
from kernels.decode_config import decode_workspace, merge_splits, num_sms_of
from kernels.fp8 import FP8_DTYPE
from kernels.kv_store import from_cache
from kernels.mla_store import LatentRows, finish_row, finish_rows_ref, mla_store_ref, store_row
from kernels.paged_attention import LOG2E, dot_precision
from kernels.pdl import launch_options, use_pdl, wait_previous
from kernels.prefill_config import tile_sequence
from kernels.rotary import rope_cos_sin, rope_load

MAX_HEADS = 64  # query heads a program takes; more go to further programs
MAX_SPLITS = 32


def mla_attention_ref(
    q_lat: torch.Tensor,  # [n, heads, latent]
    q_pe: torch.Tensor,  # [n, heads, rope]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor | None,  # [num_seqs + 1]; None: row i is sequence i's last
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new tokens
    scale: float,
    max_query_len: int = 1,  # unused here: the kernel's tile height
    kv_scale: float = 1.0,  # FP8 cache only: it holds the row / kv_scale
    new: LatentRows | None = None,  # decode rows: q_pe unrotated, the new rows raw
) -> torch.Tensor:  # [n, heads, latent]; zeros for rows of no sequence
    """With `new`, q_pe is rotated and the new rows normed, rotated and stored first."""
    if new is not None:
        q_pe, c, k_pe = finish_rows_ref(q_pe, new)
        mla_store_ref(c, k_pe, cache, new.slot_mapping, kv_scale)
    latent = q_lat.shape[-1]
    out = q_lat.new_zeros(q_lat.shape)
    lens = seq_lens.tolist()
    starts = list(range(len(lens) + 1)) if query_start_loc is None else query_start_loc.tolist()
    q = torch.cat([q_lat, q_pe], dim=-1).float()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end <= start or seq_len <= 0:
            continue
        rows = gather_kv(cache, block_table[i], seq_len)[:, 0]  # [seq_len, L + R]
        rows = from_cache(rows, kv_scale)
        scores = torch.einsum("qhd,kd->hqk", q[start:end], rows) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        hidden = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
        probs = scores.masked_fill(hidden[None], float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,kd->qhd", probs, rows[:, :latent]).to(out.dtype)
    return out


@triton.jit
def _mla_attention_kernel(
    q_lat_ptr,
    q_pe_ptr,
    cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    split_out_ptr,
    split_lse_ptr,
    latent_ptr,  # STORE_NEW: LatentRows' fields
    norm_ptr,
    positions_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    qk_scale,  # softmax scale * LOG2E (* kv_scale for an FP8 cache)
    out_scale,  # kv_scale for an FP8 cache, else 1
    scale_inv,  # 1 / kv_scale: the new rows' into an FP8 cache
    norm_eps,
    num_heads,
    num_seqs,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_cb,
    stride_co,
    stride_bts,
    stride_ot,
    stride_oh,
    stride_st,
    stride_sh,
    stride_sp,
    stride_lt,
    stride_lh,
    stride_lat,
    stride_cos_sin,
    LATENT: tl.constexpr,
    LATENT_P2: tl.constexpr,  # >= 16 for tl.dot, as ROPE_P2
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,  # heads a program takes
    BLOCK_Q: tl.constexpr,  # queries a program takes
    BLOCK_M: tl.constexpr,  # rows: BLOCK_Q x HEADS, a power of two >= 16
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ONE_PER_SEQ: tl.constexpr,  # row i is sequence i's one query (decode, verify rows)
    STORE_NEW: tl.constexpr,  # decode: rotate q_pe, finish and store the new rows first
    KV_FP8: tl.constexpr,  # the cache is e4m3
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (query tile, head block, key split). As in the prefill kernel, the
    # tile's sequence is the last s whose first tile, query_start_loc[s] // BLOCK_Q + s,
    # is not past it; tiles past their sequence's queries exit.
    tile = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    # The step's metadata and the cos/sin table first: the kernel ahead writes none of them
    # (kernels/pdl.py), so under PDL they are read while it still runs.
    if ONE_PER_SEQ:
        seq = tile
        q_start = tile
        query_len = 1
        q_tile = 0
    else:
        seq = tile_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_tile = tile - (q_start // BLOCK_Q + seq)
    # A padded row's seq_len is 0: it sees no key and comes out zero.
    seq_len = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, LATENT_P2)
    e = tl.arange(0, ROPE_P2)
    if STORE_NEW:
        cos, sin = rope_cos_sin(
            positions_ptr + seq, cos_sin_ptr, stride_cos_sin, e, ROPE, q_pe_ptr.dtype.element_ty
        )
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
    wait_previous(PDL)
    if q_tile * BLOCK_Q >= query_len:
        return
    r = tl.arange(0, BLOCK_M)
    rows = q_tile * BLOCK_Q + r // HEADS  # each row's query within the sequence's
    heads = head_block * HEADS + r % HEADS
    row_mask = (r < BLOCK_Q * HEADS) & (rows < query_len) & (heads < num_heads)
    q_pos = seq_len - query_len + rows
    tokens = (q_start + rows).to(tl.int64)
    q_lat = tl.load(
        q_lat_ptr + tokens[:, None] * stride_qlt + heads[:, None] * stride_qlh + d[None, :],
        mask=row_mask[:, None] & (d[None, :] < LATENT),
        other=0.0,
    )  # [BLOCK_M, LATENT_P2]
    q_pe_rows = q_pe_ptr + tokens[:, None] * stride_qpt + heads[:, None] * stride_qph
    q_pe_mask = row_mask[:, None] & (e[None, :] < ROPE)
    if STORE_NEW:  # as the rotary kernel would have left q_pe (every row is seq's own)
        q_pe = rope_load(q_pe_rows, e, q_pe_mask, norm_ptr, cos, sin, norm_eps, False, ROPE)
    else:
        q_pe = tl.load(q_pe_rows + e[None, :], mask=q_pe_mask, other=0.0)  # [BLOCK_M, ROPE_P2]

    # Keys up to the tile's last query; this split's share of them, in whole tiles.
    kv_end = tl.minimum(seq_len, seq_len - query_len + q_tile * BLOCK_Q + BLOCK_Q)
    share = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    seg_start = split * share
    seg_end = tl.minimum(seg_start + share, kv_end)
    if STORE_NEW:
        # The new row is the sequence's last key: the split whose keys hold it stores it
        # (each head block's split the same bytes), then reads it in its tiles; the CTA
        # barrier makes the stores visible to the threads that load them. A padded row
        # (slot < 0, seq_len 0) stores nothing.
        owner = tl.maximum(seq_len - 1, 0) // tl.maximum(share, 1)
        if (slot >= 0) & (split == owner):
            c_new, pe_new = finish_row(
                latent_ptr + seq * stride_lat, norm_ptr, norm_eps, cos, sin, d, e, LATENT, ROPE,
                ROPE_P2,
            )  # fmt: skip
            row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
            store_row(row, c_new, pe_new, d, e, scale_inv, LATENT, ROPE, KV_FP8)
        tl.debug_barrier()
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_P2], tl.float32)
    block_row = block_table_ptr + seq * stride_bts
    for kv_start in range(seg_start, seg_end, BLOCK_N):
        keys = kv_start + tl.arange(0, BLOCK_N)
        key_mask = keys < seg_end
        blocks = tl.load(block_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
        key_rows = blocks.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_co
        c = tl.load(
            cache_ptr + key_rows[:, None] + d[None, :],
            mask=key_mask[:, None] & (d[None, :] < LATENT),
            other=0.0,
        )  # [BLOCK_N, LATENT_P2]
        pe = tl.load(
            cache_ptr + key_rows[:, None] + LATENT + e[None, :],
            mask=key_mask[:, None] & (e[None, :] < ROPE),
            other=0.0,
        )  # [BLOCK_N, ROPE_P2]
        if KV_FP8:  # e4m3 -> the query's dtype is exact; the scale is applied outside
            c = c.to(q_lat.dtype)
            pe = pe.to(q_lat.dtype)
        scores = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(pe), scores, input_precision=DOT_PRECISION) * qk_scale
        visible = key_mask[None, :] & (keys[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row may see no key of a tile (a later query's, or a masked row): subtracting 0
        # keeps -inf - -inf (NaN) away; its p and alpha stay 0 until a key shows.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    result = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KV_FP8:
        result = result * out_scale
    out_mask = row_mask[:, None] & (d[None, :] < LATENT)
    if NUM_SPLITS > 1:  # a split may see no key of a row: its lse is -inf, its weight 0
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(split_lse_ptr + tokens * stride_lt + heads * stride_lh + split, lse, mask=row_mask)
        part = tokens[:, None] * stride_st + heads[:, None] * stride_sh + split * stride_sp
        tl.store(split_out_ptr + part + d[None, :], result, mask=out_mask & seen[:, None])
    else:
        offs = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + offs, result.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class MlaConfig:
    """Launch config of the MLA kernel: a function of shapes only (CUDA-graph safe)."""

    block_q: int  # queries a program takes (1 for one row a sequence)
    block_n: int
    num_splits: int
    num_warps: int = 8
    num_stages: int = 2


def mla_config(
    num_tiles: int,  # query tiles the grid has
    num_heads: int,
    max_context: int,  # bound on any sequence's keys (the block table's width)
    block_q: int,
    device: torch.device,
    row_bytes: int = 1024,  # a cached row's latent part, in bytes (padded to a power of two)
) -> MlaConfig:
    """The numbers are measured at DeepSeek-V2-Lite's shape on an H200 (16 heads): 64-key
    tiles on 8 warps, for decode rows and query tiles alike (32-key tiles for rows of
    over 1 KB, fp32's, to fit two stages in shared memory). Few programs split their
    keys: query tiles (short chunks) until the grid holds about four per SM, as decode
    attention does; decode rows until it holds about two, on 32-key tiles and 4 warps,
    whose programs all fit at once (a 64-key program's two stages take most of an SM's
    shared memory, so four a SM ran in waves)."""
    block_n = 64 if row_bytes <= 1024 else 32
    programs = num_tiles * triton.cdiv(num_heads, MAX_HEADS)
    num_sms = num_sms_of(device)
    if 2 * programs >= num_sms:
        return MlaConfig(block_q, block_n, 1)
    per_sm, warps = 4, 8
    if block_q == 1:
        block_n, per_sm, warps = 32, 2, 4
    most = max(triton.cdiv(max_context, block_n), 1)
    splits = max(1, min(triton.cdiv(per_sm * num_sms, programs), most, MAX_SPLITS))
    return MlaConfig(block_q, block_n, splits, num_warps=warps)


def mla_attention(
    q_lat: torch.Tensor,  # [n, heads, latent], last dim contiguous
    q_pe: torch.Tensor,  # [n, heads, rope], last dim contiguous
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope] contiguous
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, last dim contiguous
    query_start_loc: torch.Tensor | None,  # see the reference
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_query_len: int = 1,  # a host-side bound on query lengths: the tile height only
    kv_scale: float = 1.0,  # FP8 cache only: it holds the row / kv_scale
    new: LatentRows | None = None,  # decode rows (query_start_loc None): see the reference
    config: MlaConfig | None = None,
) -> torch.Tensor:  # [n, heads, latent]: a [heads, n, latent] buffer, transposed
    """Triton version of `mla_attention_ref`. The grid depends on n, the sequence count
    and max_query_len's tile height only, so a CUDA graph replays it for any lengths.
    The output is laid out head-major, as the product by W_UV that follows reads it.
    Given `new`, the kernel rotates q_pe as it reads it (q_pe is not written) and stores
    the new rows itself: no norm, rotary or store launch."""
    n, num_heads, latent = q_lat.shape
    rope = q_pe.shape[2]
    num_seqs, block_size = seq_lens.shape[0], cache.shape[1]
    assert q_lat.stride(2) == 1 and q_pe.stride(2) == 1 and block_table.stride(1) == 1
    assert cache.is_contiguous() and cache.shape[-1] == latent + rope
    out = torch.empty(num_heads, n, latent, dtype=q_lat.dtype, device=q_lat.device)
    out = out.transpose(0, 1)
    if n == 0 or num_seqs == 0:
        return out
    heads = min(num_heads, MAX_HEADS)
    one_per_seq = query_start_loc is None
    assert not one_per_seq or n == num_seqs
    if new is not None:
        assert one_per_seq and new.latent.stride(1) == 1 and new.latent.shape[1] == latent + rope
        assert new.rope.cos_sin.is_contiguous() and new.rope.cos_sin.shape[1] == rope
        new_args = (new.latent, new.norm_weight, new.rope.positions, new.rope.cos_sin)
        new_args += (new.slot_mapping,)
    else:  # placeholders the kernel never reads (STORE_NEW=False compiles them out)
        new_args = (q_lat,) * 5
    if config is None:
        rows = max(16, triton.next_power_of_2(heads))
        block_q = 1 if one_per_seq else max(1, min(max_query_len, 64 // rows))
        block_q = triton.next_power_of_2(block_q)
        tiles = num_seqs if one_per_seq else triton.cdiv(n, block_q)
        context = block_table.shape[1] * block_size
        row_bytes = triton.next_power_of_2(latent) * cache.element_size()
        config = mla_config(tiles, num_heads, context, block_q, q_lat.device, row_bytes)
    block_q = config.block_q
    tiles = num_seqs if one_per_seq else n // block_q + num_seqs
    split_out, split_lse = decode_workspace(n, num_heads, latent, config.num_splits, q_lat.device)
    kv_fp8 = cache.dtype == FP8_DTYPE
    if not kv_fp8:
        kv_scale = 1.0
    pdl = use_pdl(q_lat.device)
    grid = (tiles, triton.cdiv(num_heads, heads), config.num_splits)
    _mla_attention_kernel[grid](
        q_lat,
        q_pe,
        cache,
        block_table,
        seq_lens if one_per_seq else query_start_loc,  # a placeholder (ONE_PER_SEQ)
        seq_lens,
        out,
        split_out,
        split_lse,
        *new_args,
        scale * LOG2E * kv_scale,
        kv_scale,
        1.0 / kv_scale,
        0.0 if new is None else new.eps,
        num_heads,
        num_seqs,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        split_out.stride(0),
        split_out.stride(1),
        split_out.stride(2),
        split_lse.stride(0),
        split_lse.stride(1),
        new_args[0].stride(0),
        new_args[3].stride(0),
        LATENT=latent,
        LATENT_P2=max(16, triton.next_power_of_2(latent)),
        ROPE=rope,
        ROPE_P2=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=block_size,
        HEADS=heads,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, triton.next_power_of_2(block_q * heads)),
        BLOCK_N=config.block_n,
        NUM_SPLITS=config.num_splits,
        ONE_PER_SEQ=one_per_seq,
        STORE_NEW=new is not None,
        KV_FP8=kv_fp8,
        DOT_PRECISION=dot_precision(q_lat.dtype),
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        # In fp32 a multiply-add contraction would round the rotation once where the
        # rotary kernel rounds three times (other dtypes round each product explicitly).
        enable_fp_fusion=new is None or q_lat.dtype != torch.float32,
        **launch_options(pdl),
    )
    if config.num_splits > 1:
        merge_splits(split_out, split_lse, out, config.num_splits, pdl)
    return out


def mla_attention_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """Triton on CUDA, the reference elsewhere."""
    return mla_attention if device.type == "cuda" else mla_attention_ref
