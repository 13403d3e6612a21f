"""lm-eval's loglikelihood requests (a multiple-choice task from a local JSONL file)
against a live server, equal to transformers' on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.server.lm_eval_tasks import MULTIPLE_CHOICE, evaluate


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """As lm-eval encodes a pair: trailing context spaces move to the continuation, and
    the continuation's tokens are the whole text's past the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(num_context, len(whole)))


def test_multiple_choice_loglikelihoods_equal_transformers(
    live, model_name, tmp_path, tiny_gpt2_dir
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = evaluate(live.base_url, model_name, ["pagoda_mc"], tmp_path)
    assert "acc,none" in results["results"]["pagoda_mc"]
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    samples = results["samples"]["pagoda_mc"]
    assert len(samples) == len(MULTIPLE_CHOICE)
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(
            sample["arguments"], [r[0] for r in sample["resps"]], strict=True
        ):
            expected = hf_loglikelihood(model, tokenizer, context, continuation)
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
