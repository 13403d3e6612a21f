"""The engine running on the Triton kernels (interpreted on CPU) still matches transformers.

Catches integration mistakes (index dtypes, strides of the gathered block
table, metadata layout) before the code ever reaches a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.models.experts as experts
import engine.models.layers as layers
import engine.models.llama as llama
import engine.models.parallel as parallel
from engine import LLM, SamplingParams
from engine.models.layers import AttentionOps, PagedAttention
from engine.models.loader import load_tokenizer
from kernels.activation import act_and_mul
from kernels.kv_store import kv_store
from kernels.linear import SPLITK_MAX_M, SplitKConfig, SplitKWorkspace, splitk_linear
from kernels.norms import add_norm
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import paged_prefill_attention
from kernels.rotary import rotary
from kernels.splits import SplitKPartials
from tests.reference import PROMPTS, hf_greedy


def assert_greedy_as_transformers(llm: LLM, model_dir: str, max_tokens: int) -> None:
    """PROMPTS[:4] (1, 20, 10 and 17 tokens) greedy through llm: transformers' tokens."""
    prompts = PROMPTS[:4]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokenizer = load_tokenizer(model_dir)
    want = [hf_greedy(model_dir, tokenizer.encode(p), max_tokens) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want


def use_fused_elementwise(monkeypatch) -> None:
    """The rotary (with q/k norms) and gated-activation kernels, as on CUDA."""
    monkeypatch.setattr(layers, "rotary_for", lambda device: rotary)
    monkeypatch.setattr(llama, "act_and_mul_for", lambda device: act_and_mul)


# With CUDA present Triton compiles the kernels, which cannot take this CPU engine's
# tensors; there tests/gpu runs the engine on them for real.
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_engine_on_triton_kernels_matches_transformers(request, monkeypatch, model):
    use_fused_elementwise(monkeypatch)
    model_dir = request.getfixturevalue(f"tiny_{model}_dir")
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=16)
    ops = AttentionOps(kv_store, paged_attention_decode, paged_prefill_attention)
    for layer in llm.engine.model.modules():
        if isinstance(layer, PagedAttention):
            layer.ops = ops
    assert_greedy_as_transformers(llm, model_dir, 5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_projections_leave_splits_to_the_norms_on_triton(request, monkeypatch, model):
    """Every projection of up to 64 rows on the split-K kernel in two splits, as CUDA's
    decode steps run them: o_proj's and down_proj's (GPT-2's c_proj and mlp_proj) left
    unsummed (SplitKPartials) for the norm kernel after them to sum. Transformers' tokens,
    and the norms did take splits."""
    workspaces: dict[int, SplitKWorkspace] = {}
    took_splits = []

    def split_dense(x, weight, bias, defer=False):
        if x.dim() != 2 or x.shape[0] > SPLITK_MAX_M:
            return F.linear(x, weight, bias)
        n = weight.shape[0]
        config = SplitKConfig(num_splits=2, block_n=32, block_k=32)
        workspace = workspaces.setdefault(n, SplitKWorkspace(n, x.device, config=config))
        return splitk_linear(x.contiguous(), weight, bias, workspace, defer=defer)

    def norm(x, *args):
        took_splits.append(isinstance(x, SplitKPartials))
        return add_norm(x, *args)

    monkeypatch.setattr(parallel, "dense", split_dense)
    monkeypatch.setattr(layers, "add_norm_for", lambda device: norm)
    model_dir = request.getfixturevalue(f"tiny_{model}_dir")
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=16)
    assert_greedy_as_transformers(llm, model_dir, 4)
    assert any(took_splits) and not all(took_splits)


def test_splits_are_left_only_where_every_layer_sums_in_its_norms(tiny_family_dir):
    """Gemma 3's layers add their sublayers' outputs after post-norms of their own, so no
    projection of it may leave splits; Mixtral's attention may (its experts are no
    LlamaMLP)."""
    for kind, want in (("gemma3", set()), ("mixtral", {"o_proj"})):
        model = LLM(tiny_family_dir(kind), device="cpu").engine.model
        left = {n.split(".")[-1] for n, m in model.named_modules() if getattr(m, "sum_later", 0)}
        assert left == want, kind


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
@pytest.mark.parametrize(
    "kind",
    [
        "mixtral",
        "gemma3",
        "gemma2",
        "phi3",
        "gpt_oss",
        "olmo2",
        "gpt_neox",
        "cohere",
        "glm4_moe",
        "llama4",
    ],  # fmt: skip
)
def test_windowed_and_moe_models_on_triton_kernels(tiny_family_dir, monkeypatch, kind):
    """Sliding windows (16, 8 and 14 tokens, crossed by the longer prompts) in the Triton
    attention kernels, Mixtral's experts through the Triton fused MoE, Gemma 3's q/k
    norms and two rotary caches in the rotary kernel, its GeGLU in act_and_mul, Gemma 2's
    soft-capped scores, Phi-3's rotation of 12 of 16 dims a head (reordered q/k
    rows, a table of cos 1 / sin 0 for the rest) in the rotary and decode kernels, and
    GPT-OSS's sinks in both attention kernels and its biased, clamped experts,
    OLMo 2's whole-width q/k norms (the norm kernel on the qkv output's column slices),
    GPT-NeoX's LayerNorm of a residual stream two sublayers read, 4 of 16 dims a
    head rotated, Cohere's bias-free LayerNorm and interleaved rotation, GLM-4.5's
    scaled, group-routed experts beside q/k norms on half-rotated heads, and Llama 4's
    chunks of 8 tokens in both attention kernels (the decode kernel rotating and norming
    q and k itself) and its experts fed their inputs scaled by the router."""
    from kernels.fused_moe import fused_moe
    from kernels.moe_routing import topk_softmax

    monkeypatch.setattr(experts, "fused_moe_for", lambda device: fused_moe)
    monkeypatch.setattr(experts, "select_experts_for", lambda device: topk_softmax)
    use_fused_elementwise(monkeypatch)
    model_dir = tiny_family_dir(kind)
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=16)
    ops = AttentionOps(kv_store, paged_attention_decode, paged_prefill_attention)
    for layer in llm.engine.model.modules():
        if isinstance(layer, PagedAttention):
            layer.ops = ops
    assert_greedy_as_transformers(llm, model_dir, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")
@pytest.mark.parametrize("kind", ["qwen3_5", "granitemoehybrid"])
def test_recurrent_prompts_walked_on_triton_kernels(tiny_family_dir, monkeypatch, kind):
    """Every prompt step's DeltaNet or Mamba-2 layers through the convolution and walk
    kernels over the step's tokens end to end (as CUDA runs prompts up to
    WALK_MAX_TOKENS, graphs included), chunked by a 16-token budget and beside decodes,
    in two slots the later prompts reuse (from zeros, not the slot's last state):
    transformers' tokens."""
    import engine.models.gated_delta as gated_delta

    monkeypatch.setattr(gated_delta, "walk_limit", lambda layers, device: 10**6)
    model_dir = tiny_family_dir(kind)
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    assert_greedy_as_transformers(llm, model_dir, 6)
