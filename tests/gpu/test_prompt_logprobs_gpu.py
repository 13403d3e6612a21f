"""Prompt logprobs on CUDA: steps that score run eagerly beside graph steps, and the
entries equal transformers' while ordinary requests in the same steps are unchanged."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_prompt_logprobs import check, prompt_of, reference
from tests.gpu.on_cuda import GPU
from tests.reference import hf_greedy

pytestmark = GPU


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_scoring_steps_run_eagerly_beside_graphs_and_match_transformers(request, kind):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompts = [prompt_of(n, seed, vocab) for seed, n in enumerate((90, 37, 20, 9))]
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=40)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    ordinary = [p[::-1] for p in prompts]
    mixed = [x for pair in zip(ordinary, prompts) for x in pair]
    outs = llm.generate(mixed, [greedy, scoring] * len(prompts), use_tqdm=False)
    for prompt, out in zip(ordinary, outs[0::2]):
        assert out.prompt_logprobs is None
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 8)
    for prompt, out in zip(prompts, outs[1::2]):
        check(out.prompt_logprobs, prompt, reference(hf, prompt), k=2, atol=2e-3)
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 8)
    steps = llm.engine.runner.steps_by_path
    assert steps["eager"] > 0 and steps["graph"] > 0
    # Later prompts alone: no scoring request left, so prefill graphs again.
    before = steps["prefill graph"]
    llm.generate(ordinary[:2], greedy, use_tqdm=False)
    assert steps["prefill graph"] > before
