"""greedy_ids equals torch.argmax: ties go to the first index, NaN wins, rows of -inf
give 0, and vocabularies off the chunk multiples."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import CHUNK, greedy_ids

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
