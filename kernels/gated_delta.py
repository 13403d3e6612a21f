"""One decode step of the gated delta rule (Gated DeltaNet, engine/models/gated_delta.py)
for every row at once, each row's state read and written in place at its slot; and a
step's short prompts, each walking its tokens the same way (`gated_delta_tokens`).

The step is a pass over each head's state S [k_dim, v_dim] (fp32): decay it, read what it
predicts for the row's key, write the correction, read the output for its query. In torch
that is a gather of the rows' states, some seven elementwise passes over them and a
scatter back: the states are larger than a small model's weights (48 layers of 48 heads of
128 x 128 fp32 is 151 MB a sequence at Qwen3.5-27B's shape). Here each program holds one
row's head's state (a slice of its value dims) in registers: one read, one write. The
key and query's L2 norm, the decay and beta come from the projections' raw outputs in
the same program.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl, wait_previous


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_inputs(
    conved: torch.Tensor,  # [tokens, 2 * key heads * k_dim + value heads * v_dim]: q, k, v
    a: torch.Tensor,  # [tokens, value heads]: the decay's logit
    b: torch.Tensor,  # [tokens, value heads]: beta's logit
    a_log: torch.Tensor,  # [value heads]
    dt_bias: torch.Tensor,  # [value heads]
    num_k_heads: int,
    k_dim: int,
) -> tuple[torch.Tensor, ...]:
    """q, k (L2-normed, q scaled by k_dim^-0.5; each key head repeated for the value heads
    that read it), v in fp32 [tokens, value heads, dim]; the log decay g <= 0 and beta
    [tokens, value heads]."""
    n, num_v_heads = a.shape
    keys = num_k_heads * k_dim
    q, k, v = conved.split([keys, keys, conved.shape[1] - 2 * keys], dim=-1)
    q, k = (l2_normalize(t.float().view(n, num_k_heads, k_dim)) for t in (q, k))
    repeat = num_v_heads // num_k_heads
    q = q.repeat_interleave(repeat, 1) * k_dim**-0.5
    k = k.repeat_interleave(repeat, 1)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    beta = b.float().sigmoid()  # in fp32 (transformers rounds it to the model dtype)
    return q, k, v.float().view(n, num_v_heads, -1), g, beta


def recurrent_step(
    q: torch.Tensor,  # [rows, heads, k_dim]: l2-normed and scaled
    k: torch.Tensor,  # [rows, heads, k_dim]: l2-normed
    v: torch.Tensor,  # [rows, heads, v_dim]
    g: torch.Tensor,  # [rows, heads]: log decay, <= 0
    beta: torch.Tensor,  # [rows, heads]
    state: torch.Tensor,  # [rows, heads, k_dim, v_dim] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # (o [rows, heads, v_dim] fp32, the new state)
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)  # S^T k: [rows, heads, v_dim]
    state = state + k[..., None] * ((v - predicted) * beta[..., None])[..., None, :]
    return (state * q[..., None]).sum(-2), state


def gated_delta_step_ref(
    conved: torch.Tensor,  # [rows, conv channels]: q, k, v after the convolution
    a: torch.Tensor,  # [rows, value heads]
    b: torch.Tensor,  # [rows, value heads]
    a_log: torch.Tensor,  # [value heads]
    dt_bias: torch.Tensor,  # [value heads]
    state: torch.Tensor,  # [slots, value heads, k_dim, v_dim] fp32: updated in place
    slots: torch.Tensor,  # [rows] int64: each row's state
    has_state: torch.Tensor,  # [rows] bool: False starts the row from zeros
    num_k_heads: int,
) -> torch.Tensor:  # [rows, value heads, v_dim] fp32
    q, k, v, g, beta = delta_rule_inputs(conved, a, b, a_log, dt_bias, num_k_heads, state.shape[2])
    rows = state[slots] * has_state[:, None, None, None]
    out, rows = recurrent_step(q, k, v, g, beta, rows)
    state.index_copy_(0, slots, rows)
    return out


@triton.jit
def softplus(t):
    """torch's softplus: linear above 20."""
    return tl.where(t > 20.0, t, tl.log(1.0 + tl.exp(tl.minimum(t, 20.0))))


