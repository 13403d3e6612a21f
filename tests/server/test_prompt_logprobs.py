"""Prompt logprobs through the server: completions echo + logprobs (the legacy scoring
format), vLLM's prompt_logprobs on completions and chat, streamed and not, against
transformers' log_softmax on the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

PROMPT = [5, 17, 42, 99, 7, 230, 12, 64, 3, 77, 150, 8, 19, 300, 41, 2, 88, 61, 5, 9]


@pytest.fixture(scope="module")
def reference(tiny_gpt2_dir) -> torch.Tensor:
    """transformers' log_softmax at every position of PROMPT: [len(PROMPT), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def expected_logprob(reference: torch.Tensor, i: int) -> float:
    """The logprob of PROMPT[i] given PROMPT[:i]."""
    return reference[i - 1, PROMPT[i]].item()


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_scores_the_prompt(client, reference, tokenizer, max_tokens):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": max_tokens}
    body["temperature"] = 0
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + max_tokens
    assert lp["tokens"][: len(PROMPT)] == [tokenizer.decode([t]) for t in PROMPT]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(PROMPT)):
        assert lp["token_logprobs"][i] == pytest.approx(expected_logprob(reference, i), abs=1e-4)
        top = lp["top_logprobs"][i]
        assert 1 <= len(top) <= 3 and top[lp["tokens"][i]] == lp["token_logprobs"][i]
    assert choice["text"].startswith(tokenizer.decode(PROMPT))


def test_prompt_logprobs_on_completions_and_chat(client, reference):
    body = {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1}
    entries = client.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for i in range(1, len(PROMPT)):
        entry = entries[i]
        assert len(entry) <= 3 and str(PROMPT[i]) in entry
        own = entry[str(PROMPT[i])]["logprob"]
        assert own == pytest.approx(expected_logprob(reference, i), abs=1e-4)
        best = reference[i - 1].topk(2)
        for token_id, logprob in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert entry[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-4)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1}
    r = client.post("/v1/chat/completions", json=chat | {"max_tokens": 1}).json()
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) > 1


def test_prompt_logprobs_are_the_same_with_a_prefix_cache_hit(client):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    first = client.post("/v1/completions", json=body).json()
    again = client.post("/v1/completions", json=body).json()
    assert first["choices"][0]["logprobs"] == again["choices"][0]["logprobs"]


def test_streamed_echo_with_logprobs_opens_with_the_scored_prompt(client, reference):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    logprobs = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(tokens) == len(PROMPT) + 2 and logprobs[0] is None
    assert logprobs[5] == pytest.approx(expected_logprob(reference, 5), abs=1e-4)
