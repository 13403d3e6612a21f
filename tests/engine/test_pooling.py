"""Embeddings (pooling requests) in one batch with generating requests: each pooling row
gets its own prompt's last hidden state, and the generating ones keep their tokens."""

from __future__ import annotations

import numpy as np
import torch

from engine import LLM, SamplingParams
from tests.conftest import PROMPTS, hf_greedy


def test_pooling_rows_among_generating_ones(tiny_llama_dir):
    from transformers import AutoModel

    llm = LLM(tiny_llama_dir, device="cpu", block_size=4, max_num_batched_tokens=32)
    engine = llm.engine
    generating = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(generating):
        engine.add_request(f"gen{i}", ids, greedy)
    engine.step()  # they are prefilling (or decoding) when the embeddings arrive
    pooling = SamplingParams(max_tokens=1, temperature=0.0, pooling=True, detokenize=False)
    embedded = [llm.tokenizer.encode(p) for p in PROMPTS[3:7]]
    for i, ids in enumerate(embedded):
        engine.add_request(f"emb{i}", ids, pooling)
    tokens: dict[str, list[int]] = {}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for i, ids in enumerate(embedded):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=-1).numpy()
        np.testing.assert_allclose(finished[f"emb{i}"].embedding, want, atol=1e-5)
    for i, ids in enumerate(generating):
        assert finished[f"gen{i}"].embedding is None
        assert tokens[f"gen{i}"] == hf_greedy(tiny_llama_dir, ids, 12)
