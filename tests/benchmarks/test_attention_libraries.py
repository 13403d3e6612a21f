"""benchmarks.attention_libraries on the CPU: the block table handed to FlashInfer."""

from __future__ import annotations

import torch

from benchmarks.attention_libraries import page_csr


def test_page_csr_lists_each_sequences_blocks_in_order():
    table = torch.tensor(
        [[7, 3, 9, 0], [4, 0, 0, 0], [1, 2, 5, 6], [8, 8, 8, 8]], dtype=torch.int32
    )
    lens = torch.tensor([33, 16, 64, 0], dtype=torch.int32)
    csr = page_csr(table, lens, block_size=16)
    assert csr.indptr.tolist() == [0, 3, 4, 8, 8]
    assert csr.indices.tolist() == [7, 3, 9, 4, 1, 2, 5, 6]
    assert csr.last_page_len.tolist() == [1, 16, 16, 0]
    assert {t.dtype for t in (csr.indptr, csr.indices, csr.last_page_len)} == {torch.int32}
