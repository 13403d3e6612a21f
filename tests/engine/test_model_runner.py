"""The runner's staging buffer: fields of mixed dtypes in one buffer, one copy."""

from __future__ import annotations

import numpy as np
import torch

from engine.staging import StagedFields


def test_staged_fields_pack_int64_and_int32_fields_in_one_buffer():
    fields = StagedFields(
        {"ids": (5, torch.int64), "lens": (3, torch.int32), "starts": (4, torch.int32)},
        torch.device("cpu"),
        device_only={"sampled": (2, torch.int64)},
    )
    fields.np["ids"][:] = [10, 11, 12, 13, 14]
    fields.np["lens"][:] = [7, 8, 9]
    fields.np["starts"][:] = [-1, 0, 1, 2**31 - 1]
    fields.gpu["sampled"][:] = torch.tensor([20, 21])
    fields.send()  # on CPU the device twin is the host buffer itself
    assert fields.gpu["ids"].dtype == torch.int64
    assert fields.gpu["ids"].tolist() == [10, 11, 12, 13, 14]
    assert fields.gpu["lens"].dtype == torch.int32 and fields.gpu["lens"].tolist() == [7, 8, 9]
    assert fields.gpu["starts"].tolist() == [-1, 0, 1, 2**31 - 1]
    assert fields.np["lens"].dtype == np.int32
    # int64 fields are addressable in `words` by their offset: how input ids are gathered.
    gather = torch.tensor([fields.offset["ids"] + 2, fields.offset["sampled"] + 1])
    assert fields.words[gather].tolist() == [12, 21]
    # Fields do not overlap, and each starts aligned for any integer view.
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in fields.gpu.values()
    )
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(start % StagedFields.ALIGN == 0 for start, _ in spans)
