"""Greedy output token for token equal to transformers generate, on tiny random checkpoints."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from tests.reference import PROMPTS, hf_greedy

MAX_NEW = 24


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dir_tokenizer(tiny_model_dir):
    # The directory's own tokenizer, as AutoTokenizer picks it (qwen2 gets Qwen2's class).
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, dir_tokenizer) -> list[list[int]]:
    return [hf_greedy(tiny_model_dir, dir_tokenizer.encode(p), MAX_NEW) for p in PROMPTS]


def run(model_dir: str, prompts=PROMPTS, **config) -> list[list[int]]:
    llm = LLM(model_dir, device="cpu", **config)
    outs = llm.generate(list(prompts), greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_single_requests_match_transformers(tiny_model_dir, expected):
    llm = LLM(tiny_model_dir, device="cpu")
    for prompt, want in zip(PROMPTS[:3], expected[:3]):
        assert llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids == want


def test_batched_requests_match_transformers(tiny_model_dir, expected):
    assert len(PROMPTS) >= 8
    assert run(tiny_model_dir) == expected


def test_chunked_prefill_matches(tiny_model_dir, expected):
    # A budget of 7 tokens splits most prompts into several chunks mixed with decodes.
    assert run(tiny_model_dir, max_num_batched_tokens=7, block_size=16) == expected


def test_prefix_caching_on_and_off_agree(tiny_model_dir, dir_tokenizer):
    shared = PROMPTS[5] + " " + PROMPTS[8]  # long enough to fill several 4-token blocks
    prompts = [shared + suffix for suffix in ("", " one", " two", " three")] * 2
    want = [hf_greedy(tiny_model_dir, dir_tokenizer.encode(p), MAX_NEW) for p in prompts[:4]] * 2
    llm = LLM(tiny_model_dir, device="cpu", block_size=4, max_num_seqs=2)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.num_cached_tokens for o in outs) > 0, "shared prefixes should hit the cache"
    assert (
        run(tiny_model_dir, prompts, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
        == want
    )


def test_preemption_gives_same_outputs(tiny_model_dir, expected):
    # 16 blocks of 4 tokens cannot hold 9 sequences of ~40 tokens at once.
    llm = LLM(tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=24, max_model_len=64)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == 24
