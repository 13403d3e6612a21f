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
    else:
        raise ValueError(kind)
    return _save(path, model.eval(), tokenizer)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, tokenizer) -> str:
    return _build("gpt2", tmp_path_factory.mktemp("tiny-gpt2"), tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer) -> str:
    return _build("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer) -> str:
    return _build("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), tokenizer)


@pytest.fixture(scope="session", params=["gpt2", "llama", "qwen2"])
def tiny_model_dir(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy continuation in fp32 on CPU, EOS ignored (kwargs: to generate)."""
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # ignore EOS without masking it
        _hf_models[model_dir] = model
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


_hf_models: dict = {}
