"""A model's generation_config.json: its eos_token_id list stops generation (offline and
served), and its sampling fields and max_new_tokens are the defaults of requests that
leave them out, unless --generation-config vllm."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.generation_config import GenerationConfig, load_generation_config

PROMPT = "Once upon a time"


def with_generation_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(config | fields))
    return str(dst)


def test_reads_the_stop_ids_and_sampling_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [3, 7],
                "temperature": 0.6,
                "top_k": 20,
                "do_sample": True,  # not a sampling field vLLM reads
                "top_p": "high",  # not a number: left out
                "min_p": False,
                "max_new_tokens": 256,
            }
        )
    )
    assert load_generation_config(str(tmp_path)) == GenerationConfig(
        (3, 7), {"temperature": 0.6, "top_k": 20}, 256
    )
    (tmp_path / "generation_config.json").write_text("[1, 2")
    assert load_generation_config(str(tmp_path)) == GenerationConfig()
    assert load_generation_config(str(tmp_path / "none")) == GenerationConfig()


@pytest.fixture(scope="module")
def greedy_ids(tiny_gpt2_dir) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return (
        LLM(tiny_gpt2_dir, device="cpu")
        .generate(PROMPT, params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_its_eos_ids_stop_generation(tiny_gpt2_dir, tmp_path, greedy_ids):
    stop_id = greedy_ids[5]
    model_dir = with_generation_config(tiny_gpt2_dir, tmp_path / "m", eos_token_id=[stop_id])
    params = SamplingParams(max_tokens=12, temperature=0.0)
    out = LLM(model_dir, device="cpu").generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    cut = greedy_ids.index(stop_id)
    assert out.token_ids == greedy_ids[: cut + 1]
    assert out.finish_reason == "stop"


@pytest.fixture(scope="module")
def greedy_by_default_dir(tiny_gpt2_dir, tmp_path_factory) -> str:
    return with_generation_config(
        tiny_gpt2_dir, tmp_path_factory.mktemp("gen") / "m", temperature=0.0, max_new_tokens=5
    )


def completions(server, **fields) -> list[str]:
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True} | fields
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [choice["text"] for choice in r.json()["choices"]]


def chat_length(server, **fields) -> int:
    """The answer's length in tokens, EOS ignored."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True} | fields
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def test_its_sampling_fields_are_the_request_defaults(start_server, greedy_by_default_dir):
    auto = start_server(engine={"model": greedy_by_default_dir})
    greedy = completions(auto, temperature=0.0)
    assert completions(auto, n=3, seed=5) == greedy * 3  # temperature 0 from the file
    sampled = completions(auto, n=3, seed=5, temperature=1.0)  # the request's own wins
    assert sampled != greedy * 3
    # max_new_tokens: a chat answer's length when the request gives none, min_tokens kept.
    assert chat_length(auto) == 5
    assert chat_length(auto, min_tokens=7) == 7
    assert chat_length(auto, max_tokens=9) == chat_length(auto, max_completion_tokens=9) == 9
    vllm = start_server(
        engine={"model": greedy_by_default_dir}, server={"generation_config": "vllm"}
    )
    assert completions(vllm, n=3, seed=5) == sampled  # OpenAI's default: temperature 1
    assert chat_length(vllm) > 5  # up to the context's end
