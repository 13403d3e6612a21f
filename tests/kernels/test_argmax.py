"""greedy_ids equals torch.argmax: ties go to the first index, NaN wins, rows of -inf
give 0, and vocabularies off the chunk multiples; under a token bitmask, it equals
xgrammar's apply_token_bitmask_inplace followed by torch.argmax, also when the mask is
rows picked from a narrower table (on CUDA, pinned host memory the kernel reads)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from kernels.argmax import CHUNK, MaskRows, argmax_parts, greedy_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(logits: torch.Tensor) -> None:
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    got = greedy_ids(logits, out)
    assert torch.equal(got, torch.argmax(logits, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, CHUNK, CHUNK + 3, 2 * CHUNK + 1001])
def test_matches_torch_argmax(dtype, vocab):
    torch.manual_seed(vocab)
    check(torch.randn(5, vocab, device=DEVICE).to(dtype))


def test_ties_nan_and_infinities_as_torch():
    vocab = 2 * CHUNK + 77
    logits = torch.randn(8, vocab, device=DEVICE)
    logits[0, [5, CHUNK + 9, 2 * CHUNK + 3]] = 100.0  # a tie across chunks: the first
    logits[1, [CHUNK + 9, CHUNK + 10]] = 100.0  # a tie within a chunk
    logits[2, [CHUNK + 20, 2 * CHUNK + 1]] = float("nan")  # the first NaN
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")  # nothing but -inf: index 0
    logits[4, -1] = float("inf")  # the last element
    logits[5, 0] = 50.0  # the first element
    logits[6] = 1.0  # all equal: 0
    logits[7, 1:] = float("-inf")
    check(logits)
    check(logits.half())


def test_a_row_slice_of_a_wider_buffer():
    wide = torch.randn(4, CHUNK + 500, device=DEVICE)
    check(wide[:, : CHUNK + 100])


def masked_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed ids to -inf (what xgrammar's apply does), then torch.argmax."""
    ids = torch.arange(logits.shape[1], device=logits.device)
    allowed = (bitmask[:, ids >> 5] >> (ids & 31)) & 1
    return torch.where(allowed.bool(), logits, float("-inf")).argmax(-1)


@pytest.mark.parametrize("vocab", [37, CHUNK + 3])
def test_under_a_bitmask_as_the_mask_applied_then_argmax(vocab):
    torch.manual_seed(vocab)
    rows, words = 6, -(-vocab // 32) + 1  # a mask wider than the vocabulary, as for padding
    logits = torch.randn(rows, vocab, device=DEVICE)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32)
    bitmask[1] = 0  # nothing allowed: index 0, as for a row of -inf
    bitmask[2] = -1  # everything: the plain argmax
    bitmask[3] = 0
    bitmask[3, (vocab - 1) >> 5] = 1 << ((vocab - 1) & 31)  # only the last id
    bitmask[4] = 0
    bitmask[4, 0] = 0b1010  # ids 1 and 3, and a NaN at 3 wins
    logits[4, 3] = float("nan")
    logits[5, 0] = 1e4  # the largest value, but masked unless bit 0 is set
    bitmask[5, 0] &= ~1
    bitmask = bitmask.to(DEVICE)
    want = masked_reference(logits, bitmask)
    assert want[1] == 0 and want[2] == logits[2].argmax() and want[3] == vocab - 1
    assert want[4] == 3 and want[5] != 0
    applied = logits.clone()
    xgr.apply_token_bitmask_inplace(applied, bitmask)
    assert torch.equal(applied.argmax(-1), want)
    for dtype in (torch.float32, torch.float16):
        x = logits.to(dtype)
        out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
        assert torch.equal(greedy_ids(x, out, bitmask), masked_reference(x, bitmask))


def test_with_partials_allocated_for_more_rows():
    # An eager caller's partials, allocated once for its largest batch (poisoned: every
    # row's chunks are written before they are read), reused by smaller ones.
    vocab = 2 * CHUNK + 5
    parts = argmax_parts(9, vocab, torch.device(DEVICE))
    parts[0].fill_(float("nan"))
    parts[1].fill_(-1)
    for rows in (9, 3, 1):
        logits = torch.randn(rows, vocab, device=DEVICE)
        out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
        assert torch.equal(greedy_ids(logits, out, parts=parts), logits.argmax(-1))
    with pytest.raises(AssertionError):
        greedy_ids(torch.randn(10, vocab), torch.empty(10, dtype=torch.int64), parts=parts)


@pytest.mark.parametrize("vocab", [45, CHUNK + 40])
def test_under_rows_picked_from_a_narrower_table(vocab):
    # The grammar masks' host rows: one per slot, as wide as the tokenizer's vocabulary
    # (one word short of the logits here); each logits row names its slot, and past the
    # table a row's padding ids are all disallowed (0) or all allowed (-1).
    torch.manual_seed(vocab)
    slots, rows, words = 7, 5, -(-vocab // 32) - 1
    table = torch.randint(-(2**31), 2**31 - 1, (slots, words), dtype=torch.int32)
    table[2] = 0  # nothing in the table allowed: the padding ids or index 0
    if DEVICE == "cuda":
        table = table.pin_memory()
    picked = torch.tensor([[4, 2, 2, 0, 6], [0, 0, -1, -1, 0]], dtype=torch.int32)
    select = torch.zeros(2, rows + 3, dtype=torch.int32)  # wider than the batch
    select[:, :rows] = picked
    select = select.to(DEVICE)
    logits = torch.randn(rows, vocab, device=DEVICE)
    logits[3, -1] = 1e4  # a padding id's logit, the largest: allowed in row 3 only
    full = torch.cat([table[picked[0].long()], picked[1, :, None].expand(rows, 1)], 1)
    want = masked_reference(logits, full.to(DEVICE))
    assert want[1] == 0 and want[2] >= 32 * words and want[3] == vocab - 1
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
        got = greedy_ids(x, out, MaskRows(table, select))
        assert torch.equal(got, masked_reference(x, full.to(DEVICE)))


def test_the_grammar_masks_argmax_reads_each_rows_slot(tokenizer):
    # The engine's use: rows picked by slot from the masks' host rows, as they change
    # order and kind from step to step, padding ids past the tokenizer's.
    from tests.engine.test_structured_batches import check_padding_masks

    check_padding_masks(tokenizer, DEVICE, greedy=True)
