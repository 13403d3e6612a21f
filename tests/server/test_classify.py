"""Sequence classifiers (*ForSequenceClassification checkpoints): /classify equals
transformers' logits, softmaxed (sigmoid with one label); with one label, /v1/score and
/v1/rerank score text pairs (a cross-encoder); such a model serves nothing else."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from engine import LLM
from server.app import create_app
from server.config import ServerConfig
from tests.reference import PROMPTS
from tests.server.live_server import LiveServer, engine_config

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def build_classifier(base_dir: str, path, num_labels: int) -> str:
    """A tiny causal checkpoint's body under a random score head, saved by transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(1)
    labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    model = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=num_labels, **(labels if num_labels == 3 else {})
    )
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(path)
    return str(path)


def hf_logits(model_dir: str, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def qwen_classifier(tmp_path_factory, tiny_qwen2_dir) -> str:
    return build_classifier(tiny_qwen2_dir, tmp_path_factory.mktemp("qwen2-cls"), 3)


@pytest.fixture(scope="module")
def classify_server(qwen_classifier) -> Iterator[LiveServer]:
    server_config = ServerConfig(shutdown_timeout=5.0)
    live = LiveServer(create_app(engine_config(qwen_classifier), server_config), server_config)
    yield live.start()
    live.stop()


def test_classify_equals_transformers(classify_server, qwen_classifier, tokenizer):
    prompts = PROMPTS[:3]
    r = httpx.post(f"{classify_server.base_url}/classify", json={"input": prompts}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for prompt, data in zip(prompts, body["data"], strict=True):
        logits = hf_logits(qwen_classifier, tokenizer.encode(prompt))
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        assert data["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert data["label"] == LABELS[int(probs.argmax())] and data["num_classes"] == 3
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    assert len({tuple(d["probs"]) for d in body["data"]}) == 3  # the prompts tell apart


def test_a_classifier_serves_nothing_else(classify_server, live):
    url = classify_server.base_url
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/embeddings", {"input": "Hi"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),  # three labels: no cross-encoder
    ):
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and "/classify only" in r.json()["error"]["message"]
    r = httpx.post(f"{live.base_url}/classify", json={"input": "Hi"}, timeout=60)
    assert r.status_code == 400 and "no classification head" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, tiny_qwen2_dir) -> Iterator[tuple[str, LiveServer]]:
    model_dir = build_classifier(tiny_qwen2_dir, tmp_path_factory.mktemp("qwen2-ce"), 1)
    server_config = ServerConfig(shutdown_timeout=5.0)
    live = LiveServer(create_app(engine_config(model_dir), server_config), server_config)
    yield model_dir, live.start()
    live.stop()


def test_a_one_label_classifier_scores_and_reranks_pairs(cross_encoder, tokenizer):
    """Each pair as the tokenizer encodes a text pair, its logit's sigmoid: score and
    rerank equal transformers' over those ids."""
    model_dir, server = cross_encoder
    query, documents = "Where is Paris?", ["Paris is in France.", "Cats sleep.", "Hello"]

    def want(a: str, b: str) -> float:
        ids = tokenizer(a, b)["input_ids"]
        return float(1 / (1 + np.exp(-hf_logits(model_dir, ids)[0])))

    wants = [want(query, d) for d in documents]
    assert len(set(wants)) == 3
    body = {"text_1": query, "text_2": documents}
    r = httpx.post(f"{server.base_url}/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(wants, abs=1e-5)
    pairwise = {"text_1": documents, "text_2": [query] * 3}
    r = httpx.post(f"{server.base_url}/v1/score", json=pairwise, timeout=60)
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        [want(d, query) for d in documents], abs=1e-5
    )
    # Truncated, the longer text of a pair loses its tokens first (as transformers cuts).
    cut = {"text_1": query, "text_2": documents[:1], "truncate_prompt_tokens": 6}
    r = httpx.post(f"{server.base_url}/v1/score", json=cut, timeout=60)
    ids = tokenizer(query, documents[0], truncation="longest_first", max_length=6)["input_ids"]
    assert len(ids) == 6 and ids[:2] == tokenizer(query)["input_ids"][:2]
    sigmoid = 1 / (1 + np.exp(-hf_logits(model_dir, ids)[0]))
    assert r.json()["data"][0]["score"] == pytest.approx(sigmoid, abs=1e-5)
    body = {"query": query, "documents": documents, "top_n": 2}
    results = httpx.post(f"{server.base_url}/v1/rerank", json=body, timeout=60).json()["results"]
    best = sorted(range(3), key=lambda i: -wants[i])[:2]
    assert [x["index"] for x in results] == best
    assert [x["relevance_score"] for x in results] == pytest.approx([wants[i] for i in best])


def test_one_label_is_a_sigmoid_score(tmp_path, tiny_llama_dir, tokenizer):
    """An untied Llama body under one label's head (a reward model's shape), offline:
    classify() gives the sigmoid of transformers' logit; embed() is refused."""
    model_dir = build_classifier(tiny_llama_dir, tmp_path / "llama-reward", 1)
    llm = LLM(model_dir, device="cpu")
    assert not llm.engine.can_generate and llm.engine.labels == ["LABEL_0"]
    prompts = [tokenizer.encode(p) for p in PROMPTS[1:3]]
    for (prob,), ids in zip(llm.classify(prompts, use_tqdm=False), prompts, strict=True):
        assert prob == pytest.approx(1 / (1 + np.exp(-hf_logits(model_dir, ids)[0])), abs=1e-5)
    with pytest.raises(ValueError, match="use classify"):
        llm.embed(prompts, use_tqdm=False)
