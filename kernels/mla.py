"""Multi-head latent attention's expansion into the paged cache's layout
(engine/models/deepseek.py): each head's K from its k_nope and the token's one rotary
key, and its V padded to K's width, in one launch instead of half a dozen copies.

K's dims are laid out for the kernels' partial rotation, pairs at j and j + D / 2:
[pe first half | nope's first D / 2 - rope / 2 | pe second half | the rest of nope]."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl, wait_previous


def mla_expand_ref(
    kv: torch.Tensor,  # [n, heads, nope + v_dim]: kv_b_proj's output, each head's k_nope, v
    pe: torch.Tensor,  # [n, rope]: the token's rotary key, its pairs' halves in order
    nope: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # K and V, each [n, heads, nope + rope]
    n, heads, _ = kv.shape
    rope = pe.shape[1]
    dim, half, half_rope = nope + rope, (nope + rope) // 2, rope // 2
    cut = half - half_rope
    k = torch.empty(n, heads, dim, dtype=kv.dtype, device=kv.device)
    k[:, :, :half_rope] = pe[:, None, :half_rope]
    k[:, :, half_rope:half] = kv[:, :, :cut]
    k[:, :, half : half + half_rope] = pe[:, None, half_rope:]
    k[:, :, half + half_rope :] = kv[:, :, cut:nope]
    v = torch.nn.functional.pad(kv[:, :, nope:], (0, dim - (kv.shape[2] - nope)))
    return k, v


@triton.jit
def _mla_expand_kernel(
    kv_ptr,
    pe_ptr,
    k_ptr,
    v_ptr,
    stride_kv_token,
    stride_kv_head,
    stride_pe,
    heads,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    V_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    token, head = tl.program_id(0), tl.program_id(1)
    DIM: tl.constexpr = NOPE + ROPE
    HALF: tl.constexpr = DIM // 2
    HALF_ROPE: tl.constexpr = ROPE // 2
    d = tl.arange(0, DIM_P2)
    in_dim = d < DIM
    j = tl.where(d < HALF, d, d - HALF)  # the slot within its half
    is_pe = j < HALF_ROPE
    pe_dim = tl.where(d < HALF, j, j + HALF_ROPE)
    nope_dim = tl.where(d < HALF, j - HALF_ROPE, j + HALF - 2 * HALF_ROPE)
    row = kv_ptr + token.to(tl.int64) * stride_kv_token + head * stride_kv_head
    from_pe = tl.load(pe_ptr + token.to(tl.int64) * stride_pe + pe_dim, mask=in_dim & is_pe)
    from_nope = tl.load(row + nope_dim, mask=in_dim & ~is_pe)
    out = (token.to(tl.int64) * heads + head) * DIM + d
    tl.store(k_ptr + out, tl.where(is_pe, from_pe, from_nope), mask=in_dim)
    v = tl.load(row + NOPE + d, mask=d < V_DIM, other=0.0)
    tl.store(v_ptr + out, v, mask=in_dim)


def mla_expand(kv: torch.Tensor, pe: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `mla_expand_ref` (kv's and pe's last dims contiguous)."""
    n, heads, width = kv.shape
    rope = pe.shape[1]
    assert kv.stride(2) == 1 and pe.stride(1) == 1 and width - nope <= nope + rope
    k = torch.empty(n, heads, nope + rope, dtype=kv.dtype, device=kv.device)
    v = torch.empty_like(k)
    if n == 0:
        return k, v
    pdl = use_pdl(kv.device)
    _mla_expand_kernel[(n, heads)](
        kv,
        pe,
        k,
        v,
        kv.stride(0),
        kv.stride(1),
        pe.stride(0),
        heads,
        NOPE=nope,
        ROPE=rope,
        V_DIM=width - nope,
        DIM_P2=triton.next_power_of_2(nope + rope),
        PDL=pdl,
        **launch_options(pdl),
    )
    return k, v


def mla_expand_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Triton on CUDA, the reference elsewhere."""
    return mla_expand if device.type == "cuda" else mla_expand_ref
