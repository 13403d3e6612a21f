"""Rotary embedding of q and k, in place on the qkv GEMM's output, in one launch; with an
optional per-head RMSNorm first (Qwen3's and Gemma 3's q/k norms) in the same launch.

Unfused, a layer's rotation is a gather of cos/sin by position and, per q and per k,
two casts, four multiplies, an add, a subtract and a cat: launch-bound at decode sizes. The
kernel reads each head's two halves where the GEMM wrote them (q and k are column ranges
of its [num_tokens, q_size + 2 * kv_size] output, so rows are strided) and writes the
result back there. Rounding follows the unfused model (transformers' too): cos and sin
are rounded to the activation dtype, and each product and each sum is rounded to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.norms import add_norm_ref
from kernels.pdl import launch_options, use_pdl, wait_previous
from kernels.rounding import round_to

# From this many tokens (a prefill's) the launch takes its narrow programs (`rotary`).
MANY_TOKENS = 1024


@dataclass(frozen=True)
class QKNorm:
    """RMSNorm weights applied to each head of q and of k before the rotation."""

    q_weight: torch.Tensor  # [head_dim], the activation dtype
    k_weight: torch.Tensor  # [head_dim]
    eps: float


@dataclass(frozen=True)
class Rope:
    """A layer's rotation of q and k, handed to its attention: the decode kernel applies
    it itself (kernels/paged_attention.py), the prefill path calls `rotary` first."""

    positions: torch.Tensor  # [num_tokens]
    cos_sin: torch.Tensor  # [max_positions, head_dim] fp32: each frequency's cos, then sin
    norm: QKNorm | None = None


def head_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's vector of x [num_tokens, heads * head_dim]."""
    shape, head_dim = x.shape, weight.shape[0]
    return add_norm_ref(x.reshape(-1, head_dim), None, weight, None, eps, True)[0].view(shape)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (non-interleaved) rotation of x [num_tokens, heads * head_dim] by
    cos, sin [num_tokens, head_dim / 2] (fp32), rounded as transformers rounds it."""
    shape, dtype, half = x.shape, x.dtype, cos.shape[-1]
    x = x.view(shape[0], -1, 2 * half)  # [num_tokens, heads, head_dim]
    cos, sin = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(shape)


def rotary_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    cos_sin: torch.Tensor,  # [max_positions, head_dim] fp32: each frequency's cos, then sin
    norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k), each head RMS-normed first if `norm`, then rotated by its token's position."""
    if norm is not None:
        q = head_rms_norm_ref(q, norm.q_weight, norm.eps)
        k = head_rms_norm_ref(k, norm.k_weight, norm.eps)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [num_tokens, head_dim / 2] each
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    num_heads,
    num_kv_heads,
    stride_q,
    stride_k,
    stride_cos_sin,
    eps,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (token, BLOCK_HEADS heads): the q heads' programs first, then k's.
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups = tl.cdiv(num_heads, BLOCK_HEADS)
    if group < q_groups:
        x_ptr, stride_x, first_head, last_head, norm_ptr = (
            q_ptr, stride_q, group * BLOCK_HEADS, num_heads, q_norm_ptr
        )  # fmt: skip
    else:
        x_ptr, stride_x, first_head, last_head, norm_ptr = (
            k_ptr, stride_k, (group - q_groups) * BLOCK_HEADS, num_kv_heads, k_norm_ptr
        )  # fmt: skip
    dtype = q_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = round_to(tl.load(cos_sin_ptr + position * stride_cos_sin + dims, mask=dim_mask), dtype)
    sin = round_to(
        tl.load(cos_sin_ptr + position * stride_cos_sin + half + dims, mask=dim_mask), dtype
    )
    # The positions (the step's metadata) and the table: the kernel ahead writes neither,
    # so they are read before waiting for it (kernels/pdl.py).
    wait_previous(PDL)

    heads = first_head + tl.arange(0, BLOCK_HEADS)
    mask = (heads < last_head)[:, None] & dim_mask[None, :]
    offs = token * stride_x + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF]
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # As add_norm's RMSNorm: statistics in fp32, normalized value rounded, then scaled.
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(norm_ptr + dims, mask=dim_mask).to(tl.float32)
        w2 = tl.load(norm_ptr + half + dims, mask=dim_mask).to(tl.float32)
        x1 = round_to(round_to(x1 * rstd[:, None], dtype) * w1[None, :], dtype)
        x2 = round_to(round_to(x2 * rstd[:, None], dtype) * w2[None, :], dtype)
    # Each product rounded to the activation dtype, then the sum: as the unfused ops.
    out1 = round_to(x1 * cos[None, :], dtype) - round_to(x2 * sin[None, :], dtype)
    out2 = round_to(x2 * cos[None, :], dtype) + round_to(x1 * sin[None, :], dtype)
    tl.store(x_ptr + offs, round_to(out1, dtype).to(dtype), mask=mask)
    tl.store(x_ptr + offs + half, round_to(out2, dtype).to(dtype), mask=mask)


