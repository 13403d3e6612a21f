"""POST /v1/embeddings through the OpenAI SDK: each input's last-token hidden state,
normalized, as transformers computes it (fp32, CPU), in floats or base64, cut to
`dimensions`; with a LoRA adapter's name, the adapter's; bad input is a 400."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch

from engine import LLM
from engine.models.loader import load_tokenizer
from server.app import create_app
from server.config import ServerConfig
from tests.server.live_server import LiveServer, engine_config


def reference(model_dir: str, ids: list[int], adapter: str | None = None) -> np.ndarray:
    from transformers import AutoModel, AutoModelForCausalLM

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:  # its modules adapted in place: then the causal LM's body
        from peft import PeftModel

        causal = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(causal, adapter).get_base_model().model.eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1).numpy()


@pytest.fixture
def lora_oai(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="x", max_retries=0)


def test_embeddings_match_transformers_in_floats_and_base64(oai, live, tiny_gpt2_dir, model_name):
    texts = ["Hello there", "The quick brown fox jumps over the lazy dog."]
    ids = [load_tokenizer(tiny_gpt2_dir).encode(t) for t in texts]
    generated = live.metric("pagoda:generation_tokens_total", 0.0)
    # The SDK asks for base64 unless told otherwise, and decodes it.
    got = oai.embeddings.create(model=model_name, input=texts)
    floats = oai.embeddings.create(model=model_name, input=texts, encoding_format="float")
    assert got.model == model_name and got.usage.prompt_tokens == sum(map(len, ids))
    for data, again, prompt in zip(got.data, floats.data, ids, strict=True):
        want = reference(tiny_gpt2_dir, prompt)
        np.testing.assert_allclose(data.embedding, want, atol=1e-5)
        np.testing.assert_allclose(again.embedding, want, atol=1e-5)
    assert [d.index for d in got.data] == [0, 1]
    # Token ids in, and the first 8 values normalized again.
    cut = oai.embeddings.create(model=model_name, input=ids[1], dimensions=8).data[0].embedding
    want = reference(tiny_gpt2_dir, ids[1])[:8]
    np.testing.assert_allclose(cut, want / np.linalg.norm(want), atol=1e-5)
    # The token each embedding request samples is dropped: no generated tokens counted.
    assert live.metric("pagoda:generation_tokens_total", 0.0) == generated
    # So an input may fill the context, as in vLLM; one token more is a 400.
    limit = oai.models.list().data[0].max_model_len
    full = [ids[1][i % len(ids[1])] for i in range(limit)]
    got = oai.embeddings.create(model=model_name, input=[full], encoding_format="float")
    np.testing.assert_allclose(got.data[0].embedding, reference(tiny_gpt2_dir, full), atol=1e-5)
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=model_name, input=[full + full[:1]])


def test_the_offline_embed_matches(tiny_llama_dir):
    llm = LLM(
        tiny_llama_dir, device="cpu", block_size=4, max_num_batched_tokens=16, max_model_len=40
    )
    texts = ["a short one", "and a longer prompt, chunked over several steps of 16"]
    for text, got in zip(texts, llm.embed(texts, use_tqdm=False), strict=True):
        want = reference(tiny_llama_dir, llm.tokenizer.encode(text))
        np.testing.assert_allclose(got, want, atol=1e-5)
    # A prompt may fill the context: the token an embedding samples is never computed.
    full = list(range(100, 140))
    got = llm.embed([full], use_tqdm=False)[0]
    np.testing.assert_allclose(got, reference(tiny_llama_dir, full), atol=1e-5)


def test_an_adapters_name_embeds_with_it(lora_oai, tiny_llama_dir, tiny_lora_adapters):
    ids = load_tokenizer(tiny_llama_dir).encode("Once upon a time")
    got = lora_oai.embeddings.create(model="all", input=[ids]).data[0].embedding
    np.testing.assert_allclose(
        got, reference(tiny_llama_dir, ids, tiny_lora_adapters["all"]), atol=1e-5
    )


def test_chat_messages_embed_as_their_rendered_prompt(live, tiny_gpt2_dir):
    """vLLM's chat form: the chat template's prompt (no generation prompt unless asked)
    is what embeds."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a tiny model?"},
    ]
    tokenizer = load_tokenizer(tiny_gpt2_dir)
    rendered = []
    for add in (False, True):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        rendered.append(ids)
        body = {"messages": messages} | ({"add_generation_prompt": True} if add else {})
        r = httpx.post(f"{live.base_url}/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["usage"]["prompt_tokens"] == len(ids) and len(got["data"]) == 1
        np.testing.assert_allclose(
            got["data"][0]["embedding"], reference(tiny_gpt2_dir, ids), atol=1e-5
        )
    assert rendered[0] != rendered[1]  # the generation prompt is there only when asked


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": None}, "input"),  # neither input nor messages
        ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "input"),
        ({"messages": []}, "messages"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 10_000}, "dimensions"),
        ({"input": [[1] * 300]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_a_400(live, body, param):
    r = httpx.post(f"{live.base_url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory, tiny_family_dir, tokenizer) -> str:
    """A Qwen3 saved as the bare model, its head untied: as Qwen3-Embedding-8B is."""
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_pretrained(tiny_family_dir("qwen3"), dtype=torch.float32)
    causal.model.config.tie_word_embeddings = False
    path = tmp_path_factory.mktemp("bare-qwen3")
    causal.model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_bare_model_embeds_and_generates_nothing(bare_model_dir):
    llm = LLM(bare_model_dir, device="cpu")
    ids = llm.tokenizer.encode("an embedding model's input")
    np.testing.assert_allclose(
        llm.embed([ids], use_tqdm=False)[0], reference(bare_model_dir, ids), atol=1e-5
    )
    with pytest.raises(ValueError, match="no LM head"):
        llm.generate("hi", use_tqdm=False)

    config = ServerConfig(shutdown_timeout=5.0)
    live = LiveServer(create_app(engine_config(bare_model_dir), config), config).start()
    try:
        r = httpx.post(f"{live.base_url}/v1/embeddings", json={"input": [ids]}, timeout=30)
        np.testing.assert_allclose(
            r.json()["data"][0]["embedding"], reference(bare_model_dir, ids), atol=1e-5
        )
        r = httpx.post(f"{live.base_url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"]
    finally:
        live.stop()


def test_score_and_rerank_are_the_embeddings_cosine(client, tiny_gpt2_dir):
    tokenizer = load_tokenizer(tiny_gpt2_dir)
    query, documents = "a query", ["the first document", "another one", "a query"]
    vectors = [reference(tiny_gpt2_dir, tokenizer.encode(t)) for t in [query, *documents]]
    cosines = [float(vectors[0] @ v) for v in vectors[1:]]

    score = client.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in score["data"]], cosines, atol=1e-5)
    pairwise = client.post("/score", json={"text_1": documents[:2], "text_2": documents[1:]})
    want = [float(vectors[1] @ vectors[2]), float(vectors[2] @ vectors[3])]
    np.testing.assert_allclose([d["score"] for d in pairwise.json()["data"]], want, atol=1e-5)

    rerank = client.post("/v1/rerank", json={"query": query, "documents": documents, "top_n": 2})
    results = rerank.json()["results"]
    order = sorted(range(3), key=lambda i: -cosines[i])[:2]
    assert [r["index"] for r in results] == order and order[0] == 2  # the query itself first
    assert [r["document"]["text"] for r in results] == [documents[i] for i in order]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], [cosines[i] for i in order], atol=1e-5
    )
    assert rerank.json()["usage"]["total_tokens"] == sum(
        len(tokenizer.encode(t)) for t in [query, *documents]
    )
    bad = client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
    bad = client.post("/v2/rerank", json={"query": "q", "documents": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
