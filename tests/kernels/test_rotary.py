"""rotary (Triton) against rotary_ref: q/k rotation in place on the qkv output, with and
without the per-head RMSNorm, across dtypes, head dims, GQA shapes and rope variants."""

from __future__ import annotations

import pytest
import torch

from engine.models.rope import RotaryEmbedding
from kernels.rotary import QKNorm, rotary, rotary_for, rotary_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_heads, num_kv_heads, head_dim): MHA, Qwen2.5-0.5B's GQA, Llama-3-8B's GQA (fewer
# heads), Phi-3's head_dim of 96 (a half of 48 is not a power of two), one k head.
SHAPES = [(4, 4, 64), (14, 2, 64), (8, 2, 128), (6, 1, 96)]
MAX_POSITIONS = 4096


def cos_sin_cache(head_dim: int, scaling: dict | None = None) -> torch.Tensor:
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, 10000.0, scaling)
    rotary.build_cache(torch.device("cpu"))
    return rotary.cos_sin  # [MAX_POSITIONS, head_dim] fp32


def qkv_output(rng, num_tokens, num_heads, num_kv_heads, head_dim, dtype) -> torch.Tensor:
    """[num_tokens, q_size + 2 * kv_size], as the qkv GEMM leaves it."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    return (2 * torch.randn(num_tokens, width, generator=rng)).to(dtype)


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    """q, k, v: column ranges of the qkv output, so rows are strided."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


def run_both(device, qkv, positions, cos_sin, norm, num_heads, num_kv_heads):
    """(rotary's q, k), (rotary_ref's q, k), on CPU."""
    head_dim = cos_sin.shape[1]
    q, k, _ = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    want_q, want_k = rotary_ref(positions, q, k, cos_sin, norm)
    q, k, v = split_qkv(qkv.to(device), num_heads, num_kv_heads, head_dim)
    dev_norm = norm and QKNorm(norm.q_weight.to(device), norm.k_weight.to(device), norm.eps)
    got_q, got_k = rotary(positions.to(device), q, k, cos_sin.to(device), dev_norm)
    # In place: the returned tensors are the qkv output's own columns; v is untouched.
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(v.cpu(), split_qkv(qkv, num_heads, num_kv_heads, head_dim)[2])
    return (got_q.cpu(), got_k.cpu()), (want_q, want_k)


@pytest.mark.parametrize("many_tokens", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_rotary_matches_reference_bit_for_bit(
    num_heads, num_kv_heads, head_dim, dtype, many_tokens, rng, device, monkeypatch
):
    num_tokens = 5
    if many_tokens:  # the prefill launch's narrower programs (at most 8 heads, 1 warp)
        monkeypatch.setattr("kernels.rotary.MANY_TOKENS", num_tokens)
    qkv = qkv_output(rng, num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=rng)
    positions[0] = MAX_POSITIONS - 1
    cos_sin = cos_sin_cache(head_dim)
    (got_q, got_k), (want_q, want_k) = run_both(
        device, qkv, positions, cos_sin, None, num_heads, num_kv_heads
    )
    # Same roundings in the same order as the unfused ops: the same bits.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (8, 2, 128)])
def test_rotary_with_qk_norm_matches_reference(
    num_heads, num_kv_heads, head_dim, dtype, rng, device
):
    num_tokens = 6
    qkv = qkv_output(rng, num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=rng)
    norm = QKNorm(
        (1 + 0.3 * torch.randn(head_dim, generator=rng)).to(dtype),
        (1 + 0.3 * torch.randn(head_dim, generator=rng)).to(dtype),
        1e-6,
    )
    (got_q, got_k), (want_q, want_k) = run_both(
        device, qkv, positions, cos_sin_cache(head_dim), norm, num_heads, num_kv_heads
    )
    # The head's sum of squares is added in another order than torch's mean, so the
    # normed value can differ by one unit in its last place (in the activation dtype).
    eps = torch.finfo(dtype).eps
    for got, want in ((got_q, want_q), (got_k, want_k)):
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=4 * eps)
    # The norm ran: the raw values rotated come out far off.
    q, k, _ = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    raw_q, _ = rotary_ref(positions, q, k, cos_sin_cache(head_dim))
    assert not torch.allclose(got_q.float(), raw_q.float(), atol=0.1)


ROPE_SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    # Phi-3's: short factors below the original length, long ones (and an attention
    # factor on cos and sin) from there on.
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 1024,
        "short_factor": [1.0 + 0.05 * i for i in range(48)],
        "long_factor": [2.0 + 0.25 * i for i in range(48)],
    },
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rotary_reads_scaled_caches(kind, rng, device):
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 96, 6
    qkv = qkv_output(rng, num_tokens, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    positions = torch.tensor([0, 1, 1023, 1024, 3000, MAX_POSITIONS - 1])
    cos_sin = cos_sin_cache(head_dim, ROPE_SCALINGS[kind])
    (got_q, got_k), (want_q, want_k) = run_both(
        device, qkv, positions, cos_sin, None, num_heads, num_kv_heads
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rotary_of_no_tokens_launches_nothing(device):
    qkv = torch.empty(0, 3 * 64, device=device)
    q, k, _ = qkv.split(64, dim=-1)
    got_q, got_k = rotary(
        torch.empty(0, dtype=torch.long, device=device), q, k, cos_sin_cache(64).to(device)
    )
    assert got_q.shape == (0, 64) and got_k.shape == (0, 64)


def test_rotary_for_picks_reference_off_cuda():
    assert rotary_for(torch.device("cpu")) is rotary_ref
