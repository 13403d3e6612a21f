"""The runner's staging buffer: fields of mixed dtypes in one buffer, one copy; what a
step's fill writes there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM
from engine.staging import StagedFields
from tests.engine.test_input_batch import PLANS, drive


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


FIELDS = ["slot_indices", "query_start_loc", "logits_indices", "input_gather", "positions"]
FIELDS += ["slot_mapping", "seq_lens"]


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])  # CUDA: two host buffers, alternating
def test_decode_fills_kept_for_a_batch_layout_equal_fresh_fills(tiny_gpt2_dir, device):
    """A steady decode (the same InputBatch layout as the last step's, each input
    sampled by the same row) leaves what the buffer holds from its own last one:
    slot indices, query starts, logits rows, input gather. With requests entering,
    leaving, preempted and aborted, every step's staged fields must equal those of
    fills that rewrite everything."""

    def staged(keep_layouts: bool) -> tuple[list, int]:
        llm = LLM(
            tiny_gpt2_dir,
            device=device,
            block_size=4,
            max_model_len=96,
            num_kv_blocks=28,
            max_num_seqs=6,
            max_num_batched_tokens=32,
        )
        runner = llm.engine.runner
        fill = runner.fill
        steps: list = []
        kept = 0

        def recorded(out):
            nonlocal kept
            if not keep_layouts:
                runner.steady_layout = [None] * runner.num_buffers
                runner.sampled_layout = None
            kept += out.layout is not None and out.layout in runner.steady_layout
            max_query_len = fill(out)
            sizes = [out.num_seqs, out.num_seqs + 1, out.num_sampling] + [out.num_tokens] * 3
            sizes.append(out.num_seqs)
            steps.append([runner.buf[f][:k].tolist() for f, k in zip(FIELDS, sizes)])
            steps[-1].append(max_query_len)
            return max_query_len

        runner.fill = recorded
        drive(llm.engine, PLANS, every=9, abort=(90, "r7"))
        assert llm.engine.scheduler.num_preemptions > 0
        return steps, kept

    (kept_steps, kept), (fresh_steps, _) = staged(True), staged(False)
    assert kept > 20  # decodes of an unchanged batch reused what the buffer held
    assert kept_steps == fresh_steps
