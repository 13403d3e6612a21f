"""FP8 on CUDA (compute capability 8.9+): the `_scaled_mm` linear against bf16 and its
reference, under a CUDA graph; Fp8Linear's paths by batch size; the FP8 cache kernels
with bf16 queries; an engine with FP8 weights and FP8 KV against the bf16 engine on a
tiny checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.models.quantization import Fp8Linear
from kernels.attention_ref import paged_attention_decode_ref, paged_prefill_attention_ref
from kernels.fp8 import (
    FP8_DTYPE,
    fp8_linear,
    fp8_linear_ref,
    fp8_supported,
    quantize_fp8_ref,
    quantize_per_channel,
)
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import paged_prefill_attention
from tests.gpu.on_cuda import GPU
from tests.reference import PROMPTS

pytestmark = [
    *GPU,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")),
        reason="needs FP8 (compute capability 8.9+)",
    ),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_fp8_linear_close_to_bf16_and_to_its_reference(m: int, dtype: torch.dtype) -> None:
    k, n = 4096, 1536
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    q, scale = quantize_per_channel(w)
    out = fp8_linear(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    # The same quantization, computed by dequantizing: only accumulation order, the
    # output's rounding and a rare one-step difference in the activations' rounding.
    assert _rel(out, fp8_linear_ref(x, q, scale, bias)) < 0.01
    # Against the unquantized GEMM: e4m3's rounding of both operands (~3.5% on Gaussian data).
    assert _rel(out - bias, F.linear(x, w).float()) < 0.05


@pytest.mark.parametrize("n", [4096, 6144, 28672])
@pytest.mark.parametrize("m", [1, 16, 17, 40, 64, 65])
def test_fp8_linear_module_by_batch(m: int, n: int) -> None:
    """Fp8Linear's two paths, x quantized per token on both: e4m3 dots in split-K up to
    64 rows, `_scaled_mm` past that; each against fp8_linear_ref (a weight-only product
    is ~3% away, past the tolerance)."""
    k = 4096
    linear = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    out = fp8(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert _rel(out, fp8_linear_ref(x, fp8.weight, fp8.weight_scale, fp8.bias)) < 0.01


def test_fp8_linear_replays_in_a_cuda_graph() -> None:
    linear = Fp8Linear.from_linear(torch.nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    linear(x)  # compile the Triton quantizer outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, linear(x), rtol=0, atol=0)


# 4 sequences take the split-KV launch; 64 (512 programs) the unsplit one.
@pytest.mark.parametrize("num_seqs", [4, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_kernels_with_half_queries(dtype: torch.dtype, num_seqs: int) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    num_blocks, k_scale, v_scale = 64 * 32, 0.02, 0.015
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = quantize_fp8_ref(torch.randn(shape, device="cuda"), k_scale)
    v_cache = quantize_fp8_ref(torch.randn(shape, device="cuda"), v_scale)
    lens = torch.tensor([1, 17, 300, 512], dtype=torch.int32, device="cuda")
    if num_seqs > 4:
        lens = torch.randint(1, 513, (num_seqs,), dtype=torch.int32, device="cuda")
    table = torch.randperm(num_blocks, device="cuda")[: num_seqs * 32].view(num_seqs, 32).int()
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    query = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=dtype)
    got = paged_attention_decode(query, k_cache, v_cache, table, lens, 0.088, **scales)
    want = paged_attention_decode_ref(query, k_cache, v_cache, table, lens, 0.088, **scales)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)
    if num_seqs > 4:
        return  # prefill: the 4 sequences' contexts
    qlens = [1, 17, 40, 100]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(qlens), num_heads, head_dim, device="cuda", dtype=dtype)
    args = (query, k_cache, v_cache, table, qsl.cuda(), lens, 0.088, max(qlens))
    got = paged_prefill_attention(*args, **scales)
    torch.testing.assert_close(
        got, paged_prefill_attention_ref(*args, **scales), rtol=2e-2, atol=1e-2
    )


# Teacher-forced agreement: the FP8 engine scores the bf16 engine's greedy continuations
# (prompt logprobs), so one flipped token does not derail the rest. The tiny random
# checkpoints have small top-1 margins (~0.1-0.5 nats), so e4m3's ~3.5% error per GEMM
# flips a share of them: the CPU references of the same FP8 path agree on 70-80% of the
# positions of the tiny llama/gpt2/qwen2 checkpoints (bf16 reference, 9 prompts x 32
# tokens), 72-73% of the qwen3_moe and gpt_oss ones (a flipped expert choice adds to the
# error). 60% and 50% leave room for the GPU's different rounding; a broken path (a
# scale missing or inverted, a transposed weight, an unscaled cache) lands near chance
# (1 in ~500 tokens).
MIN_AGREEMENT = 0.6
MIN_MOE_AGREEMENT = 0.5
NEW = 32


def _fp8_against_bf16(model_dir: str, graphs: bool) -> tuple[LLM, float]:
    """The FP8-weights, FP8-cache engine and its teacher-forced agreement with bf16."""
    gen = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    base = LLM(model_dir, device="cuda", dtype="bfloat16", max_num_seqs=16)
    outs = base.generate(PROMPTS, gen, use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    fp8 = LLM(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=16,
        quantization="fp8",
        kv_cache_dtype="fp8",
        enforce_eager=not graphs,
    )
    runner = fp8.engine.runner
    assert runner.attn_layers[0].k_cache.dtype == FP8_DTYPE
    assert 2 * runner.bytes_per_block() == base.engine.runner.bytes_per_block()
    # Its own greedy decode runs (graphs or eager) and mostly matches on the first token.
    own = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, gen, use_tqdm=False)]
    assert sum(a[0] == b.outputs[0].token_ids[0] for a, b in zip(own, outs)) >= len(PROMPTS) // 2
    if graphs:  # the decode steps replayed CUDA graphs with the FP8 GEMMs and cache
        assert runner.steps_by_path["graph"] > 0
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = fp8.generate(seqs, score, use_tqdm=False)
    ranks = [
        o.prompt_logprobs[p].rank
        for o in scored
        for p in range(len(o.prompt_token_ids) - NEW, len(o.prompt_token_ids))
    ]
    return fp8, sum(r == 1 for r in ranks) / len(ranks)


@pytest.mark.parametrize("graphs", [True, False])
def test_fp8_engine_mostly_agrees_with_bf16(tiny_model_dir: str, graphs: bool) -> None:
    fp8, agreement = _fp8_against_bf16(tiny_model_dir, graphs)
    assert sum(isinstance(m, Fp8Linear) for m in fp8.engine.model.modules()) == 8
    assert agreement >= MIN_AGREEMENT, agreement


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_fp8_moe_engine_mostly_agrees_with_bf16(tiny_family_dir, kind: str) -> None:
    """FP8 experts through the per-pair GEMVs (decode, graphs) and the grouped GEMMs
    (prefill), SiLU or GPT-OSS's biases and clamp."""
    fp8, agreement = _fp8_against_bf16(tiny_family_dir(kind), graphs=True)
    moe = fp8.engine.model.layers[0].mlp
    assert moe.w13.dtype == moe.w2.dtype == FP8_DTYPE
    assert agreement >= MIN_MOE_AGREEMENT, agreement


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_fp8_latent_cache_mostly_agrees_with_bf16(tiny_family_dir, kind: str) -> None:
    """DeepSeek's latent cache in e4m3 (one row a token; the MLA kernel folds its scale
    into the softmax and the output), beside FP8 projections and experts."""
    fp8, agreement = _fp8_against_bf16(tiny_family_dir(kind), graphs=True)
    assert fp8.engine.runner.attn_layers[0].KV_TENSORS == 1
    assert agreement >= MIN_MOE_AGREEMENT, agreement


