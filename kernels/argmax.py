"""Greedy ids: the argmax of each logits row, over chunks of the row in parallel.

torch.argmax reduces a [rows, vocab] tensor with about one program per row, too few
to fill the GPU at decode batch sizes when a row is 50k-150k wide. Here the first
launch takes each row in CHUNK-wide pieces, (rows x chunks) programs, and the
second picks each row's winner among its pieces. The result is torch.argmax's: the
first index of the largest value, NaN counting as larger than any number. With a
grammar's token bitmask, disallowed ids count as -inf, as if the mask had been
applied to the logits first (xgrammar's apply_token_bitmask_inplace), without
writing them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements a program loads at once
CHUNK = 4 * BLOCK  # elements of a row per first-launch program
NO_INDEX: tl.constexpr = tl.constexpr(2**31 - 1)  # above any vocabulary index


@triton.jit
def _pick(val, idx):
    """The winner of (val, idx) candidates: the first NaN if any, else the first of
    the largest values. Candidates without an element carry NO_INDEX."""
    is_nan = val != val
    any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), val), 0)
    winner = tl.where(any_nan, is_nan, (val == top) & (idx != NO_INDEX))
    best = tl.min(tl.where(winner, idx, NO_INDEX), 0)
    return tl.where(any_nan, float("nan"), top), best


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,
    part_val_ptr,
    part_idx_ptr,
    bitmask_ptr,  # [rows, ceil(vocab / 32)] int32, bit i of word w: id 32 * w + i allowed
    vocab,
    num_chunks,
    stride_row,
    stride_mask_row,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    MASKED: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], NO_INDEX, tl.int32)
    start = chunk * BLOCK * TILES
    for tile in tl.static_range(TILES):
        idx = start + tile * BLOCK + lanes
        valid = idx < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + idx, mask=valid).to(tl.float32)
        if MASKED:
            word = tl.load(bitmask_ptr + row * stride_mask_row + (idx >> 5), mask=valid, other=0)
            x = tl.where(((word >> (idx & 31)) & 1) != 0, x, float("-inf"))
        # Later tiles hold later indices: a tie keeps the lane's earlier one.
        take = (x > best_val) | (best_idx == NO_INDEX) | ((x != x) & (best_val == best_val))
        take = valid & take
        best_val = tl.where(take, x, best_val)
        best_idx = tl.where(take, idx, best_idx)
    val, idx = _pick(best_val, best_idx)
    tl.store(part_val_ptr + row * num_chunks + chunk, val)
    tl.store(part_idx_ptr + row * num_chunks + chunk, idx)


@triton.jit
def _row_argmax_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks, CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_P2)
    mask = chunks < num_chunks
    val = tl.load(part_val_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_chunks + chunks, mask=mask, other=NO_INDEX)
    _, best = _pick(val, idx)
    tl.store(out_ptr + row, best.to(out_ptr.dtype.element_ty))


def greedy_ids(
    logits: torch.Tensor, out: torch.Tensor, bitmask: torch.Tensor | None = None
) -> torch.Tensor:
    """out[r] = logits[r].argmax() for logits [rows, vocab] (last dim contiguous), as
    torch.argmax(logits, dim=-1, out=out); CUDA-graph safe (no host sync). bitmask:
    [rows, >= ceil(vocab / 32)] int32, last dim contiguous: only the ids it allows."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and out.shape == (rows,)
    if bitmask is not None:
        assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1
        assert bitmask.shape[0] == rows and bitmask.shape[1] * 32 >= vocab
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits,
        part_val,
        part_idx,
        logits if bitmask is None else bitmask,
        vocab,
        num_chunks,
        logits.stride(0),
        0 if bitmask is None else bitmask.stride(0),
        BLOCK=BLOCK,
        TILES=CHUNK // BLOCK,
        MASKED=bitmask is not None,
        num_warps=8,
    )
    _row_argmax_kernel[(rows,)](
        part_val, part_idx, out, num_chunks, CHUNKS_P2=max(2, triton.next_power_of_2(num_chunks))
    )
    return out
