"""One decode step of the recurrent layers' causal depthwise convolution (Gated DeltaNet's
and Mamba-2's, then a SiLU; LFM2's short convolution, without; engine/models/gated_delta.py)
for every row at once: each row's last kernel - 1 input rows read at its slot, its new
row convolved with them, the window moved on in place.

In torch that is a gather of the rows' conv states, a cat, a multiply, a sum, a SiLU and
a scatter back: six launches a layer for a few kilobytes a row. Here one program takes
a block of one row's channels through all of it.

A step's prompts take the same convolution over their tokens laid end to end
(`conv_tokens_at_slots`): each token's window is its sequence's rows before it, reaching
into the slot's stored rows for the first kernel - 1, and each sequence's last kernel - 1
input rows become its new state. Only device tensors describe the sequences, so a CUDA
graph replays it for any prompts (engine/models/gated_delta.py's walk).
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


def conv_tokens_at_slots_ref(
    x: torch.Tensor,  # [tokens, channels]: the step's sequences' new rows, end to end
    states: torch.Tensor,  # [slots, channels, kernel - 1]: updated in place
    token_seqs: torch.Tensor,  # [tokens]: each token's sequence (unused here; the kernel's)
    starts: torch.Tensor,  # [seqs]: each sequence's first token
    lengths: torch.Tensor,  # [seqs]: its new tokens (0: none; its slot is left alone)
    slots: torch.Tensor,  # [seqs] int64
    has_state: torch.Tensor,  # [seqs] bool: False starts the sequence from zeros
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:  # silu(conv) [tokens, channels] in x's dtype; zeros outside the sequences
    """Each sequence's tokens one decode step at a time (`conv_step_at_slots_ref`)."""
    out = torch.zeros_like(x)
    for seq, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        for t in range(start, start + n):
            live = has_state[seq : seq + 1] | (t > start)
            rows = slice(t, t + 1)
            out[rows] = conv_step_at_slots_ref(
                x[rows], states, slots[seq : seq + 1], live, weight, bias, silu
            )
    return out


@triton.jit
def _conv_tokens_kernel(
    x_ptr,
    states_ptr,
    token_seqs_ptr,
    starts_ptr,
    slots_ptr,
    has_state_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    stride_x,
    channels,
    KERNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per (BLOCK_T tokens, BLOCK_C channels): tap i of token t reads input
    # row t - (KERNEL - 1) + i, or, before its sequence's first row, the slot's stored row.
    tb, cb = tl.program_id(0), tl.program_id(1)
    ts = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    t_live, c_live = ts < num_tokens, cs < channels
    seq = tl.load(token_seqs_ptr + ts, mask=t_live, other=0)
    local = ts - tl.load(starts_ptr + seq, mask=t_live, other=0)  # the token's row in its sequence
    slot = tl.load(slots_ptr + seq, mask=t_live, other=0).to(tl.int64)
    keep = t_live & (tl.load(has_state_ptr + seq, mask=t_live, other=0) != 0)
    state_rows = states_ptr + slot[:, None] * (channels * (KERNEL - 1)) + cs[None, :] * (KERNEL - 1)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for i in tl.static_range(KERNEL):
        j = local - (KERNEL - 1) + i  # the tap's row in the sequence; < 0: a stored row
        w = tl.load(weight_ptr + cs * KERNEL + i, mask=c_live, other=0.0).to(tl.float32)
        from_x = tl.load(
            x_ptr + (ts - (KERNEL - 1) + i)[:, None] * stride_x + cs[None, :],
            mask=(t_live & (j >= 0))[:, None] & c_live[None, :],
            other=0.0,
        )
        stored = tl.load(
            state_rows + (j + KERNEL - 1)[:, None],
            mask=(keep & (j < 0))[:, None] & c_live[None, :],
            other=0.0,
        )
        # Rounded to the states' dtype, as stored rows are; in fp32 from there (exactly).
        row = from_x.to(states_ptr.dtype.element_ty).to(tl.float32) + stored.to(tl.float32)
        acc += row * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cs, mask=c_live, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc)) if SILU else acc
    out_mask = t_live[:, None] & c_live[None, :]
    tl.store(
        out_ptr + ts[:, None] * channels + cs[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


@triton.jit
def _conv_states_kernel(
    x_ptr,
    states_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    has_state_ptr,
    stride_x,
    channels,
    KERNEL: tl.constexpr,
    TAPS: tl.constexpr,  # KERNEL - 1 rounded up to a power of two
    BLOCK_C: tl.constexpr,
):
    # One program per (sequence, BLOCK_C channels), after every token has read the old
    # rows: stored row j takes the sequence's input row n - (KERNEL - 1) + j, or, for a
    # sequence shorter than that, the old stored row it moves down to.
    seq, cb = tl.program_id(0), tl.program_id(1)
    n = tl.load(lengths_ptr + seq)
    if n == 0:
        return
    start = tl.load(starts_ptr + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = (tl.load(has_state_ptr + seq) != 0).to(tl.float32)
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, TAPS)
    live = (cs < channels)[:, None] & (taps < KERNEL - 1)[None, :]
    j = n - (KERNEL - 1) + taps
    state_at = states_ptr + slot * channels * (KERNEL - 1) + cs[:, None] * (KERNEL - 1)
    from_x = tl.load(
        x_ptr + (start + j)[None, :] * stride_x + cs[:, None],
        mask=live & (j >= 0)[None, :],
        other=0.0,
    )
    stored = tl.load(state_at + (j + KERNEL - 1)[None, :], mask=live & (j < 0)[None, :], other=0.0)
    from_x = from_x.to(states_ptr.dtype.element_ty).to(tl.float32)
    new = tl.where((j >= 0)[None, :], from_x, stored.to(tl.float32) * keep)
    tl.debug_barrier()  # every thread's reads of the old rows before any write
    tl.store(state_at + taps[None, :], new.to(states_ptr.dtype.element_ty), mask=live)


def conv_tokens_at_slots(
    x: torch.Tensor,
    states: torch.Tensor,
    token_seqs: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """Triton version of `conv_tokens_at_slots_ref` (tokens past every sequence, a
    graph's padding, get unspecified rows): two launches, the outputs from the old
    states, then the new states."""
    tokens, channels = x.shape
    kernel = weight.shape[1]
    assert states.is_contiguous() and weight.is_contiguous() and x.stride(1) == 1
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_c = 128
    common = dict(KERNEL=kernel, BLOCK_C=block_c, num_warps=4)
    _conv_tokens_kernel[(triton.cdiv(tokens, 16), triton.cdiv(channels, block_c))](
        x, states, token_seqs, starts, slots, has_state, weight,
        weight if bias is None else bias, out, tokens, x.stride(0), channels,
        HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=16, **common,
    )  # fmt: skip
    _conv_states_kernel[(len(starts), triton.cdiv(channels, block_c))](
        x, states, starts, lengths, slots, has_state, x.stride(0), channels,
        TAPS=triton.next_power_of_2(kernel - 1), **common,
    )  # fmt: skip
    return out


def conv_step_at_slots_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The step the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return conv_step_at_slots if device.type == "cuda" else conv_step_at_slots_ref
