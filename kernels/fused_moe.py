"""Mixture-of-experts MLP: top-k routing, then each token through its k experts' MLPs:
gated by SiLU (Qwen3-MoE, Mixtral), GPT-OSS's clamped SwiGLU or Gemma 4's GeGLU, or
Nemotron 3's ungated relu^2, with expert biases where the model has them. Experts may be
FP8 (`ExpertScales`): e4m3 weights with one scale per expert and output row, widened to
the activations' dtype in registers (weight-only, as decode reads little else) and
scaled once after the dot, in the per-pair GEMVs; the grouped GEMMs quantize their rows
per token too and take e4m3 dots (W8A8), as the dense FP8 projections do.

The Triton path groups the (token, expert) pairs by expert (kernels/moe_align.py): the
pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so
every BLOCK_M-row tile belongs to one expert. Two launches of one grouped-GEMM kernel then
do the work: gate/up with the activation fused into the epilogue, and down with the routing
weight fused. Every shape is a function of the token count, top-k and expert count only, and
nothing is read back to the host, so a CUDA graph can capture the whole layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import ExpertAct, expert_act_args, expert_gated, moe_gated
from kernels.fp8 import dequantize_fp8, quantize_per_token, quantize_per_token_ref
from kernels.moe_align import align_by_expert
from kernels.moe_gemv import MAX_PAIRS, pair_gemv
from kernels.paged_attention import dot_precision


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,  # divide the top-k probabilities by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] fp32, ids [num_tokens, top_k]
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class ExpertBiases:
    """Per-expert biases of both projections (GPT-OSS): b13 [num_experts, 2 * inter] (gate,
    then up, as w13's rows; inter for ungated experts), b2 [num_experts, hidden]."""

    b13: torch.Tensor
    b2: torch.Tensor


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts: w13 and w2 hold e4m3 values, each (expert, output row) times its fp32
    scale: s13 [num_experts, 2 * inter], s2 [num_experts, hidden]."""

    s13: torch.Tensor
    s2: torch.Tensor


def fused_moe_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up (or inter rows)
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    biases: ExpertBiases | None = None,
    act: ExpertAct | None = None,  # None: silu(gate) * up
    scales: ExpertScales | None = None,  # FP8 experts
    w8a8: bool = False,  # with scales: x and each pair's h quantized per row too
) -> torch.Tensor:  # [num_tokens, hidden]
    """sum_k weight[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]; for
    ungated experts (Relu2) down_e(act(up_e(x_t)))."""
    if w8a8:
        x = _round_trip(x)
    if scales is not None:
        w13 = dequantize_fp8(w13, scales.s13[..., None]).to(x.dtype)
        w2 = dequantize_fp8(w2, scales.s2[..., None]).to(x.dtype)
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    for expert in flat_ids.unique().tolist():
        pairs = (flat_ids == expert).nonzero()[:, 0]  # this expert's (token, k) pairs
        tokens = token_of[pairs]
        b13, b2 = (None, None) if biases is None else (biases.b13[expert], biases.b2[expert])
        rows = F.linear(x[tokens], w13[expert], b13)
        if not expert_gated(act):
            h = act(rows)
        else:
            gate, up = rows.chunk(2, dim=-1)
            h = F.silu(gate) * up if act is None else act(gate, up)
        if w8a8:
            h = _round_trip(h)
        y = F.linear(h, w2[expert], b2)
        weight = topk_weights.flatten()[pairs, None].to(x.dtype)
        out.index_add_(0, tokens, y * weight)
    return out


def _round_trip(rows: torch.Tensor) -> torch.Tensor:
    """Rows as the W8A8 path's dots see them: quantized per row, read back."""
    q, scale = quantize_per_token_ref(rows)
    return dequantize_fp8(q, scale).to(rows.dtype)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: tokens (gate/up) or (token, k) pairs (down)
    w_ptr,  # [num_experts, N (x2 when UP), K]
    bias_ptr,  # BIAS: [num_experts, N (x2 when UP)]
    scale_ptr,  # SCALED: [num_experts, N (x2 when UP)] fp32, w in e4m3
    a_scale_ptr,  # SCALED: [rows of a] fp32, a in e4m3
    out_ptr,  # [num_pairs, N], row = pair index
    topk_weights_ptr,  # [num_pairs] fp32
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_se,
    stride_om,
    alpha,  # ACT 1: the clamped SwiGLU's sigmoid gain
    limit,  # ACT 1: its clamp
    A_ROW_DIV: tl.constexpr,  # a's row of a pair: pair // A_ROW_DIV (top_k for x, 1 for pairs)
    GATED: tl.constexpr,  # the first projection: store its activation (moe_gated)
    UP: tl.constexpr,  # GATED with a gated ACT: w holds gate rows then up rows
    ACT: tl.constexpr,  # GATED's activation (kernels/activation.py's moe_gated)
    BIAS: tl.constexpr,  # add the expert's bias row before the activation / the weight
    SCALED: tl.constexpr,  # a and w in e4m3: e4m3 dots, then a's rows and w's columns scaled
    MUL_WEIGHT: tl.constexpr,  # scale each row by its routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (row tile, column tile); a row tile holds one expert's pairs.
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tile_m = pid // num_n_tiles
    tile_n = pid % num_n_tiles
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a spare tile of the static grid
    pair = tl.load(sorted_ids_ptr + tile_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs  # padding rows hold num_pairs
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + tile_m).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if SCALED:
            # Each K tile's e4m3 product summed into acc in fp32: Hopper's e4m3 dots
            # accumulate in less than fp32 when chained along K (as split-K's sums are).
            acc += tl.dot(a, w)
        else:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        if UP:
            w_up = tl.load(
                w_base + (N + cols)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0
            )
            if SCALED:
                acc_up += tl.dot(a, w_up)
            else:
                acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
    if SCALED:
        a_scale = tl.load(a_scale_ptr + a_rows, mask=row_mask, other=0.0)[:, None]
        acc *= a_scale
        acc_up *= a_scale
        scale_row = scale_ptr + expert * stride_se
        acc *= tl.load(scale_row + cols, mask=col_mask, other=0.0)[None, :]
        if UP:
            acc_up *= tl.load(scale_row + N + cols, mask=col_mask, other=0.0)[None, :]
    if BIAS:
        bias_row = bias_ptr + expert * stride_be
        acc += tl.load(bias_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if UP:
            up_bias = tl.load(bias_row + N + cols, mask=col_mask, other=0.0)
            acc_up += up_bias.to(tl.float32)[None, :]
    if GATED:
        acc = moe_gated(acc, acc_up, alpha, limit, ACT)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0)[:, None]
    out_offs = pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class MoeConfig:
    """Launch config of both grouped GEMMs; a function of shapes only (CUDA-graph safe)."""

    block_m: int  # rows (pairs of one expert) per tile
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def moe_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Row tiles about as tall as an expert's run of pairs: every expert's run is padded
    to a whole tile, and an e4m3 weight tile is widened once per row tile, so taller tiles
    than the runs cost dots and conversions on padding. Short row tiles take K tiles of
    128. Measured on an H200 over DeepSeek-V2-Lite's, Qwen3-30B-A3B's and gpt-oss-20b's
    MoE layers at 16-256 tokens under uniform routing, bf16 and FP8 (moe-tiles-h200.json, in git history):
    the best or within 1% of it at every shape, for both."""
    per_expert = num_pairs / num_experts
    if per_expert <= 12:
        return MoeConfig(block_m=16, block_k=128)
    if per_expert <= 24:
        return MoeConfig(block_m=32, block_k=128)
    return MoeConfig(block_m=64)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,  # [num_experts, rows of w], contiguous
    scale: torch.Tensor | None,  # e4m3 w: [num_experts, rows of w] fp32, contiguous
    a_scale: torch.Tensor | None,  # e4m3 a (with scale): [rows of a] fp32, contiguous
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    gated: bool,
    act: ExpertAct | None,
    config: MoeConfig,
) -> None:
    assert (scale is None) == (a_scale is None), "e4m3 a and w together"
    alpha, limit, act_code = expert_act_args(act)
    sorted_ids, expert_ids, num_padded = aligned
    n = out.shape[1]
    grid = (expert_ids.shape[0] * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        w,
        w if bias is None else bias,  # a placeholder without biases (BIAS=False)
        w if scale is None else scale,
        w if a_scale is None else a_scale,
        out,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_padded,
        out.shape[0],
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        0 if bias is None else bias.stride(0),
        0 if scale is None else scale.stride(0),
        out.stride(0),
        alpha,
        limit,
        A_ROW_DIV=a_row_div,
        GATED=gated,
        UP=gated and expert_gated(act),
        ACT=act_code,
        BIAS=bias is not None,
        SCALED=scale is not None,
        MUL_WEIGHT=not gated,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden], contiguous
    w13: torch.Tensor,  # [num_experts, 2 * inter (inter: ungated), hidden], contiguous
    w2: torch.Tensor,  # [num_experts, hidden, inter], contiguous
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    biases: ExpertBiases | None = None,  # contiguous
    act: ExpertAct | None = None,
    scales: ExpertScales | None = None,  # FP8 experts; contiguous
    config: MoeConfig | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Triton version of `fused_moe_ref`: up to MAX_PAIRS (token, expert) pairs, a
    GEMV per pair (kernels/moe_gemv.py); more, align by expert, then two grouped GEMMs."""
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    num_pairs = num_tokens * top_k
    weights = topk_weights.float().contiguous().view(-1)  # [num_pairs]
    b13, b2 = (None, None) if biases is None else (biases.b13, biases.b2)
    s13, s2 = (None, None) if scales is None else (scales.s13, scales.s2)
    if config is None and num_pairs <= MAX_PAIRS:  # decode: a GEMV per pair, no sort
        ids = topk_ids.contiguous().view(-1)
        h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        pair_gemv(x, w13, b13, s13, h, ids, weights, top_k, True, act)
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
        pair_gemv(h, w2, b2, s2, out, ids, weights, 1, False, None, top_k=top_k)
        return out
    if config is None:
        config = moe_config(num_pairs, num_experts)
    aligned = align_by_expert(topk_ids, num_experts, config.block_m)
    # FP8 experts take e4m3 dots here, their rows quantized per token: a widened weight
    # tile would cost its conversions again in every row tile of the expert's run.
    w8a8 = scales is not None
    a, a_scale = quantize_per_token(x) if w8a8 else (x, None)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(a, w13, b13, s13, a_scale, h, weights, aligned, top_k, True, act, config)
    a, a_scale = quantize_per_token(h) if w8a8 else (h, None)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(a, w2, b2, s2, a_scale, y, weights, aligned, 1, False, None, config)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The MoE the engine uses on `device`: Triton on CUDA, the reference elsewhere."""
    return fused_moe if device.type == "cuda" else fused_moe_ref
