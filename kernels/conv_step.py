"""One decode step of the recurrent layers' causal depthwise convolution (Gated DeltaNet's
and Mamba-2's, then a SiLU; LFM2's short convolution, without; engine/models/gated_delta.py)
for every row at once: each row's last kernel - 1 input rows read at its slot, its new
row convolved with them, the window moved on in place.

In torch that is a gather of the rows' conv states, a cat, a multiply, a sum, a SiLU and
a scatter back: six launches a layer for a few kilobytes a row. Here one program takes
a block of one row's channels through all of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl, wait_previous


def conv_step(
    x: torch.Tensor,  # [rows, channels]: each row a sequence's one new row
    state: torch.Tensor,  # [rows, channels, kernel - 1]
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None = None,  # [channels]
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (silu(conv) [rows, channels], the new states)
    full = torch.cat([state, x[:, :, None].to(state.dtype)], dim=2)  # [rows, channels, kernel]
    acc = torch.promote_types(full.dtype, torch.float32)  # summed in fp32 at least
    summed = (full.to(acc) * weight.to(acc)).sum(-1)
    summed = summed if bias is None else summed + bias.to(acc)
    return (F.silu(summed) if silu else summed), full[:, :, 1:]


def conv_step_at_slots_ref(
    x: torch.Tensor,  # [rows, channels]
    states: torch.Tensor,  # [slots, channels, kernel - 1]: updated in place
    slots: torch.Tensor,  # [rows] int64: each row's state
    has_state: torch.Tensor,  # [rows] bool: False starts the row from zeros
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None,
    silu: bool = True,  # False: the convolution alone (LFM2's)
) -> torch.Tensor:  # silu(conv) [rows, channels] in x's dtype
    conved, new = conv_step(x, states[slots] * has_state[:, None, None], weight, bias, silu)
    states.index_copy_(0, slots, new)
    return conved.to(x.dtype)


@triton.jit
def _conv_step_kernel(
    x_ptr,
    states_ptr,
    slots_ptr,
    has_state_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    stride_x,
    channels,
    KERNEL: tl.constexpr,
    TAPS: tl.constexpr,  # KERNEL rounded up to a power of two
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    row, cb = tl.program_id(0), tl.program_id(1)
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, TAPS)
    live = cs < channels
    slot = tl.load(slots_ptr + row)
    keep = (tl.load(has_state_ptr + row) != 0).to(tl.float32)
    weight = tl.load(
        weight_ptr + cs[:, None] * KERNEL + taps[None, :],
        mask=live[:, None] & (taps[None, :] < KERNEL),
        other=0.0,
    ).to(tl.float32)
    state_at = states_ptr + slot * channels * (KERNEL - 1) + cs[:, None] * (KERNEL - 1)
    # The window: KERNEL - 1 stored rows, then the new one (tap KERNEL - 1).
    old = tl.load(
        state_at + taps[None, :], mask=live[:, None] & (taps[None, :] < KERNEL - 1), other=0.0
    )
    wait_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + cs, mask=live, other=0.0)
    # Rounded to the states' dtype, as the stored rows are; in fp32 from there (exactly).
    new = x.to(old.dtype).to(tl.float32)
    window = tl.where(taps[None, :] == KERNEL - 1, new[:, None], old.to(tl.float32) * keep)
    acc = tl.sum(window * weight, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cs, mask=live, other=0.0).to(tl.float32)
    out = acc / (1.0 + tl.exp(-acc)) if SILU else acc
    tl.store(out_ptr + row * channels + cs, out.to(out_ptr.dtype.element_ty), mask=live)
    # The window moved on by one: stored row j takes window row j + 1.
    after = tl.load(
        state_at + taps[None, :] + 1,
        mask=live[:, None] & (taps[None, :] + 1 < KERNEL - 1),
        other=0.0,
    )
    after = tl.where(taps[None, :] == KERNEL - 2, new[:, None], after.to(tl.float32) * keep)
    tl.store(
        state_at + taps[None, :],
        after.to(old.dtype),
        mask=live[:, None] & (taps[None, :] < KERNEL - 1),
    )


def conv_step_at_slots(
    x: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """Triton version of `conv_step_at_slots_ref`."""
    rows, channels = x.shape
    kernel = weight.shape[1]
    assert states.is_contiguous() and weight.is_contiguous() and x.stride(1) == 1
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_c = 256
    pdl = use_pdl(x.device)
    _conv_step_kernel[(rows, triton.cdiv(channels, block_c))](
        x,
        states,
        slots,
        has_state,
        weight,
        weight if bias is None else bias,
        out,
        x.stride(0),
        channels,
        KERNEL=kernel,
        TAPS=triton.next_power_of_2(kernel),
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_C=block_c,
        PDL=pdl,
        num_warps=4,
        **launch_options(pdl),
    )
    return out


def conv_step_at_slots_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The step the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return conv_step_at_slots if device.type == "cuda" else conv_step_at_slots_ref
