"""One decode step of Mamba-2's rule (engine/models/mamba2.py) for every row at once, each
row's state read and written in place at its slot; and a step's short prompts, each
walking its tokens the same way (`mamba2_tokens`).

Each head's state S [d_state, head_dim] (fp32) decays by exp(dt A), takes B (dt x)^T and
is read by C. In torch that is a gather of the rows' states, a few elementwise passes over
them and a scatter back, and the states outweigh the weights a step reads (Granite
4.0-H-Small: 36 layers of 128 heads of 128 x 64 fp32 is 151 MB a sequence). Here each
program holds a slice of one row's head's state in registers: one read, one write; dt's
softplus and clamp, and the D skip, in the same program.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.gated_delta import slot_state_slice, softplus, walkable
from kernels.pdl import launch_options, use_pdl, wait_previous


def mamba2_inputs(
    conved: torch.Tensor,  # [..., heads * head_dim + 2 * groups * d_state]: x, B, C
    dt: torch.Tensor,  # [..., heads]: dt before its bias and softplus
    a_log: torch.Tensor,  # [heads]
    dt_bias: torch.Tensor,  # [heads]
    d_state: int,
    dt_limit: tuple[float, float],
    groups: int,
) -> tuple[torch.Tensor, ...]:
    """x [..., heads, head_dim], B and C [..., heads, d_state] (each head its group's), fp32;
    dt after its softplus and clamp, and the log decay dt A, [..., heads] fp32."""
    heads = dt.shape[-1]
    x, b, c = conved.float().split(
        [conved.shape[-1] - 2 * groups * d_state] + [groups * d_state] * 2, dim=-1
    )
    b, c = (
        t.unflatten(-1, (groups, d_state)).repeat_interleave(heads // groups, -2) for t in (b, c)
    )
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(*dt_limit)
    return x.unflatten(-1, (heads, -1)), b, c, dt, dt * -a_log.float().exp()


def mamba2_step_ref(
    conved: torch.Tensor,  # [rows, heads * head_dim + 2 * groups * d_state]: x, B, C
    dt: torch.Tensor,  # [rows, heads]: dt before its bias and softplus
    a_log: torch.Tensor,  # [heads]
    dt_bias: torch.Tensor,  # [heads]
    d: torch.Tensor,  # [heads]: the skip's scale
    state: torch.Tensor,  # [slots, heads, d_state, head_dim] fp32: updated in place
    slots: torch.Tensor,  # [rows] int64: each row's state
    has_state: torch.Tensor,  # [rows] bool: False starts the row from zeros
    dt_limit: tuple[float, float],
) -> torch.Tensor:  # [rows, heads, head_dim] fp32
    heads, n, p = state.shape[1:]
    groups = (conved.shape[1] - heads * p) // (2 * n)
    x, b, c, dt, log_decay = mamba2_inputs(conved, dt, a_log, dt_bias, n, dt_limit, groups)
    s = state[slots] * has_state[:, None, None, None]
    s = s * log_decay.exp()[..., None, None] + b[..., :, None] * (dt[..., None] * x)[..., None, :]
    state.index_copy_(0, slots, s)
    return (c[..., None, :] @ s).squeeze(-2) + d.float()[:, None] * x


@triton.jit
def mamba2_token(
    state, row_at, dt_at, head, ps, b_offset, c_offset, dt_min, dt_max, decay_log, dt_bias,
    skip, PER_GROUP: tl.constexpr, D_STATE: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One token through a head's state slice [D_STATE, BLOCK_P] (row_at: its conved row;
    dt_at: its dt): (the output slice, the new state)."""
    ns = tl.arange(0, D_STATE)
    group = head // PER_GROUP
    x = tl.load(row_at + head * HEAD_DIM + ps).to(tl.float32)
    b = tl.load(row_at + b_offset + group * D_STATE + ns).to(tl.float32)
    c = tl.load(row_at + c_offset + group * D_STATE + ns).to(tl.float32)
    dt = softplus(tl.load(dt_at).to(tl.float32) + dt_bias)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)  # the config's clamp
    state = state * tl.exp(decay_log * dt) + b[:, None] * (dt * x)[None, :]
    return tl.sum(state * c[:, None], axis=0) + skip * x, state


