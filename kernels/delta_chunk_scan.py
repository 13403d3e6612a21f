"""The chunked gated delta rule's scan over chunks (engine/models/gated_delta.py's
`chunked_rule`) in one launch.

Within each chunk the rule's terms are solved for all at once, batched over every chunk
(`writes`, `reads`, `scores`, ...). What is left runs chunk after chunk, since each chunk
reads the state the last one left: a few small matmuls a chunk, each its own launch in
torch, so a 2,048-token prompt's 32 chunks cost some 200 launches a layer. Here one
program per (sequence and head, BLOCK_V of the value dims) keeps its slice of the state
in registers and walks the chunks. The dots run in fp32 (IEEE) for an fp32 model, on tf32 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


def delta_chunk_scan_ref(
    writes: torch.Tensor,  # [n, chunks, C, v_dim]: each chunk's writes from a zero state
    reads: torch.Tensor,  # [n, chunks, C, k_dim]: what the state before the chunk takes back
    q_decayed: torch.Tensor,  # [n, chunks, C, k_dim]: queries decayed to the chunk's start
    scores: torch.Tensor,  # [n, chunks, C, C]: causal query-key scores within the chunk
    k_to_end: torch.Tensor,  # [n, chunks, C, k_dim]: keys decayed to the chunk's end
    chunk_decay: torch.Tensor,  # [n, chunks]: the state's decay over the chunk
    state: torch.Tensor,  # [n, k_dim, v_dim] fp32: before the first chunk
    precision: str = "ieee",  # the kernel's (unused here: torch's fp32 matmuls)
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [n, chunks, C, v_dim], the final state)
    out = writes.new_empty(writes.shape)  # contiguous (solve_triangular's writes are not)
    for c in range(writes.shape[1]):
        u = writes[:, c] - reads[:, c] @ state  # [n, C, v_dim]
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ u
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out, state


@triton.jit
def _delta_chunk_scan_kernel(
    writes_ptr,
    reads_ptr,
    q_ptr,
    scores_ptr,
    k_ptr,
    decay_ptr,
    state_ptr,
    out_ptr,
    chunks,
    CHUNK: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n, vb = tl.program_id(0), tl.program_id(1)
    cs = tl.arange(0, CHUNK)
    ks = tl.arange(0, K_DIM)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    state_at = state_ptr + n * K_DIM * V_DIM + ks[:, None] * V_DIM + vs[None, :]
    state = tl.load(state_at)  # [K_DIM, BLOCK_V]
    for c in range(chunks):
        chunk = n * chunks + c
        by_k = chunk * CHUNK * K_DIM + cs[:, None] * K_DIM + ks[None, :]  # [CHUNK, K_DIM]
        by_v = chunk * CHUNK * V_DIM + cs[:, None] * V_DIM + vs[None, :]  # [CHUNK, BLOCK_V]
        u = tl.load(writes_ptr + by_v) - tl.dot(
            tl.load(reads_ptr + by_k), state, input_precision=DOT_PRECISION
        )
        within = chunk * CHUNK * CHUNK + cs[:, None] * CHUNK + cs[None, :]
        out = tl.dot(tl.load(q_ptr + by_k), state, input_precision=DOT_PRECISION)
        out += tl.dot(tl.load(scores_ptr + within), u, input_precision=DOT_PRECISION)
        tl.store(out_ptr + by_v, out)
        keys_t = tl.load(k_ptr + chunk * CHUNK * K_DIM + cs[None, :] * K_DIM + ks[:, None])
        state = state * tl.load(decay_ptr + chunk) + tl.dot(
            keys_t, u, input_precision=DOT_PRECISION
        )
    tl.store(state_at, state)


def delta_chunk_scan(
    writes: torch.Tensor,
    reads: torch.Tensor,
    q_decayed: torch.Tensor,
    scores: torch.Tensor,
    k_to_end: torch.Tensor,
    chunk_decay: torch.Tensor,
    state: torch.Tensor,
    precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `delta_chunk_scan_ref` (the reference for dims that are not
    powers of two of at least 16, which tl.dot needs). precision "ieee": fp32 dots, as
    the loop's (an fp32 model's); "tf32": on the tensor cores, for a bf16 or fp16
    model, whose activations are rounded coarser than tf32's products (5-40x faster at
    Qwen 3.5's heads on an H200)."""
    n, chunks, chunk, v_dim = writes.shape
    k_dim = reads.shape[-1]
    if any(d < 16 or d & (d - 1) for d in (chunk, k_dim, v_dim)):
        args = (writes, reads, q_decayed, scores, k_to_end, chunk_decay, state)
        return delta_chunk_scan_ref(*args)
    tensors = [writes, reads, q_decayed, scores, k_to_end, chunk_decay]
    tensors = [t.float().contiguous() for t in tensors]
    state = state.float().contiguous().clone()  # the final state, written in place
    out = torch.empty_like(tensors[0])
    # Measured best on an H200 at Qwen3.5-27B's heads, 1-8 prompts of 512 to 8,192 tokens.
    block_v, num_warps = (32, 8) if precision == "ieee" else (64, 4)
    block_v = min(v_dim, block_v)
    _delta_chunk_scan_kernel[(n, v_dim // block_v)](
        *tensors,
        state,
        out,
        chunks,
        CHUNK=chunk,
        K_DIM=k_dim,
        V_DIM=v_dim,
        BLOCK_V=block_v,
        DOT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=1,  # a chunk's tiles are 120 KB at Qwen 3.5's shape: no room for two
    )
    return out, state


def delta_chunk_scan_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The scan the model uses on `device`: Triton on CUDA, the reference elsewhere."""
    return delta_chunk_scan if device.type == "cuda" else delta_chunk_scan_ref
