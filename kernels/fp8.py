"""FP8 (e4m3) quantization and the FP8 linear layer: weights per output channel,
activations per token, the GEMM through `torch._scaled_mm` on CUDA.

A value x is stored as q = round(x / scale) in float8_e4m3fn (saturated at +-448) and
read back as q * scale. The torch references run anywhere and are the contract; the
Triton per-token quantizer and `_scaled_mm` are the CUDA path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl, wait_previous

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# Floor on a row's absolute maximum, so an all-zero row gets a finite, nonzero scale.
MIN_AMAX = 1e-12
# Widest row the per-token quantizer holds in registers at once.
ONE_TILE_K = 32768


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """round(x / scale) in e4m3, saturated (a plain cast would turn overflow into NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:  # fp32
    return q.float() * scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight -> (e4m3 [N, K], fp32 scales [N]): one scale per output row."""
    amax = w.float().abs().amax(dim=1).clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    return quantize_fp8_ref(w, scale[:, None]), scale


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (e4m3 [M, K], fp32 scales [M, 1]): one scale per token."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    return quantize_fp8_ref(x, scale), scale


@dataclass(frozen=True)
class Fp8Rows:
    """Activations quantized per token (`quantize_per_token`'s pair) by the kernel that
    produced them: a norm or the gated activation feeding an FP8 projection, which then
    launches no quantizer of its own."""

    q: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M, 1] fp32
    dtype: torch.dtype  # the model dtype the rows were computed in, and the output's


def fp8_rows_linear_ref(
    x: Fp8Rows,
    weight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x.dtype
    """Both sides dequantized, one fp32 matmul, the bias added, cast to x.dtype."""
    out = dequantize_fp8(x.q, x.scale) @ dequantize_fp8(weight, weight_scale[:, None]).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def fp8_linear_ref(
    x: torch.Tensor,  # [M, K] in the model dtype
    weight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """What the CUDA path computes: x quantized per token, then `fp8_rows_linear_ref`."""
    return fp8_rows_linear_ref(
        Fp8Rows(*quantize_per_token_ref(x), x.dtype), weight, weight_scale, bias
    )


# Compiled, the cast to e4m3 rounds by itself (to nearest, ties to even, as torch's);
# Triton's interpreter mis-rounds where the mantissa carries into the exponent, so there
# the value is rounded on its bits first. Read at import, as Triton reads TRITON_INTERPRET
# (the kernel tests reload this module under the interpreter).
CAST_ROUNDS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "0")


@triton.jit
def round_to_fp8(x):
    """fp32 x clamped to +-448 and rounded to nearest (ties to even) in e4m3: torch's
    saturated cast (`quantize_fp8_ref`), on the GPU and in the interpreter alike."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)  # FP8_MAX
    if not CAST_ROUNDS:
        bits = x.to(tl.int32, bitcast=True)
        # Normal e4m3 (|x| >= 2**-6): keep 3 mantissa bits of fp32's 23, ties to even; a
        # carry moves into the exponent as it should.
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # Subnormal e4m3: a fixed step of 2**-9; adding 1.5 * 2**14 rounds to it in fp32.
        # The sign goes back as a bit: -(+0.0) would come out as +0.0 for x = -0.0.
        ax = tl.abs(x)
        sub = ((ax + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -2147483648)
        x = tl.where(ax < 0.015625, sub.to(tl.float32, bitcast=True), normal)
    return x.to(tl.float8e4nv)


@triton.jit
def row_scale(amax):
    """A row's scale from its lanes' absolute maxima, as `quantize_per_token_ref` takes it."""
    return tl.maximum(tl.max(amax, 0), 1e-12) / 448.0  # MIN_AMAX, FP8_MAX


@triton.jit
def quantize_row(x):
    """A whole row in fp32 (masked lanes 0) -> (its values in e4m3, and the row's
    scale): `quantize_per_token_ref` inside a kernel that holds the row."""
    scale = row_scale(tl.abs(x))
    return round_to_fp8(x / scale), scale


@triton.jit
def _per_token_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,  # BLOCK_K >= K: the row is read once, into registers
    PDL: tl.constexpr,
):
    # One program per token: the row's absolute maximum, then the row quantized by it.
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        mask = cols < K
        whole = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        q, scale = quantize_row(whole)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for start in range(0, K, BLOCK_K):
            mask = start + cols < K
            x = tl.load(x_ptr + row * stride_xm + start + cols, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = row_scale(amax)
        tl.store(scale_ptr + row, scale)
        for start in range(0, K, BLOCK_K):
            mask = start + cols < K
            x = tl.load(x_ptr + row * stride_xm + start + cols, mask=mask, other=0.0)
            q = round_to_fp8(x.to(tl.float32) / scale)
            tl.store(
                q_ptr + row * stride_qm + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask
            )


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_per_token_ref`: one launch, no host sync."""
    num_tokens, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(num_tokens, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return q, scale
    # Rows up to ONE_TILE_K wide are held whole (about 32 values a thread): one read of
    # x, no dependent loop; wider ones take two passes of 2048-wide tiles.
    one_tile = triton.next_power_of_2(k) <= ONE_TILE_K
    block_k = triton.next_power_of_2(k) if one_tile else 2048
    warps = max(2, min(32, block_k // 1024)) if one_tile else 4
    # With PDL, as the kernels around it in the decode step: launched as the one before
    # it ends, and the GEMM after it starts its weight reads before it ends.
    pdl = use_pdl(x.device)
    _per_token_quant_kernel[(num_tokens,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        BLOCK_K=block_k,
        ONE_TILE=one_tile,
        PDL=pdl,
        num_warps=warps,
        **launch_options(pdl),
    )
    return q, scale


def scaled_mm_fits(in_features: int, out_features: int) -> bool:
    """`_scaled_mm` wants K and N multiples of 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


def fp8_rows_linear(
    x: Fp8Rows,
    weight: torch.Tensor,  # [N, K] e4m3, contiguous: weight.t() is the column-major B
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x.dtype
    """CUDA version of `fp8_rows_linear_ref`: the GEMM in `_scaled_mm` with row-wise
    scales on both sides (fp32 accumulation)."""
    # Row-wise scaling writes bf16 only; other model dtypes get a cast (and their bias
    # after it, as the bias must match the output dtype).
    fused_bias = bias if x.dtype == torch.bfloat16 else None
    out = torch._scaled_mm(
        x.q,
        weight.t(),
        scale_a=x.scale,
        scale_b=weight_scale.view(1, -1),
        bias=fused_bias,
        out_dtype=torch.bfloat16,
    )
    if x.dtype != torch.bfloat16:
        out = out.to(x.dtype)
        if bias is not None:
            out += bias
    return out


def fp8_linear(
    x: torch.Tensor,  # [M, K] in the model dtype, last dim contiguous
    weight: torch.Tensor,  # [N, K] e4m3, contiguous
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """CUDA version of `fp8_linear_ref`: tokens quantized by the Triton kernel, then
    `fp8_rows_linear`."""
    return fp8_rows_linear(Fp8Rows(*quantize_per_token(x), x.dtype), weight, weight_scale, bias)


def fp8_rows_linear_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The FP8 product the engine uses on `device`: `_scaled_mm` on CUDA, the reference
    elsewhere."""
    return fp8_rows_linear if device.type == "cuda" else fp8_rows_linear_ref


def quantize_per_token_for(
    device: torch.device,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return quantize_per_token if device.type == "cuda" else quantize_per_token_ref


def fp8_supported(device: torch.device) -> bool:
    """FP8 GEMMs and e4m3 conversions need CUDA compute capability 8.9+ (Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_device(device: torch.device) -> None:
    if not fp8_supported(device):
        what = (
            f"compute capability {torch.cuda.get_device_capability(device)}"
            if device.type == "cuda"
            else device.type
        )
        raise ValueError(
            f"FP8 (--quantization fp8, --kv-cache-dtype fp8) needs a CUDA GPU of compute "
            f"capability 8.9+ (Ada, Hopper); this device is {what}"
        )
