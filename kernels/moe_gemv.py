"""The MoE layer at decode batch sizes: each (token, expert) pair on its own.

With a few tokens (one to a few sequences decoding) each pair is one row against its
expert's weights: a GEMV. The grouped GEMM (kernels/fused_moe.py) pads each expert's
run to a 16-row tile and finds the runs with a dozen small launches (the sort by
expert); here each program takes one pair's row, one tile of output columns and one
share of K, reads the pair's expert id itself, and the programs that finish a (pair,
column tile) last sum its K splits in split order, as kernels/linear.py's split-K does
(deterministic, no memset: every launch leaves the counters at zero). Two launches: the
gated gate/up product with its activation, one program row per pair; then down, one
row per token, summing its pairs' products weighted by their routing weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import ExpertAct, expert_act_args, expert_gated, moe_gated
from kernels.paged_attention import dot_precision

# Pairs up to which fused_moe takes this path (top-10 routing of one token; top-8 of two).
MAX_PAIRS = 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}
MAX_COUNTERS = 1 << 15  # (pair, column tile) slots: MAX_PAIRS x 2048 tiles


def _counters(device: torch.device) -> torch.Tensor:
    """Arrival counters shared by every launch on the device (one stream: launches run
    one after another, and each leaves them at zero)."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@triton.jit