@triton.jit
def _mamba2_step_kernel(
    conved_ptr,
    dt_ptr,
    a_log_ptr,
    dt_bias_ptr,
    d_ptr,
    state_ptr,
    slots_ptr,
    has_state_ptr,
    out_ptr,
    stride_conved,
    stride_dt,
    num_heads,
    b_offset,  # where B starts in a conved row (heads * HEAD_DIM)
    c_offset,  # and C (B's plus groups * D_STATE)
    dt_min,
    dt_max,
    PER_GROUP: tl.constexpr,  # heads that share a group's B and C
    D_STATE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (row, head, BLOCK_P of its head dims): the state's [D_STATE, BLOCK_P]
    # slice in registers, B and C whole.
    row, head, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    decay_log = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    skip = tl.load(d_ptr + head).to(tl.float32)
    state, state_ptrs, ps = slot_state_slice(
        state_ptr, slots_ptr, has_state_ptr, row, head, num_heads, pb, D_STATE, HEAD_DIM, BLOCK_P
    )
    wait_previous(PDL)
    out, state = mamba2_token(
        state, conved_ptr + row * stride_conved, dt_ptr + row * stride_dt + head, head, ps,
        b_offset, c_offset, dt_min, dt_max, decay_log, dt_bias, skip,
        PER_GROUP, D_STATE, HEAD_DIM,
    )  # fmt: skip
    tl.store(out_ptr + (row * num_heads + head) * HEAD_DIM + ps, out)
    tl.store(state_ptrs, state)


def mamba2_step(
    conved: torch.Tensor,
    dt: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """Triton version of `mamba2_step_ref` (the reference where d_state or head_dim is not
    a power of two)."""
    rows, heads = dt.shape
    _, _, n, p = state.shape
    if n & (n - 1) or p & (p - 1):
        return mamba2_step_ref(conved, dt, a_log, dt_bias, d, state, slots, has_state, dt_limit)
    assert state.dtype == torch.float32 and state.is_contiguous()
    assert conved.stride(1) == 1 and dt.stride(1) == 1
    out = torch.empty(rows, heads, p, dtype=torch.float32, device=conved.device)
    if rows == 0:
        return out
    groups = (conved.shape[1] - heads * p) // (2 * n)
    block_p = min(p, 32)  # a [d_state, 32] fp32 tile, as the DeltaNet's step holds
    pdl = use_pdl(conved.device)
    _mamba2_step_kernel[(rows, heads, p // block_p)](
        conved,
        dt,
        a_log,
        dt_bias,
        d,
        state,
        slots,
        has_state,
        out,
        conved.stride(0),
        dt.stride(0),
        heads,
        heads * p,
        heads * p + groups * n,
        dt_limit[0],
        dt_limit[1],
        PER_GROUP=heads // groups,
        D_STATE=n,
        HEAD_DIM=p,
        BLOCK_P=block_p,
        PDL=pdl,
        num_warps=4,
        **launch_options(pdl),
    )
    return out


def mamba2_tokens_ref(
    conved: torch.Tensor,  # [tokens, conv channels]: the step's sequences' rows, end to end
    dt: torch.Tensor,  # [tokens, heads]
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,  # [slots, heads, d_state, head_dim] fp32: updated in place
    starts: torch.Tensor,  # [seqs]: each sequence's first token
    lengths: torch.Tensor,  # [seqs]: its tokens (0: none; its slot is left alone)
    slots: torch.Tensor,  # [seqs] int64
    has_state: torch.Tensor,  # [seqs] bool
    dt_limit: tuple[float, float],
) -> torch.Tensor:  # [tokens, heads, head_dim] fp32 (zeros outside the sequences)
    """The rule over each sequence's tokens one at a time, from its slot's state."""
    heads, n, p = state.shape[1:]
    groups = (conved.shape[-1] - heads * p) // (2 * n)
    x, b, c, dt, log_decay = mamba2_inputs(conved, dt, a_log, dt_bias, n, dt_limit, groups)
    out = torch.zeros_like(x)
    for seq, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        if not length:
            continue
        s = state[slots[seq]] * has_state[seq]  # [heads, d_state, head_dim]
        for t in range(start, start + length):
            s = (
                s * log_decay[t].exp()[:, None, None]
                + b[t, :, :, None] * (dt[t, :, None] * x[t])[:, None, :]
            )
            out[t] = (c[t, :, None, :] @ s).squeeze(-2) + d.float()[:, None] * x[t]
        state[slots[seq]] = s
    return out


@triton.jit
def _mamba2_tokens_kernel(
    conved_ptr,
    dt_ptr,
    a_log_ptr,
    dt_bias_ptr,
    d_ptr,
    state_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    has_state_ptr,
    out_ptr,
    stride_conved,
    stride_dt,
    num_heads,
    b_offset,
    c_offset,
    dt_min,
    dt_max,
    PER_GROUP: tl.constexpr,
    D_STATE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # One program per (head, BLOCK_P of its head dims, sequence), as the step's, walking
    # the sequence's tokens with the state slice in registers throughout; the sequence
    # the grid's slowest axis, as the DeltaNet's walk (kernels/gated_delta.py).
    head, pb, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths_ptr + seq)
    if length == 0:  # a graph's padded sequence: its slot (the spare) is left alone
        return
    start = tl.load(starts_ptr + seq)
    decay_log = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    skip = tl.load(d_ptr + head).to(tl.float32)
    state, state_ptrs, ps = slot_state_slice(
        state_ptr, slots_ptr, has_state_ptr, seq, head, num_heads, pb, D_STATE, HEAD_DIM, BLOCK_P
    )
    for row in range(start, start + length):
        out, state = mamba2_token(
            state, conved_ptr + row * stride_conved, dt_ptr + row * stride_dt + head, head, ps,
            b_offset, c_offset, dt_min, dt_max, decay_log, dt_bias, skip,
            PER_GROUP, D_STATE, HEAD_DIM,
        )  # fmt: skip
        tl.store(out_ptr + (row * num_heads + head) * HEAD_DIM + ps, out)
    tl.store(state_ptrs, state)


def mamba2_tokens(
    conved: torch.Tensor,
    dt: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """Triton version of `mamba2_tokens_ref`: one launch for a step's prompts. d_state
    and head_dim must be powers of two (`walkable`)."""
    heads = dt.shape[-1]
    _, _, n, p = state.shape
    assert walkable(n, p) and state.dtype == torch.float32 and state.is_contiguous()
    assert conved.stride(1) == 1 and dt.stride(1) == 1
    out = torch.zeros(len(conved), heads, p, dtype=torch.float32, device=conved.device)
    if len(starts) == 0:
        return out
    groups = (conved.shape[1] - heads * p) // (2 * n)
    block_p = min(p, 32)
    _mamba2_tokens_kernel[(heads, p // block_p, len(starts))](
        conved,
        dt,
        a_log,
        dt_bias,
        d,
        state,
        starts,
        lengths,
        slots,
        has_state,
        out,
        conved.stride(0),
        dt.stride(0),
        heads,
        heads * p,
        heads * p + groups * n,
        dt_limit[0],
        dt_limit[1],
        PER_GROUP=heads // groups,
        D_STATE=n,
        HEAD_DIM=p,
        BLOCK_P=block_p,
        num_warps=4,
    )
    return out


def mamba2_step_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The step the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return mamba2_step if device.type == "cuda" else mamba2_step_ref
