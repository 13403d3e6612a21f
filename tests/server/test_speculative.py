"""A server with speculative decoding: streamed and whole answers (logprobs too) equal
the plain server's under greedy decoding, and /metrics counts drafts (vLLM's
spec_decode names)."""

from __future__ import annotations

import json

import httpx
import pytest

SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
BODY = {"prompt": "The cat sat on the mat. The cat sat", "max_tokens": 64, "temperature": 0.0}


def streamed_text(base_url: str) -> str:
    text = ""
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=BODY | {"stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_speculating_server_answers_as_the_plain_one(start_server, live):
    spec = start_server(engine=SPEC)
    want = httpx.post(f"{live.base_url}/v1/completions", json=BODY, timeout=60).json()
    got = httpx.post(f"{spec.base_url}/v1/completions", json=BODY, timeout=60).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"] == want["usage"]
    assert streamed_text(spec.base_url) == want["choices"][0]["text"]
    drafted = spec.metric("pagoda:spec_decode_num_draft_tokens_total")
    accepted = spec.metric("pagoda:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    assert live.metric("pagoda:spec_decode_num_draft_tokens_total") == 0
    # A request with logprobs drafts too, and gets each token's own.
    body = BODY | {"logprobs": 2}
    want = httpx.post(f"{live.base_url}/v1/completions", json=body, timeout=60).json()
    got = httpx.post(f"{spec.base_url}/v1/completions", json=body, timeout=60).json()
    want_lp, got_lp = want["choices"][0]["logprobs"], got["choices"][0]["logprobs"]
    assert got_lp["tokens"] == want_lp["tokens"] and len(got_lp["tokens"]) == 64
    for a, b in zip(got_lp["token_logprobs"], want_lp["token_logprobs"], strict=True):
        assert abs(a - b) < 1e-4
    assert spec.metric("pagoda:spec_decode_num_draft_tokens_total") > drafted
    # And streamed chat with top_logprobs: the same tokens and logprobs, chunk by chunk.
    chat = {
        "messages": [{"role": "user", "content": BODY["prompt"]}],
        "max_tokens": 48,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    got, want = streamed_chat(spec.base_url, chat), streamed_chat(live.base_url, chat)
    assert (got[0], got[1]) == (want[0], want[1])
    assert got[2] == pytest.approx(want[2], abs=1e-4)


def streamed_chat(base_url: str, body: dict) -> tuple[str, list, list[float]]:
    """The streamed text; each token's entry (token, its top alternatives); its logprob."""
    text, entries, values = "", [], []
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body | {"stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices:
                continue
            text += choices[0]["delta"].get("content") or ""
            for e in (choices[0].get("logprobs") or {}).get("content") or []:
                entries.append((e["token"], [t["token"] for t in e["top_logprobs"]]))
                values.append(e["logprob"])
    assert len(entries) == body["max_tokens"]
    return text, entries, values