@triton.jit
def slot_state_slice(
    state_ptr, slots_ptr, has_state_ptr, row, head, num_heads, block,
    ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """A row's head's state [ROWS, COLS] (fp32, at the row's slot), columns `block` *
    BLOCK on: (the slice, zeros for a row without state; its pointers; its columns)."""
    slot = tl.load(slots_ptr + row)
    keep = (tl.load(has_state_ptr + row) != 0).to(tl.float32)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    at = state_ptr + (slot * num_heads + head) * ROWS * COLS
    ptrs = at + tl.arange(0, ROWS)[:, None] * COLS + cols[None, :]
    return tl.load(ptrs) * keep, ptrs, cols


@triton.jit
def delta_rule_token(
    state, x, a_at, b_at, head, vs, v_offset, q_scale, decay_log, dt_bias,
    REPEAT: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
):  # fmt: skip
    """One token through a head's state slice [K_DIM, BLOCK_V] (x: its conved row; a_at,
    b_at: its decay and beta logits): (the output slice, the new state)."""
    ks = tl.arange(0, K_DIM)
    key_head = head // REPEAT
    q = tl.load(x + key_head * K_DIM + ks).to(tl.float32)
    k = tl.load(x + (v_offset // 2) + key_head * K_DIM + ks).to(tl.float32)
    v = tl.load(x + v_offset + head * V_DIM + vs).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_at).to(tl.float32)))
    state = state * tl.exp(decay_log * softplus(tl.load(a_at).to(tl.float32) + dt_bias))
    predicted = tl.sum(state * k[:, None], axis=0)  # [BLOCK_V]
    state = state + k[:, None] * ((v - predicted) * beta)[None, :]
    return tl.sum(state * q[:, None], axis=0), state


