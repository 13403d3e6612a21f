"""Tiny random checkpoints saved with transformers: the families' builder, encoders, and
PEFT LoRA adapters.

Every checkpoint is a real Hugging Face directory (config.json, safetensors, tokenizer
files), so Pagoda loads it the way it loads a downloaded model. Weights use a larger init
than the default so that greedy decoding has clear winners and never hinges on a
rounding-level tie."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.demo import train_tokenizer
from tests.families_dense import DENSE_FAMILIES
from tests.families_hybrid import HYBRID_FAMILIES
from tests.families_moe import MOE_FAMILIES

# The sizes every family's tiny config starts from (FAMILY_CONFIGS' fields override them).
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = DENSE_FAMILIES | MOE_FAMILIES | HYBRID_FAMILIES
# Zeros and ones from transformers: drawn, so that each counts.
QWEN3_5_DRAWN = ("norm.weight",)
# Mamba-2's per-head parameters (transformers: A_log = log(1..heads), D and dt_bias ones)
# and the norms (ones), drawn so that each head's and each dim's entry counts.
MAMBA2_DRAWN = ("A_log", ".D", "dt_bias", "norm.weight")
MAMBA2_FAMILIES = ("granitemoehybrid", "nemotron_h", "bamba", "falcon_h1", "mamba2")
# Ones from transformers: drawn, so that each counts (the router's scales, the MoE's).
GEMMA4_DRAWN = ("norm.weight", "layer_scalar", "scale")


def save_checkpoint(path: Path, model, tokenizer) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_tiny(kind: str, path: Path, tokenizer) -> str:
    """A tiny random checkpoint of `kind` (gpt2, llama, llama_kv3, qwen2 or a
    FAMILY_CONFIGS kind) saved under path with the tokenizer; its path."""
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
    return save_checkpoint(path, model.eval(), tokenizer)


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
    save_checkpoint(path, getattr(transformers, cls_name)(config), tokenizer)
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
