"""Weights staged through pinned buffers land exactly as a plain copy puts them."""

from __future__ import annotations

import pytest
import torch

from engine.models import weight_copy
from engine.models.loader import load_model
from engine.models.weight_copy import fill, staged_copies
from tests.gpu.on_cuda import GPU

pytestmark = GPU


@pytest.fixture
def small_buffers(monkeypatch):
    """Buffers of 4 KiB: every tensor below takes several pieces and reuses each buffer."""
    monkeypatch.setattr(weight_copy, "BUFFER_BYTES", 4096)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(300, 50),  # 200-byte rows: 20 rows a piece, 15 pieces
        lambda: torch.randn(50, 300).t(),  # not contiguous (GPT-2's transposed Conv1D)
        lambda: torch.randn(64, 600)[:, 100:400],  # a column range (row-parallel shard)
        lambda: torch.randn(3, 2000),  # rows larger than a buffer: copied as they are
        lambda: torch.tensor(2.5),  # a scalar
        lambda: torch.empty(0, 8),  # no rows (a rank's share of a small vocabulary)
    ],
)
def test_staged_copies_equal_plain_ones(small_buffers, make):
    src = make()
    for dtype in (torch.float32, torch.bfloat16):  # the same dtype, and converted
        dst = torch.full(src.shape, float("nan"), dtype=dtype, device="cuda")
        with staged_copies(torch.device("cuda")):
            fill(dst, src)
        torch.testing.assert_close(dst.cpu(), src.to(dtype), rtol=0, atol=0)


def test_a_loaded_model_equals_its_checkpoint(small_buffers, tiny_family_dir):
    model_dir = tiny_family_dir("llama")
    on_gpu, _ = load_model(model_dir, torch.device("cuda"), torch.float32)
    on_cpu, _ = load_model(model_dir, torch.device("cpu"), torch.float32)
    cpu_params = dict(on_cpu.named_parameters())
    for name, param in on_gpu.named_parameters():
        torch.testing.assert_close(param.cpu(), cpu_params[name], rtol=0, atol=0, msg=name)
