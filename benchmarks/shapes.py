"""Real models' shapes for the random-weight benchmark checkpoints
(benchmarks/checkpoints.py builds them): name -> a transformers config."""

from __future__ import annotations


def gpt2_124m():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def qwen2_0_5b():
    """Qwen2.5-0.5B's shape: 24 layers, 896 hidden, GQA 14/2, tied 151936-token head."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def qwen3_30b_a3b():
    """Qwen3-30B-A3B's shape: 48 layers, 2048 hidden, GQA 32/4 (head_dim 128), q/k norms,
    128 experts of 768, top-8 renormalized; ~30.5B parameters, ~3.3B active per token."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def gpt_oss_20b():
    """gpt-oss-20b's shape: 24 layers, 2880 hidden, GQA 64/8 (head_dim 64) with sinks,
    sliding (128) and full layers alternating, 32 experts of 2880, top-4; ~20.9B
    parameters, ~3.6B active per token. OpenAI ships the experts in MXFP4; here they are
    bf16, as Pagoda serves them."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
    )


def glm_4_5_air():
    """GLM-4.5-Air's shape: 46 layers (the first dense), 4096 hidden, GQA 96/8 (head_dim
    128, half rotated), q/k/v biases, 128 experts of 1408, top-8 by sigmoid scores, one
    shared expert; ~106.9B parameters (214 GB in bf16: two H200s), ~12B active per
    token."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        attention_bias=True,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def deepseek_v2_lite():
    """DeepSeek-V2-Lite's shape: 27 layers (the first dense), 2048 hidden, 16 MLA heads
    (latent 512, K 128 + 64 rotary, V 128), 64 experts of 1408, top-6 by softmax, two
    shared experts; YaRN x40; ~15.7B parameters (31 GB in bf16), ~2.4B active per token."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "rope_theta": 10000.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def qwen3_5_27b():
    """Qwen3.5-27B's language model: 64 layers, 5120 hidden, a gated attention layer (GQA
    24/4, heads of 256, a quarter rotated) after each three Gated DeltaNet layers (16 key
    heads and 48 value heads of 128, a 4-row convolution); 248320-token vocabulary."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def qwen3_next_80b_a3b():
    """Qwen3-Next-80B-A3B: 48 layers, 2048 hidden, a gated attention layer (GQA 16/2, heads
    of 256, a quarter rotated) after each three Gated DeltaNet layers (16 key heads and 32
    value heads of 128); 512 experts of 512, top-10, and a shared expert of 512 on every
    layer; ~80B parameters, ~3B active per token."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def granite_4_0_h_small():
    """Granite-4.0-H-Small's shape as we know its published config (no hub here to check
    it against): 40 layers, 4096 hidden, attention (GQA 32/8, heads of 128, no position
    encoding) at layers 5, 15, 25 and 35, Mamba-2 mixers elsewhere (128 heads of 64, a
    128-wide state, one group); 72 experts of 768, top-10, beside a shared MLP of 8192;
    ~35.5B parameters."""
    from transformers import GraniteMoeHybridConfig

    layers = 40
    return GraniteMoeHybridConfig(
        vocab_size=100352,
        hidden_size=4096,
        intermediate_size=768,
        shared_intermediate_size=8192,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=72,
        num_experts_per_tok=10,
        layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(layers)],
        mamba_n_heads=128,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        position_embedding_type="nope",
        embedding_multiplier=12.0,
        attention_multiplier=0.0078125,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )


def nemotron_h_8b():
    """Nemotron-H-8B's shape as we know its published config (no hub here to check it
    against): 52 blocks by the pattern below (24 Mamba-2 mixers of 128 heads of 64, a
    128-wide state in 8 groups; 4 attention blocks, GQA 32/8, no position encoding; 24
    relu^2 MLPs of 21504), 4096 hidden, a 131072-token vocabulary."""
    from transformers import NemotronHConfig

    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    return NemotronHConfig(
        vocab_size=131072,
        hidden_size=4096,
        intermediate_size=21504,
        layers_block_type=[kinds[c] for c in pattern],
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        max_position_embeddings=8192,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
    )


def nemotron_3_nano():
    """Nemotron 3 Nano 30B-A3B's shape as Megatron Bridge's provider gives it (no hub here
    to check its config against): 52 blocks by the pattern below (23 Mamba-2 mixers of 64
    heads of 64, a 128-wide state in 8 groups; 6 attention blocks, GQA 32/2, no position
    encoding; 23 MoE blocks of 128 relu^2 experts of 1856, top-6, scaled by 2.5, beside a
    shared one of 3712), 2688 hidden, a 131072-token vocabulary."""
    from transformers import NemotronHConfig

    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    kinds = {"M": "linear_attention", "*": "full_attention", "E": "moe"}
    return NemotronHConfig(
        vocab_size=131072,
        hidden_size=2688,
        layers_block_type=[kinds[c] for c in pattern],
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        mamba_num_heads=64,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        n_routed_experts=128,
        num_experts_per_tok=6,
        moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
    )


def llama3(hidden: int, intermediate: int, layers: int, heads: int):
    """A Llama 3 shape: 128256-token vocabulary, GQA with 8 kv heads (head_dim 128), rope
    theta 500k, untied head. 8B: ~8.03B parameters."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def llama3_8b():
    return llama3(4096, 14336, 32, 32)


