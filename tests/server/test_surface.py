"""The vLLM/OpenAI request surface beyond the basics: strict types, nulls, fields Pagoda
lacks, chat template options, token ids, usage details, small endpoints, the schema."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from server.prompts import Prompts
from server.protocol import ChatMessage, ChatTemplateOptions
from tests.server.live_server import MAX_MODEL_LEN

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

STRICT = [
    # (path, body, param): a value of the wrong type is a 400, never coerced
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/chat/completions", CHAT | {"n": 1.5}, "n"),
    ("/detokenize", {"tokens": [True, False]}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", STRICT)
def test_types_are_strict(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_null_means_the_default(client):
    nulls = dict.fromkeys(["n", "stream", "temperature", "top_p", "stop", "logprobs", "echo"])
    nulls |= dict.fromkeys(["seed", "user", "ignore_eos", "min_tokens", "stream_options"])
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2} | nulls)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = client.post("/v1/chat/completions", json=CHAT | {"logprobs": None, "n": None})
    assert r.status_code == 200, r.text


def test_an_unknown_field_is_a_400_unless_null(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    # null asks for nothing (SDKs echo such fields back in assistant messages)
    message = {"role": "assistant", "content": "Hi", "refusal": None}
    body = CHAT | {"messages": [*CHAT["messages"], message], "frobnicate": None}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    # ... and the published schema says so, for clients and fuzzers that read it.
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ChatMessage"):
        assert schemas[name]["additionalProperties"] == {"type": "null"}


def test_the_schema_lets_every_optional_field_be_null(client):
    # null is taken as the default wherever a field is optional, so the schema must allow
    # it: fuzzers and typed clients (schemathesis' negative mode) read it from there.
    r = client.post("/tokenize", json={"prompt": "x", "add_special_tokens": None})
    assert r.status_code == 200, r.text
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    checked = 0
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest"):
        schema = schemas[name]
        for field, prop in schema["properties"].items():
            if field in schema.get("required", ()):
                assert {"type": "null"} not in prop.get("anyOf", ()), (name, field)
            else:
                assert {"type": "null"} in prop.get("anyOf", ()), (name, field)
                checked += 1
    assert checked > 50


@pytest.mark.parametrize("field", ["early_stopping", "kv_transfer_params"])
def test_a_vllm_field_pagoda_lacks_is_a_400_naming_it(client, field):
    value = True if field == "early_stopping" else {"do_remote_prefill": True}
    r = client.post("/v1/completions", json={"prompt": "x", field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]
    # Off or null is no request for it.
    off = False if field == "early_stopping" else None
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, field: off})
    assert r.status_code == 200


def test_allowed_token_ids_and_bad_words(client, tokenizer):
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    body |= {"ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    allowed = sorted(set(plain[2:6]) | {40, 41})
    chat = {k: v for k, v in body.items() if k != "prompt"} | CHAT | {"max_tokens": 8}
    for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        r = client.post(path, json=request | {"allowed_token_ids": allowed})
        assert r.status_code == 200, r.text
        assert set(r.json()["choices"][0]["token_ids"]) <= set(allowed)
    # A word the plain output spells is not spelled again: it changes where it began.
    word = tokenizer.decode(plain[2:4])
    banned = tokenizer.encode(word, add_special_tokens=False)
    r = client.post("/v1/completions", json=body | {"bad_words": [word]})
    ids = r.json()["choices"][0]["token_ids"]
    assert plain[2:4] == banned and ids[:3] == plain[:3] and ids[3] != plain[3]
    # Token-id prompts are checked inline unless bad words need the tokenizer.
    prompt = {"prompt": tokenizer.encode("Hello")}
    assert (
        client.post("/v1/completions", json=body | prompt | {"bad_words": [word]}).json()[
            "choices"
        ][0]["token_ids"]
        == ids
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("allowed_token_ids", [], "must not be empty"),
        ("allowed_token_ids", [1, 10**6], "outside the vocabulary"),
        ("bad_words", ["ok", " "], "empty or blank"),
    ],
)
def test_bad_allowed_token_ids_and_bad_words_are_400s(client, field, value, message):
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)):
        r = client.post(path, json=extra | {field: value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and message in error["message"]


def test_logit_bias_error_names_the_bad_keys(client):
    r = client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"12": 1, "abc": 2}})
    assert r.status_code == 400
    assert "'abc'" in r.json()["error"]["message"] and "'12'" not in r.json()["error"]["message"]


def test_logprobs_zero_returns_the_sampled_tokens_entry(client):
    body = {"prompt": "Hello", "max_tokens": 3, "logprobs": 0, "temperature": 0}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    chat = client.post("/v1/chat/completions", json=CHAT | {"logprobs": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(c["top_logprobs"] == [] for c in content)


def test_cached_tokens_count_prefix_cache_hits(client):
    prompt = list(range(10, 60))  # 50 tokens: three full blocks of 16
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def tokenize(client, **body) -> list[int]:
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_template_options(client, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]
    opened = tokenize(client, messages=messages)
    closed = tokenize(client, messages=messages, add_generation_prompt=False)
    cont = tokenize(
        client, messages=messages, add_generation_prompt=False, continue_final_message=True
    )
    assert tokenizer.decode(opened).endswith("<|assistant|>\n")
    assert tokenizer.decode(closed).endswith("Once\n")
    assert tokenizer.decode(cont).endswith("Once")  # left open for the model to go on
    assert tokenize(client, messages=messages, chat_template_kwargs={"today": "x"}) == opened
    both = {"messages": messages, "continue_final_message": True}
    assert client.post("/tokenize", json=both).status_code == 400
    reserved = {"messages": messages, "chat_template_kwargs": {"tokenize": True}}
    r = client.post("/tokenize", json=reserved)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_opens_the_answer_with_the_open_message(client, stream):
    body = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "echo": True,
        "max_tokens": 3,
        "stream": stream,
    }
    if not stream:
        content = client.post("/v1/chat/completions", json=body).json()
        content = content["choices"][0]["message"]["content"]
    else:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content.startswith("Once") and len(content) > len("Once")


def test_tokenize_returns_token_strings(client, tokenizer):
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    assert "token_strs" not in client.post("/tokenize", json={"prompt": "Hello"}).json()


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    body = {"prompt": "Hi", "max_tokens": 5, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 5


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    prompt = list(range(1, 301))  # longer than the context
    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 10}
    body["return_token_ids"] = True
    r = client.post("/v1/completions", json=body).json()
    assert r["usage"]["prompt_tokens"] == 10
    assert r["choices"][0]["prompt_token_ids"] == prompt[-10:]
    long_text = {"prompt": "hello " * 400, "max_tokens": 1, "truncate_prompt_tokens": -1}
    assert client.post("/v1/completions", json=long_text).status_code == 400  # no room left
    too_many = {"prompt": "x", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}
    r = client.post("/v1/completions", json=too_many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_return_token_ids(client, tokenizer):
    body = {"prompt": "Hello", "max_tokens": 4, "return_token_ids": True, "temperature": 0}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("Hello")
    assert len(choice["token_ids"]) == 4 and tokenizer.decode(choice["token_ids"]) == choice["text"]
    chat = client.post("/v1/chat/completions", json=CHAT | {"return_token_ids": True}).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 3
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenizer.encode("Hello")
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_echo_with_max_tokens_zero_returns_the_prompt(client):
    body = {"prompt": "Hello there", "max_tokens": 0, "echo": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400  # nothing to return without echo


def test_request_id_is_echoed_or_made(client):
    r = client.get("/v1/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    made = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert len(made.headers["x-request-id"]) == 32
    bad = client.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "a b"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] != "a b"


def test_probe_endpoints(client, tokenizer):
    assert client.head("/health").status_code == 200
    assert client.head("/metrics").status_code == 200
    assert client.get("/ping").json() == {"status": "ok"}
    assert client.post("/ping").status_code == 200
    assert client.get("/version").json()["version"]
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["model_max_length"] == MAX_MODEL_LEN and "<|assistant|>" in info["chat_template"]


def test_vllm_metric_families(client):
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
    text = client.get("/metrics").text
    for family in (
        "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
        "request_params_n", "request_params_max_tokens", "request_inference_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds",
    ):  # fmt: skip
        assert f"pagoda:{family}_count" in text, family
    assert 'pagoda:cache_config_info{block_size="16"' in text
    assert 'pagoda:request_params_n_bucket{le="2"}' in text


def test_openapi_documents_the_real_errors(client):
    schema = client.get("/openapi.json").json()
    assert '"422"' not in json.dumps(schema)
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    for status in ("400", "401", "404", "413", "503"):
        ref = completions[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    assert "text/event-stream" in completions["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_responses_are_what_the_schema_says(live):
    """The error body a 404 route gets is the documented one."""
    r = httpx.get(f"{live.base_url}/nowhere")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, tokenizer, stream):
    ids = tokenizer.encode("Hello")
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    body |= {"return_tokens_as_token_ids": True, "return_token_ids": True, "stream": stream}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = [x for x in r.iter_lines() if x.startswith(("data: {", "{"))]
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines]
    choices = [c["choices"][0] for c in chunks]
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    generated = [t for c in choices for t in c.get("token_ids") or []]
    assert tokens == [f"token_id:{t}" for t in ids + generated]
    top = [k for c in choices for entry in c["logprobs"]["top_logprobs"] if entry for k in entry]
    assert top and all(k.startswith("token_id:") for k in top)
    chat = CHAT | {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    chat |= {"return_token_ids": True}
    answer = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = answer["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in answer["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_cache_salt_shares_cached_prefixes_within_one_salt_only(client):
    prompt = list(range(100, 150))  # 50 tokens: three full blocks of 16

    def cached(**salt) -> int:
        body = {"prompt": prompt, "max_tokens": 1} | salt
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0  # another salt: nothing shared
    assert cached() == 0  # nor without one
    assert cached(cache_salt="tenant-a") == 48
    assert cached() == 48
    chat = CHAT | {"cache_salt": ""}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_documents_reach_the_chat_template(tokenizer):
    rag = copy.deepcopy(tokenizer)
    rag.chat_template = (
        "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    prompts = Prompts(rag, 256)
    try:
        hi = [ChatMessage(role="user", content="Hi")]
        docs = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
        ids = prompts.render_chat(hi, ChatTemplateOptions(documents=docs)).token_ids
        assert rag.decode(ids) == "[A: alpha][B: beta]Hi"
        assert rag.decode(prompts.render_chat(hi, ChatTemplateOptions()).token_ids) == "Hi"
    finally:
        prompts.close()


def test_documents_are_checked(client):
    r = client.post("/v1/chat/completions", json=CHAT | {"documents": [{"title": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("documents")
    r = client.post("/v1/chat/completions", json=CHAT | {"documents": [{"text": "alpha"}]})
    assert r.status_code == 200, r.text


def test_priority_needs_priority_scheduling(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=CHAT | {"priority": 0})
    assert r.status_code == 200, r.text


def test_a_served_chat_template_replaces_the_tokenizers(start_server, client, tmp_path):
    """--chat-template FILE: every chat prompt (and /tokenizer_info) takes it; with
    --trust-request-chat-template a request's own template takes its place (without it,
    a 400)."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}=>"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    own = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    live = start_server(server={"chat_template": str(path), "trust_request_chat_template": True})
    messages = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=live.base_url, timeout=30) as http:

        def prompt_of(**extra) -> str:
            r = http.post("/tokenize", json={"messages": messages, **extra})
            return http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

        assert prompt_of() == "<user>Hi=>"
        assert prompt_of(chat_template=own) == "[Hi]"
        body = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
        chat = http.post("/v1/chat/completions", json=body).json()
        assert (
            http.post("/detokenize", json={"tokens": chat["prompt_token_ids"]}).json()["prompt"]
            == "<user>Hi=>"
        )
        chat = http.post("/v1/chat/completions", json=body | {"chat_template": own}).json()
        assert chat["usage"]["prompt_tokens"] == len(http.post(
            "/tokenize", json={"prompt": "[Hi]", "add_special_tokens": False}
        ).json()["tokens"])  # fmt: skip
        assert http.get("/tokenizer_info").json()["chat_template"] == template
    refused = client.post("/v1/chat/completions", json=body | {"chat_template": own})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
