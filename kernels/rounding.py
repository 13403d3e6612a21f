"""Rounding an fp32 value to the activation dtype inside a kernel, as a torch op would.

Fused elementwise kernels compute in fp32 and round wherever the unfused torch ops
would have rounded, so both give the same bits. `x.to(tl.bfloat16)` rounds to nearest
even on a GPU but truncates in Triton's interpreter, so bf16 rounding is done here on
the bits: the same result on both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x (fp32) rounded to the nearest `dtype` value, ties to even; returned as fp32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(x == x, rounded, x)  # NaN stays NaN
    else:
        return x.to(dtype).to(tl.float32)
