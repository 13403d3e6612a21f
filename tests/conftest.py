"""Shared fixtures: tiny random checkpoints saved with transformers, and a tokenizer.

Every checkpoint is a real Hugging Face directory (config.json, safetensors,
tokenizer files), so Pagoda loads it the way it loads a downloaded model.
Weights use a larger init than the default so that greedy decoding has clear
winners and never hinges on a rounding-level tie.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.models.demo import train_tokenizer

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "def forward(self, x):",
    "Once upon a time, in a land far away,",
    "1 2 3 4 5",
    "Continuous batching keeps the GPU busy: new requests join while others are still decoding.",
    "中文：你好，世界！",
    "Emoji: 😀 🚀",
    "A paged KV cache stores keys and values in fixed-size blocks",
]


@pytest.fixture(autouse=True)
def _unfreeze_heap():
    """Servers and LLMs freeze the heap once started (engine/heap.py). In this one
    long-lived process that would keep every finished test's engine alive."""
    yield
    gc.unfreeze()


def is_frozen(obj) -> bool:
    """Tracked by the collector but in none of its generations: frozen."""
    return gc.is_tracked(obj) and all(o is not obj for o in gc.get_objects())


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()


def _save(path: Path, model, tokenizer) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _build(kind: str, path: Path, tokenizer) -> str:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, initializer_range=0.2)
    if kind == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
        model = GPT2LMHeadModel(config)
    elif kind == "llama":  # GQA and Llama 3 rope scaling
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
            **common,
        )
        model = LlamaForCausalLM(config)
    elif kind == "llama_kv3":  # 3 kv heads: over 2 ranks they do not split evenly
        config = LlamaConfig(
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            **common,
        )
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":  # qkv bias, tied embeddings
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            **common,
        )
        model = Qwen2ForCausalLM(config)
    elif kind in FAMILY_CONFIGS:
        import transformers

        config_class, model_class, fields = FAMILY_CONFIGS[kind]
        config = getattr(transformers, config_class)(**(TINY | fields), **common)
        model = getattr(transformers, model_class)(config)
        drawn = ("gpt_oss", "gpt_neox", "gpt_neox_sequential", "phi", "glm4_moe", "deepseek_v3")
        drawn += ("starcoder2", "minimax_m2", "ernie4_5_moe", "glm4_moe_lite")
        drawn += ("solar_open", "exaone_moe", "dots1", "arcee", "nemotron", "jais2")
        drawn += ("helium", "apertus", "hunyuan_v1_dense", "hunyuan_v1_moe", "stablelm")
        drawn += ("afmoe", "granite_swa", "granitemoe_swa", "phimoe", "gemma4", "gemma4_moe")
        drawn += ("mimo_v2_flash", "qwen3_5", "qwen3_5_moe", "qwen3_next")
        drawn += ("granitemoehybrid", "granitemoehybrid_dense", "nemotron_h")
        drawn += ("nemotron_h_moe", "nemotron_h_latent", "bamba", "lfm2", "lfm2_moe", "gemma")
        drawn += ("glm",)
        drawn += ("falcon_h1", "falcon_h1_ungated", "mamba2", "gptj", "gpt_bigcode")
        drawn += ("gpt_bigcode_mha", "opt", "falcon", "falcon_7b", "falcon2")
        drawn += ("falcon_sequential",)
        if kind in drawn:
            # transformers starts biases (and sinks) at zero: drawn, they are tested.
            with torch.no_grad():
                for name, param in [*model.named_parameters(), *model.named_buffers()]:
                    if name.endswith(("bias", "sinks")) and param.is_floating_point():
                        param.normal_(0.0, 0.5)  # (GPT-BigCode's causal mask is a bool "bias")
                    elif kind == "minimax_m2" and name.endswith(("q_norm.weight", "k_norm.weight")):
                        param.normal_(1.0, 0.5)  # each dim its own weight, to follow a reorder
                    elif kind == "apertus" and name.endswith(("alpha_p", "alpha_n")):
                        param.normal_(0.0, 1.0)  # each layer's xIELU its own
                    elif kind.startswith("hunyuan") and name.endswith("_layernorm.weight"):
                        param.normal_(1.0, 0.5)  # after the rotation: each dim its own weight
                    elif kind == "afmoe" and name.endswith("expert_bias"):
                        param.normal_(0.0, 0.5)  # the choice's bias, zeros from transformers
                    elif kind.startswith("lfm2") and name.endswith(("norm.weight", "expert_bias")):
                        param.normal_(1.0, 0.5)  # ones from transformers: drawn, each counts
                    elif kind in ("nemotron", "gemma") and name.endswith("norm.weight"):
                        param.normal_(0.0, 0.5)  # the scale is 1 + weight (LayerNorm1P, Gemma)
                    elif kind.startswith("qwen3_") and name.endswith(QWEN3_5_DRAWN):
                        param.normal_(0.0, 0.5)  # (1 + weight) norms and the gated norm's
                    elif kind.startswith(MAMBA2_FAMILIES) and name.endswith(MAMBA2_DRAWN):
                        param.normal_(0.0, 0.5)  # each head's own decay, step and skip
                    elif kind.startswith("gemma4") and name.endswith(GEMMA4_DRAWN):
                        param.normal_(1.0, 0.5)  # weights as they are (not 1 + weight)
    else:
        raise ValueError(kind)
    return _save(path, model.eval(), tokenizer)


