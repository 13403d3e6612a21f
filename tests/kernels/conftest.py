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
from dataclasses import dataclass

import pytest
import torch

# Modules holding jit functions, in dependency order (a module after those it imports from).
JIT_MODULES = (
    "triton.language.standard",
    "triton.language.random",
    "triton.language",
    "kernels.rounding",
    "kernels.pdl",
    "kernels.argmax",
    "kernels.host_copy",
    "kernels.fp8",
    "kernels.kv_store",
    "kernels.decode_config",
    "kernels.norms",
    "kernels.rotary",
    "kernels.score_mods",
    "kernels.paged_attention",
    "kernels.linear",
    "kernels.prefill_config",
    "kernels.prefill_attention",
    "kernels.activation",
    "kernels.moe_gemv",
    "kernels.moe_align",
    "kernels.fused_moe",
    "kernels.moe_routing",
    "kernels.mla_store",
    "kernels.mla",
    "kernels.gated_delta",
    "kernels.delta_chunk_scan",
    "kernels.mamba2_step",
    "kernels.conv_step",
    "kernels.gated_norm",
)

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


@dataclass(frozen=True)
class WalkedSequences:
    """The walk kernels' sequences in their tests: three end to end (7 tokens from a
    state, 5 from zeros, 1 from a state), or the first alone, then a graph's padding:
    two tokens past them and a sequence of none at the spare slot 5. Slots 1, 2 and 5
    belong to no real sequence."""

    starts: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    has_state: torch.Tensor
    tokens: int  # rows, padding included
    real: int  # rows of real sequences

    @classmethod
    def of(cls, seqs: int, device: torch.device) -> WalkedSequences:
        lengths = torch.tensor([7, 5, 1][:seqs] + [0], device=device, dtype=torch.int32)
        starts = (torch.cumsum(lengths, 0) - lengths).to(torch.int32)
        slots = torch.tensor([4, 0, 3][:seqs] + [5], device=device)
        has_state = torch.tensor([True, False, True][:seqs] + [False], device=device)
        real = int(lengths.sum())
        return cls(starts, lengths, slots, has_state, real + 2, real)


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
