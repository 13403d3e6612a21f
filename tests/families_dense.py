"""Tiny configs of the attention families without experts: kind -> (transformers config
class, model class, fields over tiny_checkpoints.TINY's sizes). Each switches on what sets
its family apart (biases, norms, rotary variants; sliding windows of 8-16 tokens, so that
prompts plus generations cross them several times)."""

from __future__ import annotations

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
# Hunyuan's: NTK alpha as its published configs give it (factor 1, type dynamic).
HUNYUAN = dict(
    head_dim=16,
    rope_parameters={"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
)

DENSE_FAMILIES: dict[str, tuple[str, str, dict]] = {
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
    # Apertus: xIELU in an ungated MLP (its coefficients drawn), per-head q/k norms,
    # Llama 3's rope scaling.
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(head_dim=16)),
    # Hunyuan: q/k norms (drawn) after the rotation, NTK alpha on the rope base; the MoE
    # model's every layer 4 experts top-2 and a shared MLP.
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", HUNYUAN),
    # StableLM 2: LayerNorms (drawn biases), a quarter of each head rotated, q/k/v biases.
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(use_qkv_bias=True, partial_rotary_factor=0.25),
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
    # Granite SWA: a sliding layer (8) rotated at base 1e4, then a full NoPE layer; sinks.
    "granite_swa": (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        GRANITE_SCALARS | GRANITE_SWA,
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
}