# The newer families, each with its distinguishing features switched on and sliding
# windows of 8-16 tokens, so that prompts plus generations cross them several times.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# Granite's four scalars, none of them 1 (the attention scale not 16**-0.5).
GRANITE_SCALARS = dict(
    embedding_multiplier=4.0,
    attention_multiplier=0.1,
    residual_multiplier=0.5,
    logits_scaling=2.0,
)
# Granite SWA's attention: a sliding layer rotated, a full one without position encoding.
GRANITE_SWA = dict(
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    layer_rope_theta=[10000.0, 0],
)
# Gemma 4: a local layer (window 8, heads of 16), then a global one with heads of 32 whose V
# is its K's projection, a quarter of its pairs rotated; soft-cap.
GEMMA4 = dict(
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=False,
)
# Zeros and ones from transformers: drawn, so that each counts.
QWEN3_5_DRAWN = ("norm.weight",)
# Mamba-2's per-head parameters (transformers: A_log = log(1..heads), D and dt_bias ones)
# and the norms (ones), drawn so that each head's and each dim's entry counts.
MAMBA2_DRAWN = ("A_log", ".D", "dt_bias", "norm.weight")
MAMBA2_FAMILIES = ("granitemoehybrid", "nemotron_h", "bamba", "falcon_h1", "mamba2")
FALCON_H1 = dict(
    mamba_d_ssm=128,
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_rms_norm=True,
    mamba_proj_bias=True,
    mamba_norm_before_gate=True,
    projectors_bias=True,
    embedding_multiplier=2.0,
    lm_head_multiplier=0.5,
    mlp_multipliers=[0.7, 1.3],
    key_multiplier=0.8,
    attention_in_multiplier=0.9,
    attention_out_multiplier=1.2,
    ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0],
    ssm_in_multiplier=1.1,
    ssm_out_multiplier=0.6,
    tie_word_embeddings=False,
)
# LFM2's layers: short convolutions (3 taps, biased) around one attention layer.
LFM2 = dict(
    num_hidden_layers=3,
    layer_types=["conv", "full_attention", "conv"],
    conv_bias=True,
    tie_word_embeddings=False,
)
NEMOTRON_3 = dict(
    num_hidden_layers=4,
    layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
    head_dim=16,
    mamba_num_heads=4,
    mamba_head_dim=32,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    use_bias=True,
    mlp_bias=True,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    tie_word_embeddings=False,
)
# Granite 4.0-H: Mamba-2 mixers around an attention layer without position encoding;
# 4 heads of 32 in one group (read whole by each tensor-parallel rank), a 16-wide state,
# a conv bias; experts beside a shared MLP; Granite's four scalars.
GRANITE_HYBRID = dict(
    num_hidden_layers=3,
    layer_types=["mamba", "attention", "mamba"],
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=48,
    tie_word_embeddings=False,
    **GRANITE_SCALARS,
)
# Ones from transformers: drawn, so that each counts (the router's scales, the MoE's).
GEMMA4_DRAWN = ("norm.weight", "layer_scalar", "scale")
# GLM-4.5's and dots.llm1's experts: a dense layer, then 8 experts in 2 groups, the best
# group's top-2, times 2.5, and a shared expert.
GLM_EXPERTS = dict(
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    tie_word_embeddings=False,
)
# Hunyuan's: NTK alpha as its published configs give it (factor 1, type dynamic).
HUNYUAN = dict(
    head_dim=16,
    rope_parameters={"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
)
# Both Cohere 2 MoE configs' sizes: 4 experts of 32 and one shared, dense layers of 96.
COHERE2_MOE = dict(
    head_dim=16,
    logit_scale=0.5,
    sliding_window=8,
    num_experts=4,
    num_shared_experts=1,
    intermediate_size=32,
    prefix_dense_intermediate_size=96,
)
# DeepSeek-V3's and GLM-4.7-Flash's latent attention and experts: q through a rank-24
# q_lora, a 32-wide latent, 8 of each head's 24 q/k dims rotated; 8 experts top-2, one shared.
TINY_MLA = dict(
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    tie_word_embeddings=False,
)
# Qwen 3.5: linear attention, attention, linear attention.
QWEN3_5 = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    # q/k norm; use_sliding_window from layer max_window_layers on (layer 1 only); YaRN
    # rope scaling (x4 over 64 original positions), as Qwen3 serves long contexts.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=16,
            use_sliding_window=True,
            sliding_window=10,
            max_window_layers=1,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e6,
            },
        ),
    ),
    # Layer 0 sparse (norm_topk_prob), layer 1 dense via mlp_only_layers.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # Qwen2-MoE: qkv bias, 6 experts (not a power of two) top-2 unnormalized, a gated
    # shared expert; layer 1 dense.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
    # Llama 4: interleaved rotary then weightless q/k norms and chunks of 8 tokens on
    # layer 0; layer 1 without position encoding, its queries scaled by position
    # (floor_scale 8); layer 0 MoE (top-1, the score on the input, a shared expert),
    # layer 1 dense.
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=4,
            intermediate_size=24,  # the experts': gate_up [4, 64, 48] is not square
            intermediate_size_mlp=96,
            moe_layers=[0],
            no_rope_layer_interval=2,
            attention_chunk_size=8,
            floor_scale=8,
            attn_scale=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(head_dim=16, sliding_window=12, tie_word_embeddings=False),
    ),
    # Ministral 8B: sliding and full layers by layer_types.
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    ),
    # A local layer (window 8, base 10k) then a global one (base 1M, linear x2), soft-cap.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            final_logit_softcapping=5.0,
        ),
    ),
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        GEMMA4,
    ),
    # Gemma 4 26B-A4B's layers: 4 GeGLU experts, top 2, beside each layer's dense MLP.
    "gemma4_moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        GEMMA4
        | dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    ),
    # Gemma 3's layout without q/k norms, one rope base, and the attention scores
    # soft-capped; the cap is small enough to bend this tiny model's scores (~0.1).
    # Gemma (1): one kv head (the 2B's multi-query attention), heads of 16, GeGLU.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, num_key_value_heads=1)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=0.05,
            final_logit_softcapping=5.0,
        ),
    ),
    # Llama whose every second layer has no position encoding (NoPE), as SmolLM3's every
    # fourth.
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(no_rope_layer_interval=2, pad_token_id=0),
    ),
    # GPT-NeoX (Pythia): attention and MLP in parallel off one residual stream, a quarter
    # of each head rotated, q/k/v interleaved by head in one tensor, erf GELU.
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(use_parallel_residual=True, hidden_act="gelu"),
    ),
    # MiniMax-M2: whole-width q/k norms before rotating 8 of each head's 16 dims; every
    # layer 4 experts top-2 by sigmoid scores plus a correction bias (drawn), renormalized.
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2),
    ),
    # ERNIE 4.5 MoE: layer 0 dense, then 6 experts top-2 by softmax plus a correction
    # bias (drawn), a shared expert; the interleaved rotation.
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            tie_word_embeddings=False,
        ),
    ),
    # MiMo-V2-Flash: a full layer with a dense MLP, then a sliding one (window 8, twice the
    # kv heads, sinks) over 8 experts in 2 groups, top-2; q/k heads of 24 (8 dims rotated),
    # V heads of 16 scaled by 0.707.
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(
            head_dim=24,
            v_head_dim=16,
            num_key_value_heads=1,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention"],
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        ),
    ),
    # OLMoE: Llama's layers with OLMo 2's whole-width q/k norms, 6 experts top-3, not
    # renormalized.
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(num_experts=6, num_experts_per_tok=3, intermediate_size=32),
    ),
    # StarCoder2: GPT-NeoX's sequential layout, separate q/k/v with GQA and biases, a
    # sliding window of 12 on every layer, tanh GELU, a tied head.
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(sliding_window=12, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    ),
    # GPT-NeoX's sequential residual, half of each head rotated (base 500), tanh GELU.
    "gpt_neox_sequential": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            use_parallel_residual=False,
            hidden_act="gelu_new",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Phi (phi-2): one LayerNorm both sublayers read, half of each head rotated, GQA here
    # (phi-2 itself is multi-head), a biased LM head.
    "phi": ("PhiConfig", "PhiForCausalLM", dict(tie_word_embeddings=False)),
    # GPT-J: one LayerNorm both sublayers read, half of each head rotated by interleaved
    # pairs, an LM head with a bias (drawn), tanh GELU.
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(rotary_dim=8, tie_word_embeddings=False)),
    # GPT-BigCode (StarCoder): GPT-2's blocks, nn.Linear, one k/v head (multi_query) or
    # every head's k/v with c_attn's rows head by head.
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(multi_query=True)),
    "gpt_bigcode_mha": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(multi_query=False)),
    # Falcon-40B/180B's layout (kv groups in query_key_value, a norm each sublayer),
    # Falcon-7B's (multi-query, one norm) and Falcon2-11B's (kv groups, one norm).
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(new_decoder_architecture=True, num_kv_heads=2, bias=True, ffn_hidden_size=96),
    ),
    "falcon_7b": ("FalconConfig", "FalconForCausalLM", dict(multi_query=True, bias=True)),
    "falcon_sequential": (  # every head's k/v, head by head; attention, then the MLP
        "FalconConfig",
        "FalconForCausalLM",
        dict(multi_query=False, parallel_attn=False, bias=True),
    ),
    "falcon2": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    ),
    # OLMo: Llama's layers, LayerNorms without weights, q/k/v clamped (clip_qkv biting).
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.05)),
    # OPT: pre-norm layers without rotation, learned positions offset by 2, ReLU, tied head.
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=96, word_embed_proj_dim=64)),
    # Cohere (Command R, Aya): one bias-free LayerNorm both sublayers read, rotation of
    # interleaved pairs, GQA, tied head times logit_scale.
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    # Arcee AFM: Llama with an ungated relu^2 MLP, its biases on; YaRN.
    "arcee": (
        "ArceeConfig",
        "ArceeForCausalLM",
        dict(
            mlp_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # Nemotron (Minitron): Arcee's MLP, LayerNorm1P (drawn weights), half of each head
    # rotated, q/k/v/o biases.
    "nemotron": (
        "NemotronConfig",
        "NemotronForCausalLM",
        dict(attention_bias=True, mlp_bias=True, partial_rotary_factor=0.5),
    ),
    # Jais 2: Arcee's MLP with LayerNorms (drawn biases), q/k/v/o and MLP biases.
    "jais2": ("Jais2Config", "Jais2ForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    # Cohere 2 MoE (Command A Plus): a dense layer of full attention, rotated (as the
    # prefix's pattern of 1 asks), then a sliding-window MoE layer: 4 experts top-2 and a
    # shared one, their sum; bias-free LayerNorms.
    "cohere2_moe": (
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        COHERE2_MOE | dict(shared_expert_combination_strategy="sum", first_k_dense_replace=1),
    ),
    # The other settings: sigmoid scores renormalized, the shared expert averaged in,
    # RMSNorms; two dense layers (sliding, then full attention not rotated), then MoE.
    "cohere2_moe_sigmoid": (
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        COHERE2_MOE
        | dict(
            num_hidden_layers=3,
            first_k_dense_replace=2,
            prefix_dense_sliding_window_pattern=2,
            expert_selection_fn="sigmoid",
            shared_expert_combination_strategy="average",
            rms_norm_eps=1e-6,
        ),
    ),
    # Apertus: xIELU in an ungated MLP (its coefficients drawn), per-head q/k norms,
    # Llama 3's rope scaling.
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(head_dim=16)),
    # Hunyuan: q/k norms (drawn) after the rotation, NTK alpha on the rope base; the MoE
    # model's every layer 4 experts top-2 and a shared MLP.
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", HUNYUAN),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        HUNYUAN | dict(num_experts=4, moe_topk=2, intermediate_size=32),
    ),
    # StableLM 2: LayerNorms (drawn biases), a quarter of each head rotated, q/k/v biases.
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(use_qkv_bias=True, partial_rotary_factor=0.25),
    ),
    # Arcee Trinity: a dense layer of sliding-window attention (rotated), then a global
    # NoPE MoE layer: 4 experts top-2 by sigmoid scores plus a drawn bias, times 1.5, a
    # shared expert; attention outputs gated; norms before and after each sublayer; muP.
    "afmoe": (
        "AfmoeConfig",
        "AfmoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            num_dense_layers=1,
            route_scale=1.5,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mup_enabled=True,
        ),
    ),
    # Phi-3.5-MoE: sparsemixer over 4 experts, LayerNorms, q/k/v/o and LM head biases
    # (drawn), LongRoPE with explicit scales (prompts stay within the original length).
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(
            num_local_experts=4,
            attention_bias=True,
            lm_head_bias=True,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                "short_mscale": 1.2,
                "long_mscale": 1.4,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    # Helium: Llama with the rotation on interleaved pairs; q/k/v biases (drawn), none on o.
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=16, attention_bias=True)),
    # Cohere 2 (Command R7B, Command A): Cohere's layers, a rotated sliding-window layer
    # (8 tokens) and a full-attention one without position encoding.
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            logit_scale=0.5, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
        ),
    ),
    # ERNIE 4.5: the rotation on interleaved pairs of the whole head; tied head.
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16, pad_token_id=0)),
    # Seed-OSS: q/k/v biases, o_proj without one (attention_out_bias).
    "seed_oss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        dict(head_dim=16, attention_bias=True, attention_out_bias=False, pad_token_id=0),
    ),
    # EXAONE 4: post-norm layers, per-head q/k norms; a sliding layer (window 8, rotary)
    # then a global one without position encoding.
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    ),
    # EXAONE MoE: EXAONE 4's attention (sliding window 8 with rotary, then a global NoPE
    # layer) in pre-norm layers; a dense layer, then 8 experts top-2 in 2 groups by
    # sigmoid scores plus a drawn correction bias, a shared expert.
    "exaone_moe": (
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        dict(
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            num_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=32,
            num_shared_experts=1,
            tie_word_embeddings=False,
        ),
    ),
    # GLM-4 (0414): sandwich norms, q/k/v biases (o_proj none), interleaved pairs of the
    # first half of each head rotated, gate and up one tensor.
    # GLM-4-9B: GLM-4's attention (q/k/v biases, half of each head rotated by pairs) in
    # Llama's pre-norm layers.
    "glm": ("GlmConfig", "GlmForCausalLM", dict(head_dim=16, pad_token_id=0)),
    "glm4": (
        "Glm4Config",
        "Glm4ForCausalLM",
        dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5, pad_token_id=0),
    ),
    # GLM-4.5: a dense layer then an MoE one: 8 experts in 2 groups, the best group's
    # top-2 by sigmoid scores plus a drawn correction bias, times 2.5, a shared expert;
    # q/k/v biases (o_proj none), q/k norms, half of each head rotated.
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        GLM_EXPERTS | dict(attention_bias=True, use_qk_norm=True),
    ),
    # dots.llm1: Qwen3's attention (q/k norms, no biases) with GLM-4.5's experts, a
    # dense layer first; layer 1 in a sliding window of 8 (max_window_layers).
    "dots1": (
        "Dots1Config",
        "Dots1ForCausalLM",
        GLM_EXPERTS | dict(head_dim=16, norm_topk_prob=True, sliding_window=8, max_window_layers=1),
    ),
    # DeepSeek-V2-Lite: MLA without q_lora (q_proj), each head's K 16 + 8 rotary dims
    # (interleaved pairs), V 12 (the cache pads it to 24); YaRN with DeepSeek's mscales
    # (the softmax scale too); then an MoE layer routed by softmax (greedy), times 1.5,
    # with a shared expert. (V2's group-limited routing: test_deepseek.py.)
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,  # MLA's heads each have their own K and V
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,  # q's rows and kv_a's, multiples of 16: FP8 tests reach them
            v_head_dim=12,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            topk_method="greedy",
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "rope_theta": 10000.0,
            },
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3 / R1: MLA with q_lora (q_a_proj, its norm, q_b_proj), rotary pairs
    # not interleaved (rope_interleave off), V as wide as the nope part; GLM-4.5's
    # routing (a drawn correction bias).
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        TINY_MLA
        | dict(
            rope_interleave=False,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
        ),
    ),
    # Mistral 4: DeepSeek-V3's MLA with YaRN, and from position 16 on the queries scaled
    # by 1 + 0.5 log(1 + floor(pos / 16)); routing by softmax scores in 2 groups.
    "mistral4": (
        "Mistral4Config",
        "Mistral4ForCausalLM",
        TINY_MLA
        | dict(
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale_all_dim": 1.0,
                "mscale": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
        ),
    ),
    # GLM-4.7-Flash: DeepSeek-V3's MLA (its rotary pairs interleaved) and routing in one
    # group, dense and sparse layers by mlp_layer_types.
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        TINY_MLA | dict(routed_scaling_factor=1.8, mlp_layer_types=["dense", "sparse"]),
    ),
    # Solar Open: GLM-4.5's layers without biases, every one MoE (8 experts top-2 in one
    # group, a correction bias drawn, a shared expert).
    "solar_open": (
        "SolarOpenConfig",
        "SolarOpenForCausalLM",
        dict(
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            tie_word_embeddings=False,
        ),
    ),
    # OLMo 2: norms after each sublayer, q/k normed over all their heads at once.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=False)),
    # OLMo 3: OLMo 2 with a sliding layer (window 8, base 10k) and a full one (YaRN).
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 500000.0,
                },
            },
            tie_word_embeddings=False,
        ),
    ),
    # Llama with Granite's four scalars, none of them 1 (the attention scale not 16**-0.5).
    "granite": ("GraniteConfig", "GraniteForCausalLM", GRANITE_SCALARS),
    # Granite MoE: the four scalars over 4 stacked experts, top 2.
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        GRANITE_SCALARS | dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    # Granite MoE Shared: the same with a shared MLP of 48 beside the experts.
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        GRANITE_SCALARS
        | dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    ),
    # Granite SWA: a sliding layer (8) rotated at base 1e4, then a full NoPE layer; sinks.
    "granite_swa": (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        GRANITE_SCALARS | GRANITE_SWA,
    ),
    # Granite MoE SWA: that attention over the shared-MLP experts; the layers' two bases.
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        "GraniteMoeSWAForCausalLM",
        GRANITE_SCALARS
        | GRANITE_SWA
        | dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
            layer_rope_theta=[10000.0, 500.0],
            layer_types=["sliding_attention", "sliding_attention"],
        ),
    ),
    # Sinks, biases on attention and experts (randomized in _build: transformers starts
    # them at zero), a sliding layer then a full one, YaRN without truncation, experts
    # whose clamp (1.0) the gate and up values cross.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        ),
    ),
    # longrope (attention factor from 256 / 96; the long factors: test_models_config.py)
    # over 12 of 16 dims a head, as Phi-4-mini rotates 3/4 of each head. transformers
    # recomputes a sequence's whole cache with the long factors once it passes
    # original_max_position_embeddings, which Pagoda does not: sequences here stay below.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            original_max_position_embeddings=96,
            partial_rotary_factor=0.75,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.5 * i for i in range(6)],
            },
            sliding_window=14,
            pad_token_id=0,
        ),
    ),
    # Gated DeltaNet layers around a gated attention layer (heads of 16, a quarter
    # rotated); value heads twice the key heads, a 4-row convolution.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5),
    # The same layers over experts: 8, top-2, and a gated shared expert; attention biases
    # (q_proj's interleaved with its gate's).
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        QWEN3_5
        | dict(
            attention_bias=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE_HYBRID),
    # The dense Granite 4.0 models (no experts: the shared MLP alone), here with rotary
    # attention, projection biases and two groups (split across ranks).
    "granitemoehybrid_dense": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        GRANITE_HYBRID
        | dict(
            num_local_experts=0,
            position_embedding_type="rope",
            mamba_proj_bias=True,
            mamba_n_groups=2,
        ),
    ),
    # Nemotron-H: one normed mixer a block (Mamba-2, attention without position encoding,
    # an ungated relu^2 MLP with biases); 4 heads of 32 in two groups; projection biases.
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            num_hidden_layers=5,
            layers_block_type=[
                "linear_attention",
                "mlp",
                "full_attention",
                "mlp",
                "linear_attention",
            ],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            use_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    # Bamba: Mamba-2 mixers (4 heads of 32 in two groups, a conv bias, projection biases)
    # around an attention layer with half of each head rotated.
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_proj_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    # Falcon-H1: a mixer and attention side by side in every layer; every µP multiplier
    # off 1; the mixer's norm before its gate, a bias on its out_proj.
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", FALCON_H1),
    # The same with the mixer's plain y silu(z) (no norm: Falcon-H1's published configs).
    "falcon_h1_ungated": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        FALCON_H1 | dict(mamba_rms_norm=False, projectors_bias=False),
    ),
    # LFM2: short convolutions (3 taps, biased) around an attention layer with per-head
    # q/k norms; its MLP narrowed as transformers sizes it.
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        LFM2 | dict(block_multiple_of=16, block_ffn_dim_multiplier=1.5),
    ),
    # LFM2-MoE: the same layers, a dense MLP first, then 8 experts (top-2) chosen by
    # sigmoids plus a bias (drawn), renormalized and scaled.
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        LFM2
        | dict(
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            routed_scaling_factor=1.5,
        ),
    ),
    # Mamba-2 alone (Mamba-Codestral's layout): 4 heads of 32 in two groups, a conv bias,
    # projection biases; no attention layer, so no KV cache.
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_heads=4,
            head_dim=32,
            state_size=16,
            n_groups=2,
            conv_kernel=4,
            use_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    # Nemotron 3: relu^2 experts without a gate (8, top-2) beside a shared one, routed in
    # two groups of which one is kept, by sigmoid scores plus a correction bias (drawn),
    # renormalized and scaled; projection biases.
    "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_3),
    # The same with the experts at a latent width, between two projections.
    "nemotron_h_latent": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        NEMOTRON_3 | dict(moe_latent_size=32),
    ),
    # Qwen3-Next: the same layers, the DeltaNet's projections fused by key head
    # (in_proj_qkvz, in_proj_ba); experts without renormalization but on layer 1, a
    # dense MLP (mlp_only_layers).
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        QWEN3_5
        | dict(
            attention_bias=True,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
}


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, tokenizer) -> str:
    return _build("gpt2", tmp_path_factory.mktemp("tiny-gpt2"), tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer) -> str:
    return _build("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_kv3_dir(tmp_path_factory, tokenizer) -> str:
    return _build("llama_kv3", tmp_path_factory.mktemp("tiny-llama-kv3"), tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer) -> str:
    return _build("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), tokenizer)


@pytest.fixture(scope="session", params=["gpt2", "llama", "qwen2"])
def tiny_model_dir(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory, tokenizer):
    """`tiny_family_dir(kind)` -> a saved tiny checkpoint of a FAMILY_CONFIGS kind, built once."""
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = _build(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), tokenizer)
        return built[kind]

    return get


# Tiny encoders (engine/models/bert.py): kind -> (transformers class, config extras,
# sentence-transformers pooling mode or None). bert_mean: an embedder whose
# sentence-transformers config says MEAN; the rest take their default pooling (CLS).
ENCODERS = {
    "bert_mean": ("BertModel", {}, "pooling_mode_mean_tokens"),
    "bert_cls": ("BertModel", {}, None),
    "xlm_roberta": ("XLMRobertaModel", {}, None),
    "bert_classifier": ("BertForSequenceClassification", {"num_labels": 3}, None),
    "bert_cross_encoder": ("BertForSequenceClassification", {"num_labels": 1}, None),
    "xlm_roberta_reranker": (
        "XLMRobertaForSequenceClassification",
        {"num_labels": 1, "type_vocab_size": 1},
        None,
    ),
    "distilbert": ("DistilBertModel", {}, "pooling_mode_mean_tokens"),
    "distilbert_classifier": ("DistilBertForSequenceClassification", {"num_labels": 2}, None),
    # Three layers, the middle one local (a query sees 4 keys either side), biases on.
    "modernbert": ("ModernBertModel", {}, None),
    "modernbert_classifier": (
        "ModernBertForSequenceClassification",
        {"num_labels": 2, "classifier_pooling": "mean", "classifier_bias": True},
        None,
    ),
}


def encoder_tokenizer():
    """The BPE tokenizer with BERT's special tokens and template: [CLS] a [SEP], and for
    pairs [CLS] a [SEP] b [SEP] with token type 1 on b's part."""
    from tokenizers import processors

    tok = train_tokenizer()
    tok.add_special_tokens({"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]"})
    cls, sep = tok.cls_token_id, tok.sep_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def build_encoder(kind: str, path: Path) -> str:
    import json

    import transformers

    cls_name, extras, st_mode = ENCODERS[kind]
    tokenizer = encoder_tokenizer()
    pad = tokenizer.pad_token_id
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, pad_token_id=pad
    )
    common |= dict(initializer_range=0.2, **extras)
    if cls_name.startswith("ModernBert"):
        config = transformers.ModernBertConfig(
            num_hidden_layers=3,
            intermediate_size=96,
            max_position_embeddings=128,
            local_attention=8,
            global_attn_every_n_layers=2,
            norm_bias=True,
            attention_bias=True,
            mlp_bias=True,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            **common,
        )
    elif cls_name.startswith("DistilBert"):  # its own names for the sizes
        config = transformers.DistilBertConfig(
            vocab_size=len(tokenizer),
            dim=64,
            n_heads=4,
            n_layers=2,
            hidden_dim=96,
            max_position_embeddings=128,
            pad_token_id=pad,
            initializer_range=0.2,
            **extras,
        )
    else:
        roberta = "XLMRoberta" in cls_name
        config = (transformers.XLMRobertaConfig if roberta else transformers.BertConfig)(
            num_hidden_layers=2,
            intermediate_size=128,
            # RoBERTa numbers positions from pad + 1.
            max_position_embeddings=128 + (pad + 1 if roberta else 0),
            **({"type_vocab_size": 2} | common),
        )
    torch.manual_seed(0)
    _save(path, getattr(transformers, cls_name)(config), tokenizer)
    if st_mode is not None:  # a sentence-transformers directory's Pooling module
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({st_mode: True}))
    return str(path)


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory):
    """`tiny_encoder_dir(kind)` -> a saved tiny encoder of an ENCODERS kind, built once."""
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = build_encoder(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return get


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy continuation in fp32 on CPU, EOS ignored (kwargs: to generate)."""
    model = hf_model(model_dir)
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_model(model_dir: str):
    """transformers' model of `model_dir` in fp32 on CPU, loaded once."""
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(model_dir)
    if model is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        except ValueError:  # a class AutoModelForCausalLM does not map (Mistral 4's)
            import transformers

            config = transformers.AutoConfig.from_pretrained(model_dir)
            model_class = getattr(transformers, config.architectures[0])
            model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # ignore EOS without masking it
        _hf_models[model_dir] = model
    return model


_hf_models: dict = {}


# PEFT's module names for every projection a Llama-shaped layer has.
LORA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora(base_dir: str, path: Path, seed: int, **lora_config) -> str:
    """A PEFT LoRA adapter of base_dir saved with peft itself, A and B drawn at random
    (PEFT starts B at zero: an adapter that adds nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora_config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_lora_adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, str]:
    """Two adapters of the tiny Llama: every projection at rank 8, and q/v only at rank 4
    with rsLoRA's scale (so the stacks pad ranks and leave sections empty)."""
    root = tmp_path_factory.mktemp("tiny-lora")
    return {
        "all": build_lora(
            tiny_llama_dir, root / "all", 1, r=8, lora_alpha=16, target_modules=LORA_ALL
        ),
        "qv": build_lora(
            tiny_llama_dir,
            root / "qv",
            2,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
        ),
    }


def peft_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: list[int], n: int) -> list[int]:
    """transformers + peft's greedy continuation (fp32, CPU, EOS ignored); None: the base."""
    if adapter_dir is None:
        return hf_greedy(base_dir, prompt_ids, n)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(adapter_dir)
    if model is None:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter_dir).eval()
        model.generation_config.eos_token_id = None
        _hf_models[adapter_dir] = model
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


class OpLog(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