@triton.jit
def rope_cos_sin(
    position_ptr, cos_sin_ptr, stride_cos_sin, dims, HEAD_DIM: tl.constexpr, dtype: tl.constexpr
):
    """The cos and sin [D] of each element of a head (dims: 0..D-1, D >= HEAD_DIM) at the
    position held at position_ptr, rounded to dtype: element d turns at frequency d mod half."""
    half: tl.constexpr = HEAD_DIM // 2
    freq = tl.where(dims < half, dims, dims - half)
    mask = dims < HEAD_DIM
    row = cos_sin_ptr + tl.load(position_ptr).to(tl.int64) * stride_cos_sin
    cos = round_to(tl.load(row + freq, mask=mask, other=0.0), dtype)
    sin = round_to(tl.load(row + half + freq, mask=mask, other=0.0), dtype)
    return cos, sin


@triton.jit
def rope_load(
    heads_ptr, dims, mask, norm_ptr, cos, sin, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """Whole heads loaded [rows, D] (heads_ptr [rows, 1]: where each starts) and rotated
    by cos/sin (rope_cos_sin), RMS-normed first with HAS_NORM: _rotary_kernel's math and
    rounding on whole heads (zeros past HEAD_DIM), in the heads' dtype."""
    dtype = heads_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    first_half = dims < half
    partner = tl.where(first_half, dims + half, dims - half)  # the element it turns with
    x = tl.load(heads_ptr + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(heads_ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        dim_mask = dims < HEAD_DIM
        w = tl.load(norm_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
        w_partner = tl.load(norm_ptr + partner, mask=dim_mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = round_to(round_to(x * rstd, dtype) * w[None, :], dtype)
        x_partner = round_to(round_to(x_partner * rstd, dtype) * w_partner[None, :], dtype)
    turned = round_to(x * cos[None, :], dtype)
    crossed = round_to(x_partner * sin[None, :], dtype)
    out = tl.where(first_half[None, :], turned - crossed, turned + crossed)
    return round_to(out, dtype).to(dtype)


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rotary_ref`: rotates q and k in place (rows may be strided, as
    column ranges of one qkv tensor are) and returns them. One launch, no allocation."""
    num_tokens, head_dim = q.shape[0], cos_sin.shape[1]
    assert q.stride(1) == 1 and k.stride(1) == 1 and q.dtype == k.dtype
    assert cos_sin.is_contiguous() and cos_sin.dtype == torch.float32
    assert q.shape[1] % head_dim == 0 and k.shape[1] % head_dim == 0 and head_dim % 2 == 0
    assert norm is None or norm.q_weight.dtype == norm.k_weight.dtype == q.dtype
    if num_tokens == 0:
        return q, k
    num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    block_half = triton.next_power_of_2(head_dim // 2)
    # About 1K elements (both halves) per program on 4 warps, so that even one decode
    # token's heads spread over several SMs; MANY_TOKENS fill the GPU with programs
    # anyway, and there up to 8 heads on one warp measured faster.
    many = num_tokens >= MANY_TOKENS
    block_heads = min(
        triton.next_power_of_2(max(num_heads, num_kv_heads)),
        max(1, 512 // block_half),
        8 if many else 1 << 30,
    )
    groups = triton.cdiv(num_heads, block_heads) + triton.cdiv(num_kv_heads, block_heads)
    pdl = use_pdl(q.device)
    _rotary_kernel[(num_tokens, groups)](
        positions,
        q,
        k,
        cos_sin,
        q if norm is None else norm.q_weight,
        k if norm is None else norm.k_weight,
        num_heads,
        num_kv_heads,
        q.stride(0),
        k.stride(0),
        cos_sin.stride(0),
        0.0 if norm is None else norm.eps,
        HAS_NORM=norm is not None,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        PDL=pdl,
        num_warps=1 if many else 4,
        # No multiply-add contraction: in fp32 an FMA would round x1*cos - x2*sin once
        # where the unfused ops round three times.
        enable_fp_fusion=False,
        **launch_options(pdl),
    )
    return q, k


def rotary_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The rotary the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return rotary if device.type == "cuda" else rotary_ref