def _pair_gemv_kernel(
    a_ptr,  # [rows, K]: tokens (gate/up) or pairs (down)
    w_ptr,  # [num_experts, N (x2 when UP), K]
    bias_ptr,  # BIAS: [num_experts, N (x2 when UP)]
    scale_ptr,  # SCALED: [num_experts, N (x2 when UP)] fp32, w in e4m3
    ids_ptr,  # [num_pairs] the pairs' experts
    topk_weights_ptr,  # [num_pairs] fp32
    out_ptr,  # [num_pairs, N]
    partials_ptr,  # [NUM_SPLITS, num_pairs, N (x2 when UP)] fp32
    counters_ptr,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_se,
    stride_om,
    stride_ps,
    stride_pp,
    alpha,
    limit,
    A_ROW_DIV: tl.constexpr,
    TOP_K: tl.constexpr,  # pairs a program sums, weighted (down: a token's); else 1
    GATED: tl.constexpr,  # the first projection: store its activation (only with TOP_K 1)
    UP: tl.constexpr,  # GATED with a gated ACT: w holds gate rows then up rows
    ACT: tl.constexpr,  # GATED's activation (kernels/activation.py's moe_gated)
    BIAS: tl.constexpr,
    SCALED: tl.constexpr,  # FP8 w: widened to a's dtype, each pair's columns scaled
    WEIGHTED: tl.constexpr,  # scale each pair by its routing weight
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (output row, BLOCK_N output columns, K split): a row is a pair
    # (gate/up), or a token whose TOP_K pairs it sums (down). A pair's input row is the
    # dot's first of 16 (tl.dot's least); the other rows are zeros.
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, 16)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    k_per_split = tl.cdiv(K, NUM_SPLITS * BLOCK_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = row * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
        w_base = w_ptr + expert * stride_we
        acc_j = tl.zeros([16, BLOCK_N], tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_mask = ks < k_end
            a = tl.load(
                a_row + rows[:, None] * 0 + ks[None, :],
                mask=(rows[:, None] == 0) & k_mask[None, :],
                other=0.0,
            )
            w_mask = k_mask[:, None] & col_mask[None, :]
            w_offs = cols[None, :] * stride_wn + ks[:, None]
            w = tl.load(w_base + w_offs, mask=w_mask, other=0.0).to(a.dtype)
            acc_j = tl.dot(a, w, acc_j, input_precision=DOT_PRECISION)
            if UP:
                w_up = tl.load(w_base + N * stride_wn + w_offs, mask=w_mask, other=0.0)
                acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
        if SCALED:  # per column, so a K split's share may be scaled before the sum
            scale_row = scale_ptr + expert * stride_se
            acc_j *= tl.load(scale_row + cols, mask=col_mask, other=0.0)[None, :]
            if UP:  # (TOP_K is 1: acc_up is this pair's alone)
                acc_up *= tl.load(scale_row + N + cols, mask=col_mask, other=0.0)[None, :]
        if WEIGHTED:
            acc += acc_j * tl.load(topk_weights_ptr + pair)
        else:
            acc += acc_j
    first = tl.sum(tl.where(rows[:, None] == 0, acc, 0.0), 0)  # [BLOCK_N]: the pair's row
    first_up = tl.sum(tl.where(rows[:, None] == 0, acc_up, 0.0), 0)
    if NUM_SPLITS > 1:
        part = partials_ptr + split * stride_ps + row * stride_pp
        tl.store(part + cols, first, mask=col_mask)
        if UP:
            tl.store(part + N + cols, first_up, mask=col_mask)
        # As in kernels/linear.py: the barrier orders every thread's partial stores before
        # the release of the atomic; the last arrival acquires them through it.
        tl.debug_barrier()
        slot = counters_ptr + row * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
        if arrived != NUM_SPLITS - 1:
            return
        tl.debug_barrier()
        first = tl.zeros([BLOCK_N], tl.float32)
        first_up = tl.zeros([BLOCK_N], tl.float32)
        for s in tl.static_range(NUM_SPLITS):  # in split order: deterministic
            part = partials_ptr + s * stride_ps + row * stride_pp
            first += tl.load(part + cols, mask=col_mask, other=0.0)
            if UP:
                first_up += tl.load(part + N + cols, mask=col_mask, other=0.0)
        tl.store(slot, 0)
    if BIAS:
        for j in tl.static_range(TOP_K):
            pair = row * TOP_K + j
            bias_row = bias_ptr + tl.load(ids_ptr + pair).to(tl.int64) * stride_be
            bias = tl.load(bias_row + cols, mask=col_mask, other=0.0).to(tl.float32)
            if WEIGHTED:
                bias = bias * tl.load(topk_weights_ptr + pair)
            first += bias
            if UP:
                first_up += tl.load(bias_row + N + cols, mask=col_mask, other=0.0).to(tl.float32)
    if GATED:
        first = moe_gated(first, first_up, alpha, limit, ACT)
    out = out_ptr + row.to(tl.int64) * stride_om + cols
    tl.store(out, first.to(out_ptr.dtype.element_ty), mask=col_mask)


def _num_splits(num_pairs: int, n_tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Enough K splits for about two waves of programs, each at least two K tiles long
    (a sweep of tiles, splits and warps on an H200: within 5% of the best measured)."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 8
    )
    want = -(-2 * sms // (num_pairs * n_tiles))
    return max(1, min(8, want, k // (2 * block_k)))


def pair_gemv(
    a: torch.Tensor,  # [rows, K]
    w: torch.Tensor,  # [num_experts, N (x2 when gated by a gated act), K]
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,  # FP8 w: [num_experts, N (x2 as w)] fp32
    out: torch.Tensor,  # [num_pairs, N]
    topk_ids: torch.Tensor,  # [num_pairs]
    topk_weights: torch.Tensor,  # [num_pairs] fp32
    a_row_div: int,
    gated: bool,
    act: ExpertAct | None,
    top_k: int = 1,  # > 1: each output row sums its top_k pairs, weighted (down)
    block_n: int = 32,
    block_k: int = 128,
    num_splits: int | None = None,  # None: _num_splits's
    num_warps: int = 4,
) -> None:
    num_rows, n = out.shape
    k = a.shape[1]
    n_tiles = triton.cdiv(n, block_n)
    assert num_rows * n_tiles <= MAX_COUNTERS and not (gated and top_k > 1)
    splits = num_splits or _num_splits(num_rows, n_tiles, k, block_k, a.device)
    if scale is not None and num_splits is None:
        # e4m3 rows: twice the splits, each down to one K tile (a sweep on an H200:
        # 4-7% a layer; the GEMV stays latency bound, not at its halved floor).
        splits = min(16, max(1, k // block_k), 2 * splits)
    up = gated and expert_gated(act)
    width = 2 * n if up else n
    alpha, limit, act_code = expert_act_args(act)
    partials = torch.empty(splits, num_rows, width, dtype=torch.float32, device=a.device)
    _pair_gemv_kernel[(num_rows, n_tiles, splits)](
        a,
        w,
        w if bias is None else bias,
        w if scale is None else scale,
        topk_ids,
        topk_weights,
        out,
        partials,
        _counters(a.device),
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        0 if bias is None else bias.stride(0),
        0 if scale is None else scale.stride(0),
        out.stride(0),
        partials.stride(0),
        partials.stride(1),
        alpha,
        limit,
        A_ROW_DIV=a_row_div,
        TOP_K=top_k,
        GATED=gated,
        UP=up,
        ACT=act_code,
        BIAS=bias is not None,
        SCALED=scale is not None,
        WEIGHTED=not gated,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_SPLITS=splits,
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=num_warps,
        num_stages=3,
    )
