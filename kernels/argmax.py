"""Greedy ids: the argmax of each logits row, over chunks of the row in parallel.

torch.argmax reduces a [rows, vocab] tensor with about one program per row, too few
to fill the GPU at decode batch sizes when a row is 50k-150k wide. Here the first
launch takes each row in CHUNK-wide pieces, (rows x chunks) programs, and the
second picks each row's winner among its pieces. The result is torch.argmax's: the
first index of the largest value, NaN counting as larger than any number. With a
grammar's token bitmask, disallowed ids count as -inf, as if the mask had been
applied to the logits first (xgrammar's apply_token_bitmask_inplace), without
writing them.

The bitmask may be rows picked by index from a table narrower than the logits, the
words past its width standing for one word per row (a `MaskRows`): the grammar
masks' host rows, read by the kernel where the worker filled them (pinned memory
the device maps), rather than copied to the device and gathered first. Those loads
bypass the caches (".cv"), as the host rewrites the rows between launches.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    select_ptr,  # SELECTED: [2, stride_select] int32, each row's bitmask row and pad word
    vocab,
    num_chunks,
    stride_row,
    stride_mask_row,
    mask_words,  # SELECTED: the bitmask's words; past them, the row's pad word
    stride_select,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    MASKED: tl.constexpr,
    SELECTED: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if SELECTED:
        mask_row = tl.load(select_ptr + row)
        pad = tl.load(select_ptr + stride_select + row)
    else:
        mask_row = row
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], NO_INDEX, tl.int32)
    start = chunk * BLOCK * TILES
    for tile in tl.static_range(TILES):
        idx = start + tile * BLOCK + lanes
        valid = idx < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + idx, mask=valid).to(tl.float32)
        if SELECTED:
            # Each word once (host memory is read over the bus): its 32 bits, in order.
            words = (start + tile * BLOCK) // 32 + tl.arange(0, BLOCK // 32)
            held = words < mask_words
            word_ptr = bitmask_ptr + mask_row * stride_mask_row + words
            word = tl.load(word_ptr, mask=held, other=0, cache_modifier=".cv")
            word = tl.where(held, word, pad)
            bits = tl.reshape((word[:, None] >> tl.arange(0, 32)[None, :]) & 1, [BLOCK])
            x = tl.where(bits != 0, x, float("-inf"))
        elif MASKED:
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


@dataclass
class MaskRows:
    """A bitmask given as rows of a table: logits row r takes table row select[0, r],
    and for ids past the table's width every bit of the word select[1, r]."""

    table: torch.Tensor  # [table rows, words] int32; on CUDA device memory or pinned
    select: torch.Tensor  # [2, >= rows] int32 on the logits' device, last dim contiguous


def argmax_parts(rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_ids's per-chunk winners (values, ids) for up to `rows` rows, allocated once
    by a caller that launches it eagerly every step."""
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    return part_val, torch.empty(rows, num_chunks, dtype=torch.int32, device=device)


def greedy_ids(
    logits: torch.Tensor,
    out: torch.Tensor,
    bitmask: torch.Tensor | MaskRows | None = None,
    parts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[r] = logits[r].argmax() for logits [rows, vocab] (last dim contiguous), as
    torch.argmax(logits, dim=-1, out=out); CUDA-graph safe (no host sync). bitmask:
    [rows, >= ceil(vocab / 32)] int32, last dim contiguous, or MaskRows: only the ids
    it allows. parts: argmax_parts(>= rows, vocab), else allocated here."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and out.shape == (rows,)
    select = None
    if isinstance(bitmask, MaskRows):
        bitmask, select = bitmask.table, bitmask.select
        assert select.dtype == torch.int32 and select.stride(1) == 1
        assert select.shape[0] == 2 and select.shape[1] >= rows
    if bitmask is not None:
        assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1
        assert select is not None or (bitmask.shape[0] == rows and bitmask.shape[1] * 32 >= vocab)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    if parts is None:
        part_val, part_idx = argmax_parts(rows, vocab, logits.device)
    else:
        assert parts[0].shape[0] >= rows and parts[0].shape[1] == num_chunks
        part_val, part_idx = parts[0][:rows], parts[1][:rows]
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits,
        part_val,
        part_idx,
        logits if bitmask is None else bitmask,
        logits if select is None else select,
        vocab,
        num_chunks,
        logits.stride(0),
        0 if bitmask is None else bitmask.stride(0),
        0 if bitmask is None else bitmask.shape[1],
        0 if select is None else select.stride(0),
        BLOCK=BLOCK,
        TILES=CHUNK // BLOCK,
        MASKED=bitmask is not None,
        SELECTED=select is not None,
        num_warps=8,
    )
    _row_argmax_kernel[(rows,)](
        part_val, part_idx, out, num_chunks, CHUNKS_P2=max(2, triton.next_power_of_2(num_chunks))
    )
    return out
