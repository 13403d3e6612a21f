"""The rotary (with q/k norms) and gated-activation kernels on CUDA against their torch
references on CUDA, at real model shapes, and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from engine.models.rope import RotaryEmbedding
from kernels.activation import act_and_mul, act_and_mul_ref
from kernels.rotary import QKNorm, rotary, rotary_ref
from tests.gpu.on_cuda import GPU

pytestmark = GPU

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (num_heads, num_kv_heads, head_dim): Llama-3-8B, Qwen2.5-0.5B, Phi-3 (head_dim 96),
# Gemma 3 1B (one kv head, head_dim 256).
SHAPES = [(32, 8, 128), (14, 2, 64), (32, 32, 96), (4, 1, 256)]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def cos_sin(head_dim: int, max_positions: int = 16384) -> torch.Tensor:
    rotary_emb = RotaryEmbedding(head_dim, max_positions, 500000.0, LLAMA3_SCALING)
    rotary_emb.build_cache(torch.device("cuda"))
    return rotary_emb.cos_sin


def qkv_split(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda").to(dtype)
    return qkv, qkv.split([q_size, kv_size, kv_size], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_rotary_bit_for_bit(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    torch.manual_seed(num_tokens + head_dim)
    qkv, (q, k, v) = qkv_split(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.randint(0, 16384, (num_tokens,), device="cuda")
    cache = cos_sin(head_dim)
    want_q, want_k = rotary_ref(positions, q, k, cache)
    v_before = v.clone()
    got_q, got_k = rotary(positions, q, k, cache)
    # The same roundings as the unfused ops, and no FMA contraction: the same bits.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("num_tokens", [1, 4096])
def test_rotary_with_qk_norm(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    torch.manual_seed(num_tokens)
    qkv, (q, k, _) = qkv_split(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.randint(0, 16384, (num_tokens,), device="cuda")
    weights = (1 + 0.3 * torch.randn(2, head_dim, device="cuda")).to(dtype)
    norm = QKNorm(weights[0], weights[1], 1e-6)
    cache = cos_sin(head_dim)
    want_q, want_k = rotary_ref(positions, q, k, cache, norm)
    got_q, got_k = rotary(positions, q, k, cache, norm)
    eps = torch.finfo(dtype).eps  # the norm's sum runs in another order than torch's
    torch.testing.assert_close(got_q, want_q, rtol=2 * eps, atol=4 * eps)
    torch.testing.assert_close(got_k, want_k, rtol=2 * eps, atol=4 * eps)


def test_rotary_replayed_in_cuda_graph_follows_new_positions():
    num_tokens, num_heads, num_kv_heads, head_dim, dtype = 16, 32, 8, 128, torch.bfloat16
    qkv, (q, k, _) = qkv_split(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.zeros(num_tokens, dtype=torch.long, device="cuda")
    cache = cos_sin(head_dim)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rotary(positions, q, k, cache)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary(positions, q, k, cache)
    for _ in range(3):
        qkv.normal_()
        positions.random_(0, 16384)
        want_q, want_k = rotary_ref(positions, q, k, cache)
        graph.replay()
        assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("num_tokens", "inter"), [(1, 14336), (64, 4864), (4096, 14336)])
def test_act_and_mul(num_tokens, inter, activation, dtype):
    torch.manual_seed(num_tokens)
    x = (3 * torch.randn(num_tokens, 2 * inter, device="cuda")).to(dtype)
    got = act_and_mul(x, activation)
    eps = torch.finfo(dtype).eps
    rtol = 1e-6 if dtype == torch.float32 else 2 * eps  # exp/tanh differ from torch's by ulps
    torch.testing.assert_close(got, act_and_mul_ref(x, activation), rtol=rtol, atol=1e-5)
