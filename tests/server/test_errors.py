"""Bad input: a 4xx with the OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import logging

import pytest

from tests.server.live_server import MAX_MODEL_LEN

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
LONG = " ".join(["hello"] * (MAX_MODEL_LEN + 10))

CASES = [
    # (name, path, json body or raw bytes, status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("empty body", "/v1/chat/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("mixed prompt list", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    (
        "max_tokens wrong type",
        "/v1/completions",
        {"prompt": "x", "max_tokens": "ten"},
        400,
        "max_tokens",
    ),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature", "/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("top_p", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_k", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("seed past 64 bits", "/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("n", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("logprobs", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (
        "presence_penalty",
        "/v1/completions",
        {"prompt": "x", "presence_penalty": 5},
        400,
        "presence_penalty",
    ),
    (
        "repetition_penalty",
        "/v1/completions",
        {"prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (
        "min_tokens > max_tokens",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    (
        "logit_bias key",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"a": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias oov",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
    ),
    (
        "stop_token_ids oov",
        "/v1/completions",
        {"prompt": "x", "stop_token_ids": [99999]},
        400,
        "stop_token_ids",
    ),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [[1, -1]]}, 400, "prompt"),
    ("prompt past max_model_len", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    (
        "prompt + max_tokens past max_model_len",
        "/v1/completions",
        {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("chat unknown model", "/v1/chat/completions", CHAT | {"model": "gpt-9"}, 404, "model"),
    ("chat missing messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "chat bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    (
        "chat image part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
    ),
    (
        "chat top_logprobs without logprobs",
        "/v1/chat/completions",
        CHAT | {"top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "chat top_logprobs too many",
        "/v1/chat/completions",
        CHAT | {"logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
    ),
    ("chat tools", "/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, 400, "tools"),
    (
        "chat max_completion_tokens past max_model_len",
        "/v1/chat/completions",
        CHAT | {"max_completion_tokens": 10**6},
        400,
        "max_tokens",
    ),
    (
        "chat min_tokens past max_model_len",
        "/v1/chat/completions",
        CHAT | {"min_tokens": 10**4},
        400,
        "min_tokens",
    ),
    (
        "prompt_logprobs too many",
        "/v1/completions",
        {"prompt": "x", "prompt_logprobs": 21},
        400,
        "prompt_logprobs",
    ),
    ("tokenize neither", "/tokenize", {}, 400, "prompt"),
    ("tokenize empty messages", "/tokenize", {"messages": []}, 400, "messages"),
    ("detokenize oov", "/detokenize", {"tokens": [99999]}, 400, "tokens"),
]


@pytest.mark.parametrize("name, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error(client, caplog, name, path, body, status, param):
    caplog.set_level(logging.ERROR)
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    # A client's mistake is its 4xx, not an error (or a traceback) in the server's log.
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_length_errors_name_the_numbers(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 300})
    assert "256" in r.json()["error"]["message"] and "300" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": LONG})
    assert str(MAX_MODEL_LEN) in r.json()["error"]["message"]


def test_unknown_route_and_method(client):
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_still_serving_after_errors(client):
    for _, path, body, _, _ in CASES[:5]:
        client.post(
            path,
            content=body if isinstance(body, bytes) else None,
            json=None if isinstance(body, bytes) else body,
        )
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").status_code == 200


def test_tokenize_detokenize_round_trip(client, tokenizer):
    r = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    chat = client.post("/tokenize", json=CHAT).json()
    text = tokenizer.apply_chat_template(
        CHAT["messages"], add_generation_prompt=True, tokenize=False
    )
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
