"""Encoders through the server: a sentence-transformers BERT's /v1/embeddings (mean
pooling) and a BERT cross-encoder's /v1/score and /v1/rerank (its engine in a process
of its own), whose pairs carry token types, each equal to transformers; an encoder
generates nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from server.app import create_app
from server.config import ServerConfig
from tests.reference import PROMPTS
from tests.server.live_server import LiveServer, engine_config


def serve(model_dir: str, **server: object) -> LiveServer:
    server_config = ServerConfig(shutdown_timeout=5.0, **server)
    config = engine_config(model_dir, max_model_len=128, max_num_batched_tokens=64)
    return LiveServer(create_app(config, server_config), server_config).start()


@pytest.fixture(scope="module")
def embedder(tiny_encoder_dir) -> Iterator[tuple[LiveServer, str]]:
    model_dir = tiny_encoder_dir("bert_mean")
    live = serve(model_dir)
    yield live, model_dir
    live.stop()


@pytest.fixture(scope="module")
def cross_encoder(tiny_encoder_dir) -> Iterator[tuple[LiveServer, str]]:
    model_dir = tiny_encoder_dir("bert_cross_encoder")
    live = serve(model_dir, engine_process=True)  # token types checked in the API process too
    yield live, model_dir
    live.stop()


def hf_run(model_dir: str, first: str, second: str | None = None) -> torch.Tensor:
    """transformers' last hidden states (an embedder) or logits (a classifier) of one text
    or pair, token types as the tokenizer sets them."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(first, second, return_tensors="pt", return_token_type_ids=True)
    auto = AutoModel if second is None else AutoModelForSequenceClassification
    with torch.no_grad():
        out = auto.from_pretrained(model_dir, dtype=torch.float32).eval()(**enc)
    return out.last_hidden_state[0] if second is None else out.logits[0]


def test_encoder_embeddings_equal_transformers(embedder):
    live, model_dir = embedder
    texts = PROMPTS[:4]
    r = httpx.post(f"{live.base_url}/v1/embeddings", json={"input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    for text, data in zip(texts, r.json()["data"], strict=True):
        want = torch.nn.functional.normalize(hf_run(model_dir, text).mean(0), dim=-1)
        np.testing.assert_allclose(data["embedding"], want.numpy(), atol=1e-5)


def test_an_encoder_generates_nothing(embedder):
    live, _ = embedder
    r = httpx.post(
        f"{live.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"]


def test_cross_encoder_scores_pairs_with_token_types(cross_encoder):
    live, model_dir = cross_encoder
    query, documents = PROMPTS[1], PROMPTS[2:6]
    want = np.array([torch.sigmoid(hf_run(model_dir, query, d))[0].item() for d in documents])
    r = httpx.post(
        f"{live.base_url}/v1/score", json={"text_1": query, "text_2": documents}, timeout=60
    )
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    np.testing.assert_allclose(scores, want, atol=1e-5)
    r = httpx.post(
        f"{live.base_url}/v1/rerank", json={"query": query, "documents": documents}, timeout=60
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == np.argsort(-want, kind="stable").tolist()
    np.testing.assert_allclose(
        [x["relevance_score"] for x in results], np.sort(want)[::-1], atol=1e-5
    )


def test_token_types_are_checked(cross_encoder, embedder):
    """A token-id prompt may carry a type below type_vocab_size (2), no other."""
    live, _ = cross_encoder
    ok = [5, 6 | 1 << 30]
    for prompt, status in ((ok, 200), ([5, 6 | 2 << 30], 400), ([5, 10_000], 400)):
        r = httpx.post(f"{live.base_url}/classify", json={"input": [prompt]}, timeout=60)
        assert r.status_code == status, r.text
    live, _ = embedder  # it has token types too; a decoder has none (test_embeddings.py)
    r = httpx.post(f"{live.base_url}/v1/embeddings", json={"input": [ok]}, timeout=60)
    assert r.status_code == 200, r.text


def test_truncated_text_keeps_its_special_tokens(embedder):
    """truncate_prompt_tokens on a text cuts its start, keeping [CLS] and [SEP] (as
    vLLM's tokenizer, truncating on the left): the embedding is of those tokens."""
    from transformers import AutoModel, AutoTokenizer

    live, model_dir = embedder
    text = " ".join(PROMPTS)
    body = {"input": text, "truncate_prompt_tokens": 12}
    r = httpx.post(f"{live.base_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 12
    tok = AutoTokenizer.from_pretrained(model_dir, truncation_side="left")
    enc = tok(text, truncation=True, max_length=12, return_tensors="pt")
    assert (
        enc["input_ids"][0, 0] == tok.cls_token_id and enc["input_ids"][0, -1] == tok.sep_token_id
    )
    with torch.no_grad():
        states = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()(**enc)
    want = torch.nn.functional.normalize(states.last_hidden_state[0].mean(0), dim=-1)
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], want.numpy(), atol=1e-5)
