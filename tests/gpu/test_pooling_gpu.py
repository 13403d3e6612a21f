"""Embeddings on CUDA: pooling rows among decoding ones, with the decode graphs on (a
step that pools runs eagerly, the others still replay), fp32 against transformers."""

from __future__ import annotations

import numpy as np
import torch

from engine import LLM, SamplingParams
from tests.gpu.on_cuda import GPU
from tests.reference import PROMPTS

pytestmark = GPU


def test_embeddings_beside_decoding_requests(tiny_llama_dir) -> None:
    from transformers import AutoModel

    llm = LLM(tiny_llama_dir, device="cuda", dtype="float32", max_num_seqs=16)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:4]):  # decoding while the embeddings come in
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        engine.add_request(f"gen{i}", llm.tokenizer.encode(prompt), params)
    for _ in range(4):
        engine.step()
    pooling = SamplingParams(max_tokens=1, temperature=0.0, pooling=True, detokenize=False)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[4:8]]
    for i, prompt in enumerate(ids):
        engine.add_request(f"emb{i}", prompt, pooling)
    embeddings = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id.startswith("emb"):
                embeddings[out.request_id] = out.embedding
    assert engine.runner.steps_by_path["graph"] > 0
    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for i, prompt in enumerate(ids):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=-1).numpy()
        np.testing.assert_allclose(embeddings[f"emb{i}"], want, atol=1e-4)


def test_a_classifier_on_cuda_equals_transformers(tmp_path, tiny_qwen2_dir) -> None:
    """A Qwen2 body under a three-label head (tied embeddings), through the pooling step
    on CUDA, batched, fp32: its probabilities are transformers' logits' softmax."""
    from tests.server.test_classify import build_classifier, hf_logits

    model_dir = build_classifier(tiny_qwen2_dir, tmp_path / "cls", 3)
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:6]]
    for got, prompt in zip(llm.classify(ids, use_tqdm=False), ids, strict=True):
        logits = hf_logits(model_dir, prompt)
        want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_encoders_on_cuda_equal_transformers(tiny_encoder_dir) -> None:
    """BERT (mean pooling), ModernBERT and an XLM-RoBERTa reranker through the
    bidirectional Triton prefill kernel, prompts of several lengths in one step, fp32."""
    from tests.engine.test_encoders import TEXTS, hf_states

    model_dir = tiny_encoder_dir("bert_mean")
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16)
    for vector, (_, states) in zip(llm.embed(TEXTS, use_tqdm=False), hf_states(model_dir, TEXTS)):
        want = torch.nn.functional.normalize(states.mean(0), dim=-1).numpy()
        np.testing.assert_allclose(vector, want, atol=1e-4)
    model_dir = tiny_encoder_dir("modernbert")  # a local layer: the windowed kernel both ways
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16)
    for vector, (_, states) in zip(llm.embed(TEXTS, use_tqdm=False), hf_states(model_dir, TEXTS)):
        want = torch.nn.functional.normalize(states[0], dim=-1).numpy()
        np.testing.assert_allclose(vector, want, atol=1e-4)
    model_dir = tiny_encoder_dir("xlm_roberta_reranker")
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16)
    logits = torch.stack([s for _, s in hf_states(model_dir, TEXTS)])
    np.testing.assert_allclose(
        llm.classify(TEXTS, use_tqdm=False), torch.sigmoid(logits).numpy(), atol=1e-5
    )