def llama3_70b():
    return llama3(8192, 28672, 80, 64)


def llama4_scout():
    """Llama-4-Scout-17B-16E's language model: 48 layers, 5120 hidden, GQA 40/8 (head_dim
    128), every layer MoE (16 experts of 8192, top-1, a shared expert), every fourth
    layer NoPE, the others in chunks of 8,192 tokens; llama3 rope scaling x16; ~107.8B
    parameters (216 GB in bf16: FP8 or two GPUs), ~17B active per token."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(
        vocab_size=202048,
        hidden_size=5120,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=8192,
        max_position_embeddings=10485760,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def bert_base():
    """bge-base-en-v1.5's shape (BERT-base): 12 layers, 768 hidden, 12 heads, 512 positions."""
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, max_position_embeddings=512)


def bge_m3():
    """bge-m3's shape (XLM-RoBERTa-large): 24 layers, 1024 hidden, 16 heads, 8,192 tokens."""
    from transformers import XLMRobertaConfig

    return XLMRobertaConfig(
        vocab_size=250002,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=8194,
        type_vocab_size=1,
        pad_token_id=1,
    )


CONFIGS = {
    "gpt2": gpt2_124m,
    "qwen2-0.5b": qwen2_0_5b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "gpt-oss-20b": gpt_oss_20b,
    "glm-4.5-air": glm_4_5_air,
    "deepseek-v2-lite": deepseek_v2_lite,
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "llama4-scout": llama4_scout,
    "qwen3.5-27b": qwen3_5_27b,
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "granite-4.0-h-small": granite_4_0_h_small,
    "nemotron-h-8b": nemotron_h_8b,
    "nemotron-3-nano": nemotron_3_nano,
    "bert-base": bert_base,
    "bge-m3": bge_m3,
}
ENCODERS = {"bert-base", "bge-m3"}  # saved as AutoModel (no LM head): they embed
# Too large to write to disk and read back: saved as config + tokenizer + a random-weights
# marker, and filled with random values on the device at load (engine.models.loader).
ON_DEVICE = {"qwen3-30b-a3b", "gpt-oss-20b", "glm-4.5-air", "deepseek-v2-lite", "llama3-8b"}
ON_DEVICE |= {"llama3-70b", "llama4-scout", "qwen3.5-27b", "qwen3-next-80b-a3b"}
ON_DEVICE |= {"granite-4.0-h-small", "nemotron-h-8b", "nemotron-3-nano"}