@pytest.mark.parametrize("kind", ["qwen3_next", "granitemoehybrid"])
def test_fp8_recurrent_models_mostly_agree_with_bf16(tiny_family_dir, kind: str) -> None:
    """FP8 projections out of the Gated DeltaNet and Mamba-2 mixers (their states stay
    fp32), FP8 experts and cache; decode steps replayed from graphs."""
    fp8, agreement = _fp8_against_bf16(tiny_family_dir(kind), graphs=True)
    mixer = fp8.engine.model.layers[0].self_attn
    assert isinstance(mixer.out_proj, Fp8Linear)
    # The rule's state (the DeltaNet's, Mamba-2's) is allocated in fp32 beside FP8 weights.
    assert torch.float32 in {getattr(mixer, name).dtype for name in mixer.state_shapes()}
    assert agreement >= MIN_MOE_AGREEMENT, agreement


def test_fp8_ungated_experts_mostly_agree_with_bf16(tiny_family_dir) -> None:
    """Nemotron 3's relu^2 experts in e4m3 (w13 holds their up rows alone), beside FP8
    projections, Mamba-2 mixers and an FP8 cache; decode steps replayed from graphs."""
    fp8, agreement = _fp8_against_bf16(tiny_family_dir("nemotron_h_moe"), graphs=True)
    moe = fp8.engine.model.layers[1].mixer
    assert moe.w13.dtype == FP8_DTYPE and moe.w13.shape[1] == moe.w2.shape[2]
    assert agreement >= MIN_MOE_AGREEMENT, agreement