@triton.jit
def _gated_delta_step_kernel(
    conved_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slots_ptr,
    has_state_ptr,
    out_ptr,
    stride_conved,
    stride_ab,
    num_v_heads,
    v_offset,  # where v starts in a conved row (2 * key heads * K_DIM)
    q_scale,  # K_DIM ** -0.5
    REPEAT: tl.constexpr,  # value heads per key head
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (row, value head, BLOCK_V of its value dims): the state's
    # [K_DIM, BLOCK_V] slice in registers, its q and k rows whole.
    row, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    decay_log = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    state, state_ptrs, vs = slot_state_slice(
        state_ptr, slots_ptr, has_state_ptr, row, head, num_v_heads, vb, K_DIM, V_DIM, BLOCK_V
    )
    wait_previous(PDL)
    ab_at = row * stride_ab + head
    out, state = delta_rule_token(
        state, conved_ptr + row * stride_conved, a_ptr + ab_at, b_ptr + ab_at, head, vs,
        v_offset, q_scale, decay_log, dt_bias, REPEAT, K_DIM, V_DIM,
    )  # fmt: skip
    tl.store(out_ptr + (row * num_v_heads + head) * V_DIM + vs, out)
    tl.store(state_ptrs, state)


def gated_delta_step(
    conved: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    num_k_heads: int,
) -> torch.Tensor:
    """Triton version of `gated_delta_step_ref` (the reference where k_dim or v_dim is not
    a power of two)."""
    rows, num_v_heads = a.shape
    _, _, k_dim, v_dim = state.shape
    if k_dim & (k_dim - 1) or v_dim & (v_dim - 1):
        args = (conved, a, b, a_log, dt_bias, state, slots, has_state, num_k_heads)
        return gated_delta_step_ref(*args)
    assert state.dtype == torch.float32 and state.is_contiguous()
    assert conved.stride(1) == 1 and a.stride() == b.stride() and a.stride(1) == 1
    out = torch.empty(rows, num_v_heads, v_dim, dtype=torch.float32, device=conved.device)
    if rows == 0:
        return out
    block_v = min(v_dim, 32)  # a [k_dim, 32] fp32 tile: 32 values a thread at k_dim 128
    pdl = use_pdl(conved.device)
    _gated_delta_step_kernel[(rows, num_v_heads, v_dim // block_v)](
        conved,
        a,
        b,
        a_log,
        dt_bias,
        state,
        slots,
        has_state,
        out,
        conved.stride(0),
        a.stride(0),
        num_v_heads,
        2 * num_k_heads * k_dim,
        k_dim**-0.5,
        REPEAT=num_v_heads // num_k_heads,
        K_DIM=k_dim,
        V_DIM=v_dim,
        BLOCK_V=block_v,
        PDL=pdl,
        num_warps=4,
        **launch_options(pdl),
    )
    return out


def gated_delta_tokens_ref(
    conved: torch.Tensor,  # [tokens, conv channels]: the step's sequences' rows, end to end
    a: torch.Tensor,  # [tokens, value heads]
    b: torch.Tensor,  # [tokens, value heads]
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,  # [slots, value heads, k_dim, v_dim] fp32: updated in place
    starts: torch.Tensor,  # [seqs]: each sequence's first token
    lengths: torch.Tensor,  # [seqs]: its tokens (0: none; its slot is left alone)
    slots: torch.Tensor,  # [seqs] int64
    has_state: torch.Tensor,  # [seqs] bool
    num_k_heads: int,
) -> torch.Tensor:  # [tokens, value heads, v_dim] fp32 (zeros outside the sequences)
    """The rule over each sequence's tokens one at a time, from its slot's state."""
    q, k, v, g, beta = delta_rule_inputs(conved, a, b, a_log, dt_bias, num_k_heads, state.shape[2])
    out = torch.zeros(*v.shape, dtype=state.dtype, device=v.device)  # fp32 in the engine
    for seq, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        if not n:
            continue
        rows = state[slots[seq : seq + 1]] * has_state[seq]
        for t in range(start, start + n):
            at = slice(t, t + 1)
            out[at], rows = recurrent_step(q[at], k[at], v[at], g[at], beta[at], rows)
        state[slots[seq : seq + 1]] = rows
    return out


@triton.jit
def _gated_delta_tokens_kernel(
    conved_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    has_state_ptr,
    out_ptr,
    stride_conved,
    stride_ab,
    num_v_heads,
    v_offset,
    q_scale,
    REPEAT: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per (value head, BLOCK_V of its value dims, sequence), as the step's,
    # walking the sequence's tokens with the state slice in registers throughout. The
    # sequence is the grid's slowest axis: a graph's padded sequences, whose programs end
    # at once, are launched after every real one, which then spread evenly over the SMs.
    head, vb, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths_ptr + seq)
    if length == 0:  # a graph's padded sequence: its slot (the spare) is left alone
        return
    start = tl.load(starts_ptr + seq)
    decay_log = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    state, state_ptrs, vs = slot_state_slice(
        state_ptr, slots_ptr, has_state_ptr, seq, head, num_v_heads, vb, K_DIM, V_DIM, BLOCK_V
    )
    for row in range(start, start + length):
        ab_at = row * stride_ab + head
        out, state = delta_rule_token(
            state, conved_ptr + row * stride_conved, a_ptr + ab_at, b_ptr + ab_at, head, vs,
            v_offset, q_scale, decay_log, dt_bias, REPEAT, K_DIM, V_DIM,
        )  # fmt: skip
        tl.store(out_ptr + (row * num_v_heads + head) * V_DIM + vs, out)
    tl.store(state_ptrs, state)


def gated_delta_tokens(
    conved: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    num_k_heads: int,
) -> torch.Tensor:
    """Triton version of `gated_delta_tokens_ref`: one launch, where the chunked form
    (engine/models/gated_delta.py) is some fifty torch ops a layer and reads the prompts'
    shape to the host. k_dim and v_dim must be powers of two (`walkable`)."""
    num_v_heads = a.shape[-1]
    _, _, k_dim, v_dim = state.shape
    assert walkable(k_dim, v_dim) and state.dtype == torch.float32 and state.is_contiguous()
    assert conved.stride(1) == 1 and a.stride() == b.stride() and a.stride(1) == 1
    out = torch.zeros(len(conved), num_v_heads, v_dim, dtype=torch.float32, device=a.device)
    if len(starts) == 0:
        return out
    block_v = min(v_dim, 32)
    _gated_delta_tokens_kernel[(num_v_heads, v_dim // block_v, len(starts))](
        conved,
        a,
        b,
        a_log,
        dt_bias,
        state,
        starts,
        lengths,
        slots,
        has_state,
        out,
        conved.stride(0),
        a.stride(0),
        num_v_heads,
        2 * num_k_heads * k_dim,
        k_dim**-0.5,
        REPEAT=num_v_heads // num_k_heads,
        K_DIM=k_dim,
        V_DIM=v_dim,
        BLOCK_V=block_v,
        num_warps=4,
    )
    return out


def walkable(*dims: int) -> bool:
    """Whether the walk kernels take a state of these dims (powers of two)."""
    return all(d > 0 and d & (d - 1) == 0 for d in dims)


def gated_delta_step_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The step the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return gated_delta_step if device.type == "cuda" else gated_delta_step_ref
