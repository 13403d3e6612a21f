"""Prompt logprobs equal log_softmax of transformers' logits at every prompt position,
whatever the prefill looks like: chunked, beside a prefix-cache hit it must not take,
batched with ordinary requests (whose outputs stay the same), preempted midway."""

from __future__ import annotations

import pytest
import torch

import engine.prompt_logprobs
from engine import LLM, SamplingParams
from engine.request import TokenLogprob
from tests.reference import hf_greedy

K = 3
ATOL = 1e-4


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_dir(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(hf_model) -> list[list[int]]:
    vocab = hf_model.config.vocab_size
    return [prompt_of(n, seed, vocab) for seed, n in enumerate((37, 20, 9, 2, 1))]


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each prompt position: [len(prompt), vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(-1)


def check(
    entries: list[TokenLogprob | None] | None,
    prompt: list[int],
    ref: torch.Tensor,
    k: int = K,
    atol: float = ATOL,
) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i in range(1, len(prompt)):
        entry, row = entries[i], ref[i - 1]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=atol)
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        best = row.topk(k)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=atol)


def scoring(max_tokens: int = 4, k: int = K) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=k
    )


def greedy(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("budget", [2048, 7, 2], ids=["one-chunk", "chunks-of-7", "chunks-of-2"])
def test_prompt_logprobs_equal_transformers(model_dir, hf_model, prompts, budget):
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, scoring(), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 4)


def test_no_prefix_cache_hit_is_taken_by_a_scoring_request(model_dir, hf_model, prompts):
    llm = LLM(model_dir, device="cpu", block_size=4)
    prompt, ref = prompts[0], reference(hf_model, prompts[0])
    plain = llm.generate(prompt, greedy(), use_tqdm=False)[0]  # its blocks are cached now
    again = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0, "the prompt's blocks should be in the cache"
    scored = llm.generate(prompt, scoring(), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    check(scored.prompt_logprobs, prompt, ref)
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    twice = llm.generate([prompt, prompt], scoring(), use_tqdm=False)
    for out in twice:
        check(out.prompt_logprobs, prompt, ref)


def test_batched_with_ordinary_requests_which_do_not_change(model_dir, hf_model, prompts):
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=16)
    ordinary = [p[::-1] for p in prompts[:3]]
    mixed = [x for pair in zip(ordinary, prompts[:3]) for x in pair]
    params = [greedy(6), scoring(6)] * 3
    outs = llm.generate(mixed, params, use_tqdm=False)
    for prompt, out in zip(ordinary, outs[0::2], strict=True):
        assert out.prompt_logprobs is None
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 6)
    for prompt, out in zip(prompts, outs[1::2]):
        check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 6)


def test_logits_are_taken_a_few_rows_at_a_time(model_dir, hf_model, prompts, monkeypatch):
    monkeypatch.setattr(engine.prompt_logprobs, "SCORE_ROWS", 5)
    llm = LLM(model_dir, device="cpu")
    out = llm.generate(prompts[0], scoring(k=0), use_tqdm=False)[0]
    check(out.prompt_logprobs, prompts[0], reference(hf_model, prompts[0]), k=0)


def test_preempted_midway_the_entries_are_still_right(model_dir, hf_model, prompts):
    # 12 blocks of 4 tokens cannot hold three ~37-token requests prefilled side by side.
    llm = LLM(
        model_dir,
        device="cpu",
        block_size=4,
        num_kv_blocks=12,
        max_model_len=48,
        max_num_batched_tokens=8,
    )
    prompt = prompts[0]
    outs = llm.generate([prompt, prompt[1:], prompt[2:]], scoring(2), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        check(out.prompt_logprobs, out.prompt_token_ids, reference(hf_model, out.prompt_token_ids))


def test_only_a_choices_first_output_carries_them(model_dir, hf_model, prompts):
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=8)
    eng = llm.engine
    eng.add_request("r", prompts[1], scoring(5))
    firsts, rest = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            (rest if firsts else firsts).append(out)
    assert len(firsts) == 1 and rest
    check(firsts[0].prompt_logprobs, prompts[1], reference(hf_model, prompts[1]))
    assert all(out.prompt_logprobs is None for out in rest)


def test_prompt_logprobs_are_bounded_like_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("kind", ["granite", "gemma2", "cohere"])
def test_logit_scaling_and_soft_cap_reach_the_logprobs(tiny_family_dir, kind):
    """Granite divides its logits by logits_scaling, Cohere multiplies them by
    logit_scale and Gemma soft-caps them: greedy ids cannot tell, the logprobs must."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_family_dir(kind)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = prompt_of(12, 0, hf_model.config.vocab_size)
    out = LLM(model_dir, device="cpu").generate([prompt], scoring(), use_tqdm=False)[0]
    check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
