"""Residual add + normalization in one launch (LayerNorm for GPT-2, RMSNorm for Llama).

Every sublayer's output is added to the residual stream and normalized for
the next sublayer. At decode batch sizes both are tiny, launch-bound kernels,
so they are fused, as vLLM fuses them. Rounding follows the unfused model:
the sum is rounded to the activation dtype (as `x + residual` is) and the
statistics are computed in fp32. A norm feeding an FP8 projection can also quantize
its output per token (`Fp8Rows`), bit for bit what the quantizer launch would make of it.
The sublayer's output may come as a split-K projection's unsummed splits
(`SplitKPartials`): the sum, rounded as the projection would round it, is made here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, Fp8Rows, quantize_per_token_ref, quantize_row
from kernels.pdl import launch_options, use_pdl, wait_previous
from kernels.splits import SplitKPartials, summed


def add_norm_ref(
    x: torch.Tensor | SplitKPartials,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the residual stream
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor | None,  # [hidden]; LayerNorm only
    eps: float,
    rms: bool,
    fp8_out: bool = False,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """(norm(x + residual), x + residual); with fp8_out the norm quantized per token."""
    x = summed(x)
    if residual is not None:
        x = x + residual
    if rms:  # as HF Llama: normalize in fp32, cast back, then scale
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)
    else:
        out = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if fp8_out:
        return Fp8Rows(*quantize_per_token_ref(out), out.dtype), x
    return out, x


@triton.jit
def _add_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    residual_out_ptr,
    scale_ptr,
    num_cols,
    eps,
    stride_x,
    stride_residual,
    stride_part,
    PARTS: tl.constexpr,  # x is a projection's PARTS fp32 splits, stride_part apart, to sum
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
    FP8_OUT: tl.constexpr,  # out is e4m3, scale_ptr the rows' scales (quantize_per_token's)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per token: the whole hidden vector in one tile.
    dtype = residual_out_ptr.dtype.element_ty  # the model's (x's, unless x is splits)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, PARTS):  # in split order, as the projection sums them
        x += tl.load(x_ptr + part * stride_part + row * stride_x + cols, mask=mask, other=0.0)
    if PARTS > 1:
        x = x.to(dtype).to(tl.float32)  # the projection's output, rounded as it stores it
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * num_cols + cols, x, mask=mask)
        x = x.to(tl.float32)
    if RMS:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
        y = (x * rstd).to(dtype).to(tl.float32) * weight
    else:
        mean = tl.sum(x, axis=0) / num_cols
        centered = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / num_cols + eps)
        y = centered * rstd * weight
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8_OUT:
        # The quantizer reads the norm as stored in the model dtype, hence the rounding.
        y, scale = quantize_row(tl.where(mask, y.to(dtype).to(tl.float32), 0.0))
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * num_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_norm(
    x: torch.Tensor | SplitKPartials,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    fp8_out: bool = False,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """Triton version of `add_norm_ref` (rows with a contiguous last dim)."""
    if residual is None:  # x is the residual stream, which must be a tensor
        x = summed(x)
    parts = x.partials if isinstance(x, SplitKPartials) else x.unsqueeze(0)
    num_tokens, hidden = x.shape
    dtype = x.dtype
    assert parts.stride(2) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty(
        num_tokens, hidden, dtype=FP8_DTYPE if fp8_out else dtype, device=parts.device
    )
    # Without fp8_out the kernel never reads scale_ptr (FP8_OUT compiles it out).
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=parts.device) if fp8_out else out
    residual_out = x if residual is None else torch.empty_like(out, dtype=dtype)
    result = Fp8Rows(out, scale, dtype) if fp8_out else out
    if num_tokens == 0:
        return result, residual_out
    block = triton.next_power_of_2(hidden)
    pdl = use_pdl(parts.device)
    _add_norm_kernel[(num_tokens,)](
        parts,
        parts if residual is None else residual,
        weight,
        weight if bias is None else bias,
        out,
        residual_out,
        scale,
        hidden,
        eps,
        parts.stride(1),
        0 if residual is None else residual.stride(0),
        parts.stride(0),
        PARTS=parts.shape[0],
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        RMS=rms,
        FP8_OUT=fp8_out,
        BLOCK=block,
        PDL=pdl,
        # About 8 elements per thread: 768 or 896 wide rows take 4 warps.
        num_warps=min(16, max(1, block // 256)),
        **launch_options(pdl),
    )
    return result, residual_out


def add_norm_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The fused norm the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return add_norm if device.type == "cuda" else add_norm_ref
