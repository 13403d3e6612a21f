"""Tiny configs of the families with recurrent layers (Gated DeltaNet, Mamba-2, short
convolutions), alone or beside attention: kind -> (transformers config class, model class,
fields over tiny_checkpoints.TINY's sizes)."""

from __future__ import annotations

from tests.families_dense import GRANITE_SCALARS

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

HYBRID_FAMILIES: dict[str, tuple[str, str, dict]] = {
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
