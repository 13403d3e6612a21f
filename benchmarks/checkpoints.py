"""Random-weight checkpoints at real sizes, for benchmarks (speed does not depend on values).

No model hub is reachable, so the tokenizer is synthetic too: a byte-level BPE
whose merges are drawn deterministically until it has the model's vocabulary
size. It encodes and decodes like a real one; its tokens just mean nothing.
Merges join printable ASCII only, so that, as in GPT-2's vocabulary, almost
every token is whole text: random ids then decode to valid UTF-8 as a real
model's output does, and detokenization costs what it costs in real use.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

EOS = "<|endoftext|>"


def synthetic_tokenizer(vocab_size: int, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    # ByteLevel shows printable ASCII as itself and the space as "Ġ".
    text = [c for c in alphabet if c.isascii() and c.isprintable()] + ["Ġ"]
    tokens = list(text)
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < vocab_size - 1:
        a, b = rng.choice(tokens), rng.choice(text)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            tokens.append(a + b)
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


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
    "bert-base": bert_base,
    "bge-m3": bge_m3,
}
ENCODERS = {"bert-base", "bge-m3"}  # saved as AutoModel (no LM head): they embed
# Too large to write to disk and read back: saved as config + tokenizer + a random-weights
# marker, and filled with random values on the device at load (engine.models.loader).
ON_DEVICE = {"qwen3-30b-a3b", "gpt-oss-20b", "glm-4.5-air", "deepseek-v2-lite", "llama3-8b"}
ON_DEVICE |= {"llama3-70b", "llama4-scout"}


def build_checkpoint(name: str, path: Path, dtype: torch.dtype = torch.float16) -> str:
    """Save a random checkpoint + tokenizer under path (skipped if already there)."""
    from transformers import AutoModel, AutoModelForCausalLM

    from engine.models.loader import RANDOM_WEIGHTS_MARKER

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    config = CONFIGS[name]()
    tokenizer = synthetic_tokenizer(min(config.vocab_size, 50257))
    config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
    if name in ON_DEVICE:
        config.dtype = dtype
        config.save_pretrained(path)
        (path / RANDOM_WEIGHTS_MARKER).write_text("weights drawn at load; see loader.py\n")
    else:
        torch.manual_seed(0)
        auto = AutoModel if name in ENCODERS else AutoModelForCausalLM
        model = auto.from_config(config, dtype=dtype)
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


SHARD_BYTES = 4 << 30


def disk_checkpoint(name: str, dtype: str = "bfloat16", path: str | None = None) -> str:
    """A checkpoint of `name` with every weight on disk (for what reads them: time to
    ready, transformers), under path or /tmp/pagoda-disk-<name> (reused if there).
    The ON_DEVICE sizes get random shards (write_random_shards); the others are
    build_checkpoint's."""
    import tempfile

    target = Path(path or Path(tempfile.gettempdir()) / f"pagoda-disk-{name}")
    if (target / "config.json").is_file():
        return str(target)
    if name not in ON_DEVICE:
        return build_checkpoint(name, target, getattr(torch, dtype))
    write_random_shards(name, target, getattr(torch, dtype))
    return str(target)


def write_random_shards(name: str, path: Path, dtype: torch.dtype) -> None:
    """`name`'s shapes, weights drawn by the loader's random fill (`fill_random_`: norm
    weights 1, the rest N(0, 0.02)) in transformers' order, written as safetensors
    shards of up to 4 GiB. Drawn on the GPU when there is one: an 8B model's 16 GB in
    seconds, not minutes."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engine.models.loader import fill_random_

    config = CONFIGS[name]()
    tokenizer = synthetic_tokenizer(min(config.vocab_size, 50257))
    config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    items = list(model.state_dict().items())
    if config.tie_word_embeddings:
        items = [(k, v) for k, v in items if k != "lm_head.weight"]
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for i, (key, meta) in enumerate(items):
        t = torch.empty(meta.shape, dtype=dtype, device=device)
        fill_random_(key, t, gen)
        shard[key] = t.cpu()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES or i == len(items) - 1:
            fname = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            shard, size = {}, 0
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)  # whole or not at all: a killed write is never reused


# PEFT's names for a Llama-shaped layer's projections, and which dimension of the layer
# each one reads and writes (hidden, q / kv heads' width, intermediate).
LORA_SHAPES = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "inter"),
    "mlp.up_proj": ("hidden", "inter"),
    "mlp.down_proj": ("inter", "hidden"),
}


def write_random_adapters(model_dir: str, count: int, rank: int) -> dict[str, str]:
    """`count` PEFT LoRA adapters of a Llama-shaped checkpoint, every projection at
    `rank`, N(0, 0.02) weights (as peft saves them; its timing does not depend on values):
    name -> directory, beside the checkpoint."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = {
        "hidden": config.hidden_size,
        "q": config.num_attention_heads * head_dim,
        "kv": config.num_key_value_heads * head_dim,
        "inter": config.intermediate_size,
    }
    gen = torch.Generator().manual_seed(0)
    adapters = {}
    for i in range(count):
        path = Path(f"{model_dir.rstrip('/')}-lora{i}-r{rank}")
        path.mkdir(exist_ok=True)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in LORA_SHAPES.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                a = torch.randn(rank, width[fan_in], generator=gen) * 0.02
                b = torch.randn(width[fan_out], rank, generator=gen) * 0.02
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, path / "adapter_model.safetensors")
        targets = sorted({m.rpartition(".")[2] for m in LORA_SHAPES})
        config_json = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=targets)
        (path / "adapter_config.json").write_text(json.dumps(config_json))
        adapters[f"lora{i}"] = str(path)
    return adapters
