"""MLA's latent cache rows (kernels/mla.py): [c | k_pe] written at each new token's slot.

A prefill step stores the rows the model has normed and rotated (`mla_store`, one
launch). A decode step hands the attention kernel its raw rows instead (`LatentRows`):
the program that reads a sequence's last key norms c (kv_a_layernorm), rotates k_pe and
stores the row before it attends, and every program rotates the q_pe it reads, as decode
attention does with K and V (kernels/paged_attention.py). That is three launches a layer
fewer: the norm, the rotary and the store. An FP8 (e4m3) cache holds the row / kv_scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, round_to_fp8
from kernels.kv_store import to_cache
from kernels.norms import add_norm_ref
from kernels.pdl import launch_options, use_pdl, wait_previous
from kernels.rotary import Rope, rope_load, rotary_ref


@dataclass(frozen=True)
class LatentRows:
    """A decode step's new latent rows as kv_a_proj_with_mqa made them, for the attention
    kernel to norm, rotate and store (`mla_attention(new=...)`)."""

    latent: torch.Tensor  # [n, latent + rope]: c then k_pe, neither normed nor rotated
    norm_weight: torch.Tensor  # [latent], kv_a_layernorm's (an RMSNorm)
    eps: float
    rope: Rope  # each row's position, and cos/sin [max_positions, rope]
    slot_mapping: torch.Tensor  # [n] int; < 0 = padding, not stored


def mla_store_ref(
    c: torch.Tensor,  # [n, latent], rows may be strided
    k_pe: torch.Tensor,  # [n, rope]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope]
    slot_mapping: torch.Tensor,  # [n] int; < 0 = padding, not stored
    kv_scale: float = 1.0,  # FP8 cache only: it holds the row / kv_scale
) -> None:
    valid = slot_mapping >= 0
    rows = to_cache(torch.cat([c[valid], k_pe[valid]], dim=-1), cache, kv_scale)
    cache.view(-1, cache.shape[-1])[slot_mapping[valid].long()] = rows


def finish_rows_ref(
    q_pe: torch.Tensor, new: LatentRows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_pe rotated, c normed, k_pe rotated): what the model's norm and rotary make of
    q_pe [n, heads, rope] and the raw rows, in the same ops."""
    n, latent = q_pe.shape[0], new.norm_weight.shape[0]
    c = add_norm_ref(new.latent[:, :latent], None, new.norm_weight, None, new.eps, True)[0]
    q, k_pe = rotary_ref(
        new.rope.positions, q_pe.reshape(n, -1), new.latent[:, latent:], new.rope.cos_sin
    )
    return q.view(q_pe.shape), c, k_pe


@triton.jit
def store_row(
    row_ptr, c, pe, d, e, scale_inv, LATENT: tl.constexpr, ROPE: tl.constexpr, KV_FP8: tl.constexpr
):
    """One cache row (row_ptr: its slot's first value): c [d] then pe [e], masked to their
    widths; into an e4m3 cache divided by kv_scale and rounded."""
    if KV_FP8:
        c = round_to_fp8(c.to(tl.float32) * scale_inv)
        pe = round_to_fp8(pe.to(tl.float32) * scale_inv)
    tl.store(row_ptr + d, c.to(row_ptr.dtype.element_ty), mask=d < LATENT)
    tl.store(row_ptr + LATENT + e, pe.to(row_ptr.dtype.element_ty), mask=e < ROPE)


@triton.jit
def finish_row(
    latent_ptr,
    norm_ptr,
    eps,
    cos,
    sin,
    d,
    e,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
):
    """A raw row's c RMS-normed (add_norm's math and rounding) and k_pe rotated by cos/sin
    (rope_cos_sin's, rope_load's math), both in the row's dtype: [d] and [e]."""
    dtype = latent_ptr.dtype.element_ty
    x = tl.load(latent_ptr + d, mask=d < LATENT, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / LATENT + eps)
    w = tl.load(norm_ptr + d, mask=d < LATENT, other=0.0).to(tl.float32)
    c = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype)
    pe_row = latent_ptr + LATENT + tl.zeros([1, 1], tl.int32)  # one head: [1, ROPE_P2] out
    pe = rope_load(pe_row, e, (e < ROPE)[None, :], norm_ptr, cos, sin, eps, False, ROPE)
    return c, tl.reshape(pe, (ROPE_P2,))


@triton.jit
def _mla_store_kernel(
    c_ptr,
    pe_ptr,
    cache_ptr,
    slot_mapping_ptr,
    scale_inv,  # FP8 cache: 1 / kv_scale
    stride_c,
    stride_pe,
    LATENT: tl.constexpr,
    LATENT_P2: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # metadata: before the wait
    wait_previous(PDL)
    if slot >= 0:
        d = tl.arange(0, LATENT_P2)
        e = tl.arange(0, ROPE_P2)
        c = tl.load(c_ptr + token * stride_c + d, mask=d < LATENT)
        pe = tl.load(pe_ptr + token * stride_pe + e, mask=e < ROPE)
        # The cache is contiguous, one row a slot.
        store_row(cache_ptr + slot * (LATENT + ROPE), c, pe, d, e, scale_inv, LATENT, ROPE, KV_FP8)


def mla_store(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """Triton version of `mla_store_ref` (c's and k_pe's last dims contiguous): one launch."""
    n, latent = c.shape
    rope = k_pe.shape[1]
    assert c.stride(1) == 1 and k_pe.stride(1) == 1 and cache.is_contiguous()
    assert cache.shape[-1] == latent + rope
    if n == 0:
        return
    pdl = use_pdl(c.device)
    _mla_store_kernel[(n,)](
        c,
        k_pe,
        cache,
        slot_mapping,
        1.0 / kv_scale,
        c.stride(0),
        k_pe.stride(0),
        LATENT=latent,
        LATENT_P2=triton.next_power_of_2(latent),
        ROPE=rope,
        ROPE_P2=triton.next_power_of_2(rope),
        KV_FP8=cache.dtype == FP8_DTYPE,
        PDL=pdl,
        **launch_options(pdl),
    )


def mla_store_for(device: torch.device) -> Callable[..., None]:
    """Triton on CUDA, the reference elsewhere."""
    return mla_store if device.type == "cuda" else mla_store_ref
