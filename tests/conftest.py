"""Shared fixtures: tiny random checkpoints (tests/tiny_checkpoints.py), built once a
session, and the tokenizer they share. What tests import lives in plain modules:
tests/reference.py (the prompts, transformers' outputs), tests/tiny_checkpoints.py and
tests/introspection.py."""

from __future__ import annotations

import gc

import pytest

from engine.models.demo import train_tokenizer
from tests.tiny_checkpoints import LORA_ALL, build_encoder, build_lora, build_tiny


@pytest.fixture(autouse=True)
def _unfreeze_heap():
    """Servers and LLMs freeze the heap once started (engine/heap.py). In this one
    long-lived process that would keep every finished test's engine alive."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, tokenizer) -> str:
    return build_tiny("gpt2", tmp_path_factory.mktemp("tiny-gpt2"), tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer) -> str:
    return build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_kv3_dir(tmp_path_factory, tokenizer) -> str:
    return build_tiny("llama_kv3", tmp_path_factory.mktemp("tiny-llama-kv3"), tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer) -> str:
    return build_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), tokenizer)


@pytest.fixture(scope="session", params=["gpt2", "llama", "qwen2"])
def tiny_model_dir(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory, tokenizer):
    """`tiny_family_dir(kind)` -> a saved tiny checkpoint of a FAMILY_CONFIGS kind, built once."""
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = build_tiny(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), tokenizer)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory):
    """`tiny_encoder_dir(kind)` -> a saved tiny encoder of an ENCODERS kind, built once."""
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = build_encoder(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return get


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
