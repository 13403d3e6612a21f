"""The KV kernels over an FP8 (e4m3) cache against their references: the store
quantizes by 1 / scale (the same bytes as the reference), attention reads the cache
back times the scale."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.layers import AttentionOps, PagedAttention
from engine.models.loader import load_tokenizer
from kernels.attention_ref import paged_attention_decode_ref, paged_prefill_attention_ref
from kernels.decode_config import DecodeConfig
from kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8_ref
from kernels.kv_store import kv_store, kv_store_ref
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import paged_prefill_attention
from kernels.prefill_config import prefill_config
from tests.reference import PROMPTS, hf_greedy

# Scales: none (vLLM's default without checkpoint scales), and ones that matter, one of
# them not a power of two.
SCALES = [(1.0, 1.0), (0.5, 0.37)]
# The attention tests also soft-cap with the scales that matter: the cap must be taken in
# the scores' own units, with k_scale already in them.
# (k_scale, v_scale, softcap, sinks): scales off 1 with a soft-cap and sinks, which are
# in the scores' units, not the cache's.
ATTENTION_CASES = [(1.0, 1.0, 0.0, False), (0.5, 0.37, 1.5, True)]


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.cpu().view(torch.uint8)


def _fp8_caches(paged_kv, context_lens, num_kv_heads, head_dim, block_size, k_scale, v_scale):
    k_cache, v_cache, block_table = paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, max_blocks_per_seq=16
    )
    return quantize_fp8_ref(k_cache, k_scale), quantize_fp8_ref(v_cache, v_scale), block_table


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_fp8_store_matches_reference(
    k_scale: float, v_scale: float, rng: torch.Generator, device: torch.device
) -> None:
    shape = (5, 16, 2, 64)
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE)
    v_cache = torch.zeros(shape, dtype=FP8_DTYPE)
    # Outliers past the e4m3 range must saturate, not turn into NaN.
    key = torch.randn(9, 2, 64, generator=rng) * 40
    value = torch.randn(9, 2, 64, generator=rng)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 447.9, -0.0])
    # Ties and near-ties, normal and subnormal, that one rounding to nearest even gets
    # right: 1.0625 + 2**-20 goes up, where rounding through fp16 first would tie it down.
    sub = 2.0**-9  # e4m3's subnormal step
    ties = [1.0625, 1.1875, 1.0625 + 2**-20, -1.9375, 15.5, 1.5 * sub, 2.5 * sub, 0.5 * sub]
    ties += [0.5 * sub + 2**-20, -7.5 * sub, 432.0, 440.0]
    key[1, 0, : len(ties)] = torch.tensor(ties) * k_scale
    slots = torch.randperm(5 * 16, generator=rng)[:9]
    slots[3] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_store_ref(key, value, want_k, want_v, slots, k_scale, v_scale)

    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    kv_store(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), k_scale, v_scale)
    assert torch.equal(_bytes(k_cache), _bytes(want_k))
    assert torch.equal(_bytes(v_cache), _bytes(want_v))
    # What the cache holds, read back: within e4m3's half step (1/16 relative), saturated.
    stored = slots >= 0
    back = want_k.view(-1, 2, 64)[slots[stored]].float() * k_scale
    expected = key[stored].clamp(-FP8_MAX * k_scale, FP8_MAX * k_scale)
    assert not back.isnan().any()
    torch.testing.assert_close(back, expected, rtol=1 / 16, atol=2**-9 * k_scale)


@pytest.mark.parametrize(("k_scale", "v_scale", "softcap", "sinks"), ATTENTION_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode_stores_and_attends_like_reference(
    k_scale: float,
    v_scale: float,
    softcap: float,
    sinks: bool,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    context_lens = [0, 1, block_size + 1, 3 * block_size + 5, 120]
    k_cache, v_cache, block_table = _fp8_caches(
        paged_kv, context_lens, num_kv_heads, head_dim, block_size, k_scale, v_scale
    )
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    positions = (lens - 1).clamp(min=0).long()
    blocks = block_table.long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = blocks * block_size + positions % block_size
    slots[0] = -1
    num_seqs = len(context_lens)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=rng).to(device)
    new_k = torch.randn(num_seqs, num_kv_heads, head_dim, generator=rng).to(device)
    new_v = torch.randn(num_seqs, num_kv_heads, head_dim, generator=rng).to(device)
    scale = head_dim**-0.5
    kwargs = dict(new_k=new_k, new_v=new_v, slot_mapping=slots, k_scale=k_scale, v_scale=v_scale)
    kwargs["softcap"] = softcap
    kwargs["sinks"] = torch.randn(num_heads, generator=rng).to(device) if sinks else None
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = paged_attention_decode_ref(query, ref_k, ref_v, block_table, lens, scale, **kwargs)
    result = paged_attention_decode(
        query,
        k_cache,
        v_cache,
        block_table,
        lens,
        scale,
        config=DecodeConfig(num_splits=num_splits, block_n=32),
        **kwargs,
    )
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert not result[0].any()
    assert torch.equal(_bytes(k_cache), _bytes(ref_k))
    assert torch.equal(_bytes(v_cache), _bytes(ref_v))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("k_scale", "v_scale", "softcap", "sinks"), ATTENTION_CASES)
def test_fp8_prefill_matches_reference(
    k_scale: float,
    v_scale: float,
    softcap: float,
    sinks: bool,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    chunks = [(24, 24), (20, 57), (0, 9), (1, 40)]
    query_lens, seq_lens = zip(*chunks, strict=True)
    k_cache, v_cache, block_table = _fp8_caches(
        paged_kv, list(seq_lens), num_kv_heads, head_dim, block_size, k_scale, v_scale
    )
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=rng).to(device)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, block_table, qsl.to(device), lens, head_dim**-0.5)
    scales = dict(k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    scales["sinks"] = torch.randn(num_heads, generator=rng).to(device) if sinks else None
    # Split keys merge partials already scaled by v_scale (the unsplit path scales once).
    config = prefill_config(max(query_lens), head_dim, num_heads // num_kv_heads)
    config = dataclasses.replace(config, num_splits=num_splits)
    result = paged_prefill_attention(*args, max(query_lens), config=config, **scales)
    expected = paged_prefill_attention_ref(*args, max(query_lens), **scales)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)


def test_fp8_attention_reference_tracks_full_precision(rng: torch.Generator, paged_kv) -> None:
    """The FP8 cache's attention stays near the fp32 cache's: the quantization error of
    K and V (<= 1/16 relative) averages out in the softmax-weighted sum."""
    context_lens = [40, 77]
    k32, v32, block_table = paged_kv(context_lens, 2, 64, 16, max_blocks_per_seq=8)
    k32, v32 = k32.cpu(), v32.cpu()
    query = torch.randn(2, 8, 64, generator=rng)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    block_table = block_table.cpu()
    exact = paged_attention_decode_ref(query, k32, v32, block_table, lens, 64**-0.5)
    k8, v8 = quantize_fp8_ref(k32, 0.05), quantize_fp8_ref(v32, 0.02)
    approx = paged_attention_decode_ref(
        query, k8, v8, block_table, lens, 64**-0.5, k_scale=0.05, v_scale=0.02
    )
    err = (approx - exact).norm() / exact.norm()
    assert err < 0.05


def _fp8_kv_engine(model_dir: str, ops: AttentionOps, k_scale: float, v_scale: float) -> LLM:
    """A CPU engine whose caches are e4m3 and whose cache kernels are `ops` with scales."""
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=16)
    for layer in llm.engine.model.modules():
        if isinstance(layer, PagedAttention):
            layer.k_cache = torch.zeros_like(layer.k_cache, dtype=FP8_DTYPE)
            layer.v_cache = torch.zeros_like(layer.v_cache, dtype=FP8_DTYPE)
            layer.ops = AttentionOps(
                *(functools.partial(op, k_scale=k_scale, v_scale=v_scale) for op in ops)
            )
    return llm


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
def test_engine_with_fp8_kv_cache_on_triton_matches_reference(tiny_llama_dir):
    """The whole FP8-KV path (prefill chunks, decode with the fused store) on the Triton
    kernels in the interpreter gives the reference kernels' tokens, and stays close
    to transformers' fp32 output."""
    triton_ops = (kv_store, paged_attention_decode, paged_prefill_attention)
    ref_ops = (kv_store_ref, paged_attention_decode_ref, paged_prefill_attention_ref)
    prompts = PROMPTS[:4]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for ops in (triton_ops, ref_ops):
        llm = _fp8_kv_engine(tiny_llama_dir, ops, k_scale=0.05, v_scale=0.05)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    tokenizer = load_tokenizer(tiny_llama_dir)
    want = [hf_greedy(tiny_llama_dir, tokenizer.encode(p), 6) for p in prompts]
    same = sum(
        a == b for o, w in zip(outs[0], want, strict=True) for a, b in zip(o, w, strict=True)
    )
    assert same >= 0.75 * 6 * len(prompts), (outs[0], want)
