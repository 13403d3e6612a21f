"""Gated MLP activation in one launch: act(gate) * up over the gate_up GEMM's output.

Unfused, SwiGLU (Llama) and GeGLU (Gemma) are two elementwise kernels per layer, the
activation and the multiply, with an intermediate written and read back. Rounding
follows the unfused ops: the activation is computed in fp32 and rounded to the
activation dtype, then the product is rounded. Feeding an FP8 projection, the kernel
can also quantize its rows per token (`Fp8Rows`), as the quantizer launch would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, Fp8Rows, quantize_per_token, quantize_per_token_ref, quantize_row
from kernels.pdl import launch_options, use_pdl, wait_previous
from kernels.rounding import round_to

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


# Widest row quantized inside the kernel: one program holds it whole (32 warps, ~32
# values a thread); wider rows take the quantizer launch after.
FP8_ONE_TILE = 16384


def act_and_mul_ref(
    x: torch.Tensor, activation: str, fp8_out: bool = False
) -> torch.Tensor | Fp8Rows:
    """x [num_tokens, 2 * inter] (gate columns, then up) -> act(gate) * up [num_tokens, inter];
    with fp8_out, quantized per token."""
    gate, up = x.chunk(2, dim=-1)
    out = ACTIVATIONS[activation](gate) * up
    return Fp8Rows(*quantize_per_token_ref(out), out.dtype) if fp8_out else out


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
    with g = min(gate, limit), in place of silu(gate) * up."""

    alpha: float
    limit: float
    CODE: ClassVar[int] = 1  # moe_gated's ACT
    GATED: ClassVar[bool] = True  # w13 holds gate rows, then up rows

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


@dataclass(frozen=True)
class GeluTanhGLU:
    """Gemma 4's expert activation: gelu_tanh(gate) * up, in place of silu(gate) * up."""

    alpha: ClassVar[float] = 1.0  # unused
    limit: ClassVar[float] = 0.0
    CODE: ClassVar[int] = 2
    GATED: ClassVar[bool] = True

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up


@dataclass(frozen=True)
class Relu2:
    """Nemotron 3's expert activation: relu(x)^2 of one projection, no gate (w13 holds
    its rows alone, `inter` of them)."""

    alpha: ClassVar[float] = 1.0  # unused
    limit: ClassVar[float] = 0.0
    CODE: ClassVar[int] = 3
    GATED: ClassVar[bool] = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


ExpertAct = ClampedSwiGLU | GeluTanhGLU | Relu2  # None: silu(gate) * up


def expert_act_args(act: ExpertAct | None) -> tuple[float, float, int]:
    """The MoE kernels' (alpha, limit, ACT) for an expert activation (see moe_gated). By
    its CODE, not its class: the kernel tests reload this module under the interpreter,
    after the models have taken its classes."""
    return (1.0, 0.0, 0) if act is None else (act.alpha, act.limit, act.CODE)


def expert_gated(act: ExpertAct | None) -> bool:
    """Whether the experts' first projection holds gate and up rows (2 * inter), or one
    projection's (inter: Relu2's)."""
    return act is None or act.GATED


@triton.jit
def gelu_tanh(x):
    # torch's form, 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3): where
    # tanh(u) nears -1 the sum cancels, and the result is as coarse as torch's.
    inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
    e = tl.exp(-2.0 * tl.abs(inner))
    tanh = (1.0 - e) / (1.0 + e)
    tanh = tl.where(inner < 0, -tanh, tanh)
    return 0.5 * x * (1.0 + tanh)


@triton.jit
def moe_gated(gate, up, alpha, limit, ACT: tl.constexpr):
    # The MoE kernels' activation on fp32 tiles, by ACT (expert_act_args): 0 silu(gate) *
    # up, 1 GPT-OSS's clamped SwiGLU, 2 gelu_tanh(gate) * up, 3 relu(gate)^2 (no up).
    if ACT == 3:
        gate = tl.maximum(gate, 0.0)
        return gate * gate
    if ACT == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    if ACT == 2:
        return gelu_tanh(gate) * up
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    inter,
    stride_x,
    GELU_TANH: tl.constexpr,
    FP8_OUT: tl.constexpr,  # out is e4m3, scale_ptr the rows' scales; BLOCK >= inter
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (token, BLOCK output columns).
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        act = gelu_tanh(gate)
    else:
        act = gate / (1.0 + tl.exp(-gate))
    out = round_to(round_to(act, dtype) * up, dtype)
    if FP8_OUT:
        out, scale = quantize_row(tl.where(mask, out, 0.0))
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str, fp8_out: bool = False) -> torch.Tensor | Fp8Rows:
    """Triton version of `act_and_mul_ref` (rows may be strided; columns contiguous)."""
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    assert activation in ACTIVATIONS
    one_tile = triton.next_power_of_2(inter)
    if fp8_out and one_tile > FP8_ONE_TILE:
        out = act_and_mul(x, activation)
        return Fp8Rows(*quantize_per_token(out), x.dtype)
    out = torch.empty(num_tokens, inter, dtype=FP8_DTYPE if fp8_out else x.dtype, device=x.device)
    # Without fp8_out the kernel never reads scale_ptr (FP8_OUT compiles it out).
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device) if fp8_out else out
    result = Fp8Rows(out, scale, x.dtype) if fp8_out else out
    if num_tokens == 0:
        return result
    # A row's quantization needs its absolute maximum: one program holds the whole row.
    block = one_tile if fp8_out else min(1024, one_tile)
    pdl = use_pdl(x.device)
    _act_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x,
        out,
        scale,
        inter,
        x.stride(0),
        GELU_TANH=activation == "gelu_tanh",
        FP8_OUT=fp8_out,
        BLOCK=block,
        PDL=pdl,
        num_warps=max(4, block // 512),
        **launch_options(pdl),
    )
    return result


def act_and_mul_for(device: torch.device) -> Callable[..., torch.Tensor | Fp8Rows]:
    """The gated activation the model uses on `device`: Triton on CUDA, the reference
    elsewhere."""
    return act_and_mul if device.type == "cuda" else act_and_mul_ref
