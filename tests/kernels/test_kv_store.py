"""kv_store (Triton) against kv_store_ref."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_store import kv_store, kv_store_for, kv_store_ref


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"),
    [(12, 64, 16), (2, 32, 32), (2, 80, 16), (3, 96, 32), (1, 64, 16)],
)
def test_kv_store_matches_reference(
    num_kv_heads: int, head_dim: int, block_size: int, rng: torch.Generator, device: torch.device
) -> None:
    num_blocks, num_tokens = 6, 11
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=rng)
    v_cache = torch.randn(shape, generator=rng)
    # K and V as the engine slices them out of one fused projection: strided views.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=rng)
    key, value = qkv[:, 1], qkv[:, 2]  # [num_tokens, num_kv_heads, head_dim]
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv_store_ref(key, value, expected_k, expected_v, slots)

    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    kv_store(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    assert torch.equal(k_cache.cpu(), expected_k)
    assert torch.equal(v_cache.cpu(), expected_v)


def test_kv_store_casts_to_cache_dtype(rng: torch.Generator, device: torch.device) -> None:
    k_cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 64, generator=rng).to(device)
    value = torch.randn(3, 2, 64, generator=rng).to(device)
    slots = torch.tensor([31, 0, 5], device=device)
    kv_store(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 64)[slots], key.half())
    assert torch.equal(v_cache.view(-1, 2, 64)[slots], value.half())


def test_kv_store_for_picks_reference_off_cuda() -> None:
    assert kv_store_for(torch.device("cpu")) is kv_store_ref
