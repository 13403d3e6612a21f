"""Tiny configs of the attention families with experts (MoE, and latent attention):
kind -> (transformers config class, model class, fields over tiny_checkpoints.TINY's
sizes); 4-8 experts of 32, top-2, with each family's routing switched on."""

from __future__ import annotations

from tests.families_dense import GEMMA4, GRANITE_SCALARS, GRANITE_SWA, HUNYUAN

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

MOE_FAMILIES: dict[str, tuple[str, str, dict]] = {
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
    # Gemma 4 26B-A4B's layers: 4 GeGLU experts, top 2, beside each layer's dense MLP.
    "gemma4_moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        GEMMA4
        | dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
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
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        HUNYUAN | dict(num_experts=4, moe_topk=2, intermediate_size=32),
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
    # Sinks, biases on attention and experts (randomized in build_tiny: transformers starts
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
}
