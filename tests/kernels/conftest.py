"""Kernel tests: on a CPU-only machine the Triton kernels run in Triton's interpreter.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function: our kernels when
kernels/*.py is imported, and Triton's own library functions (tl.cdiv, tl.sum, tl.max, ...)
when triton.language is. Pytest imports this conftest only after tests/conftest.py, which
imports the model code and so triton and kernels (checked by experiment), so setting the
variable here is too late on its own: the modules holding jit functions are then reloaded,
library first, so every kernel and library function is re-decorated for the interpreter.
That is safe on CPU, where the engine calls only the torch references. With a GPU present
nothing changes and the same tests run compiled on CUDA.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import zlib

import pytest
import torch

from tests.kernels.jit_modules import JIT_MODULES

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in JIT_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> torch.Generator:
    """A fresh, reproducible seed per test case (derived from its id)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _paged_kv(
    rng: torch.Generator,
    device: torch.device,
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks_per_seq: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and a shuffled block table for sequences of `context_lens` tokens.

    Every cache slot outside a context holds NaN, and unused block-table entries point at
    an all-NaN block, so a kernel that reads past a context_len turns its output NaN.
    """
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    if max_blocks_per_seq is None:
        max_blocks_per_seq = max(blocks_per_seq + [1])
    num_blocks = sum(blocks_per_seq) + 1  # + the NaN block, last
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_table = torch.full(
        (len(context_lens), max_blocks_per_seq), num_blocks - 1, dtype=torch.int32
    )
    order = torch.randperm(num_blocks - 1, generator=rng)  # blocks out of order
    taken = 0
    for seq, (n, n_blocks) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        blocks = order[taken : taken + n_blocks]
        taken += n_blocks
        block_table[seq, :n_blocks] = blocks.int()
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        for cache in (k_cache, v_cache):
            values = torch.randn(n, num_kv_heads, head_dim, generator=rng).to(dtype)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values
    return k_cache.to(device), v_cache.to(device), block_table.to(device)


@pytest.fixture
def paged_kv(rng: torch.Generator, device: torch.device):
    """`paged_kv(context_lens, num_kv_heads, head_dim, block_size)` -> k_cache, v_cache, block_table."""
    return functools.partial(_paged_kv, rng, device)
