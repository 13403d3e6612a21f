"""LoRA adapters over the API: each is a model of its own name (vLLM's --lora-modules),
listed by /v1/models with its base as parent, named by the responses it answers."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.models.loader import load_tokenizer
from server.cli import parse_configs
from tests.conftest import peft_greedy


@pytest.fixture
def oai(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="x", max_retries=0)


def test_models_lists_each_adapter_under_its_base(oai, tiny_llama_dir, tiny_lora_adapters):
    base = tiny_llama_dir.rstrip("/").rsplit("/", 1)[-1]
    cards = {m.id: m for m in oai.models.list().data}
    assert list(cards) == [base, "all", "qv"]
    assert cards["all"].parent == base and cards["all"].root == tiny_lora_adapters["all"]
    assert getattr(cards[base], "parent", None) is None
    assert oai.models.retrieve("qv").parent == base


def test_a_completion_with_an_adapters_name_generates_with_it(
    oai, tiny_llama_dir, tiny_lora_adapters
):
    prompt = "Once upon a time"
    ids = load_tokenizer(tiny_llama_dir).encode(prompt)
    for name in ("all", "qv"):
        out = oai.completions.create(
            model=name,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.model == name
        want = peft_greedy(tiny_llama_dir, tiny_lora_adapters[name], ids, 8)
        assert out.choices[0].token_ids == want


def test_a_streamed_chat_names_the_adapter_in_every_chunk(oai):
    stream = oai.chat.completions.create(
        model="qv",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
    )
    assert {chunk.model for chunk in stream} == {"qv"}


def test_an_unknown_model_is_a_404(lora_server):
    r = httpx.post(
        f"{lora_server.base_url}/v1/completions",
        json={"model": "other", "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_the_flag_takes_name_equals_dir_and_vllms_json():
    engine, _ = parse_configs(
        ["--lora-modules", "a=/adapters/a", '{"name": "b", "path": "/adapters/b"}', "--enable-lora"]
    )
    assert engine.lora_modules == {"a": "/adapters/a", "b": "/adapters/b"}
    for bad in (["a"], ["a=/x", "a=/y"], ['{"name": "a"}']):
        with pytest.raises(SystemExit):
            parse_configs(["--lora-modules", *bad])
