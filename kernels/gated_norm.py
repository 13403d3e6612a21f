"""The recurrent layers' gated RMSNorm in one launch: Gated DeltaNet's (normalize each
head's output, then scale by silu of its gate) and Mamba-2's (gate first, then
normalize each group of heads). In torch either is about eight elementwise launches a
layer; here one program takes one row's group, rounding where transformers rounds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl, wait_previous


def gated_rms_norm_ref(
    x: torch.Tensor,  # [rows, width] in the model dtype
    gate: torch.Tensor,  # [rows, width]
    weight: torch.Tensor,  # [group] (one for every group) or [width]
    eps: float,
    group: int,  # columns normalized together
    norm_first: bool,  # the DeltaNet's order (normalize, then gate); else Mamba-2's
) -> torch.Tensor:  # [rows, width] in x's dtype
    rows, width = x.shape
    weight = weight.repeat(width // len(weight))
    if norm_first:
        xf = x.float().view(rows, -1, group)
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (weight * normed.view(rows, width) * F.silu(gate.float())).to(x.dtype)
    h = (x.float() * F.silu(gate.float())).view(rows, -1, group)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.view(rows, width).to(x.dtype)


@triton.jit
def _gated_norm_kernel(
    x_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_gate,
    weight_per_group,  # 0: one weight for every group; else `group`
    group,
    eps,
    NORM_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row, g = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    live = cols < group
    w = tl.load(weight_ptr + g * weight_per_group + cols, mask=live, other=0.0)
    wait_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + g * group + cols, mask=live, other=0.0)
    z = tl.load(gate_ptr + row * stride_gate + g * group + cols, mask=live, other=0.0)
    dtype = x.dtype
    z = z.to(tl.float32)
    silu = z / (1.0 + tl.exp(-z))
    if NORM_FIRST:
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / group + eps)
        scaled = (w.to(tl.float32) * (xf * r).to(dtype).to(tl.float32)).to(dtype)
        out = scaled.to(tl.float32) * silu
    else:
        h = x.to(tl.float32) * silu
        r = tl.rsqrt(tl.sum(h * h, axis=0) / group + eps)
        out = w.to(tl.float32) * (h * r).to(dtype).to(tl.float32)
    tl.store(
        out_ptr + row * group * tl.num_programs(1) + g * group + cols, out.to(dtype), mask=live
    )


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: int,
    norm_first: bool,
) -> torch.Tensor:
    """Triton version of `gated_rms_norm_ref`."""
    rows, width = x.shape
    assert x.stride(1) == gate.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(group)
    pdl = use_pdl(x.device)
    _gated_norm_kernel[(rows, width // group)](
        x,
        gate,
        weight,
        out,
        x.stride(0),
        gate.stride(0),
        0 if len(weight) == group else group,
        group,
        eps,
        NORM_FIRST=norm_first,
        BLOCK=block,
        PDL=pdl,
        num_warps=min(16, max(1, block // 256)),
        **launch_options(pdl),
    )
    return out


def gated_rms_norm_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The norm the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return gated_rms_norm if device.type == "cuda" else gated_rms_norm_ref
