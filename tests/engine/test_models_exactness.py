"""Qwen3 (with YaRN), Qwen3-MoE, Qwen2-MoE, Mixtral, Mistral, Ministral, Gemma 2, Gemma 3, Phi-3,
SmolLM3, Llama 4, StarCoder2, Granite, Granite MoE, OLMo, OLMo 2, OLMo 3, OLMoE, MiniMax-M2, GPT-OSS, GPT-NeoX (parallel and sequential residual), Phi, GPT-J, GPT-BigCode (MQA and MHA), OPT, Falcon (four layouts), Cohere, ERNIE 4.5 (dense and MoE), Seed-OSS, EXAONE 4, EXAONE MoE, GLM-4, GLM-4.5, Solar Open, GLM-4.7-Flash, DeepSeek-V2,
DeepSeek-V3 and Qwen 3.5 (dense and MoE): greedy output token for token equal to transformers generate (fp32, CPU), or
parting from it only where its two best logits are a rounding apart (NEAR_TIE), on tiny
random checkpoints whose sliding windows (8-16 tokens) the prompts and generations cross
several times."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from tests.reference import PROMPTS, assert_greedy_matches, hf_greedy
from tests.tiny_checkpoints import FAMILY_CONFIGS

MAX_NEW = 24


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family_dir(request, tiny_family_dir) -> str:
    return tiny_family_dir(request.param)


@pytest.fixture(scope="module")
def expected(family_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(family_dir)
    return [hf_greedy(family_dir, tokenizer.encode(p), MAX_NEW) for p in PROMPTS]


def outputs(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


def prompt_ids(family_dir: str, prompts: list[str]) -> list[list[int]]:
    tokenizer = load_tokenizer(family_dir)
    return [tokenizer.encode(p) for p in prompts]


def test_single_requests_match_transformers(family_dir, expected):
    llm = LLM(family_dir, device="cpu")
    ids = prompt_ids(family_dir, PROMPTS[:2])
    for prompt, prompt_id, want in zip(PROMPTS[:2], ids, expected[:2]):
        assert_greedy_matches(family_dir, [prompt_id], outputs(llm, [prompt]), [want])


def test_batched_mixed_lengths_match_transformers(family_dir, expected):
    # 9 prompts of 1-38 tokens, each generating 24: every sequence passes every window.
    got = outputs(LLM(family_dir, device="cpu"), PROMPTS)
    assert_greedy_matches(family_dir, prompt_ids(family_dir, PROMPTS), got, expected)


def test_prefix_caching_and_chunked_prefill_match(family_dir):
    # Small blocks, so cached prefixes and prefill chunks (budget 11) start mid-window.
    shared = PROMPTS[3] + " " + PROMPTS[6]  # ~30 tokens: several 4-token blocks
    prompts = [shared + suffix for suffix in ("", " one", " two")] * 2
    ids = prompt_ids(family_dir, prompts)
    want = [hf_greedy(family_dir, i, MAX_NEW) for i in ids[:3]] * 2
    llm = LLM(family_dir, device="cpu", block_size=4, max_num_seqs=2, max_num_batched_tokens=11)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_greedy_matches(family_dir, ids, [o.outputs[0].token_ids for o in outs], want)
    cached = sum(o.num_cached_tokens for o in outs)
    if llm.engine.config.enable_prefix_caching:
        assert cached > 0, "shared prefixes should hit the cache"
    else:  # recurrent layers (Qwen 3.5's): each prompt's state built from its first token
        assert cached == 0
