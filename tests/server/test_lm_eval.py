"""lm-eval against a live server: a generate_until task from a local JSONL file, with
the server's own tokenizer (/tokenizer_info). The loglikelihood half, which needs the
engine's prompt logprobs, is in pending_test_lm_eval_loglikelihood.py."""

from __future__ import annotations

import httpx

from tests.server.lm_eval_tasks import GENERATE, evaluate


def test_generate_until_task(live, model_name, tmp_path):
    results = evaluate(live.base_url, model_name, ["pagoda_gen"], tmp_path)
    assert "exact_match,none" in results["results"]["pagoda_gen"]
    samples = results["samples"]["pagoda_gen"]
    assert len(samples) == len(GENERATE)
    for sample in samples:
        # Greedy, cut at the first newline: the server's own answer to the same prompt.
        body = {
            "prompt": sample["doc"]["prompt"],
            "max_tokens": 8,
            "temperature": 0,
            "stop": ["\n"],
        }
        expected = httpx.post(f"{live.base_url}/v1/completions", json=body).json()
        assert sample["filtered_resps"][0] == expected["choices"][0]["text"]
