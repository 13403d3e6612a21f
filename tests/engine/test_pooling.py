"""Embeddings (pooling requests) in one batch with generating requests: each pooling row
gets its own prompt's last hidden state, and the generating ones keep their tokens."""

from __future__ import annotations

import numpy as np
import torch

from engine import LLM, SamplingParams
from tests.reference import PROMPTS, hf_greedy


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


def test_mean_pooling_of_a_decoder_reads_whole_prompts(tiny_llama_dir):
    """--pooling-type MEAN on a decoder: each prompt runs whole (the budget grows to the
    longest), and a prompt embedded again is recomputed, not read from the prefix cache
    (whose blocks hold no hidden states); a generating request still decodes exactly."""
    from transformers import AutoModel

    llm = LLM(
        tiny_llama_dir, device="cpu", block_size=4, max_num_batched_tokens=8, pooling_type="MEAN"
    )
    assert llm.engine.config.max_num_batched_tokens == llm.engine.config.max_model_len
    prompts = [PROMPTS[5], PROMPTS[8], PROMPTS[5]]
    got = llm.embed(prompts[:2], use_tqdm=False) + llm.embed(prompts[2:], use_tqdm=False)
    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, vector in zip(prompts, got, strict=True):
        with torch.no_grad():
            states = model(torch.tensor([llm.tokenizer.encode(prompt)])).last_hidden_state[0]
        want = torch.nn.functional.normalize(states.mean(0), dim=-1).numpy()
        np.testing.assert_allclose(vector, want, atol=1e-5)
    ids = llm.tokenizer.encode(PROMPTS[5])
    out = llm.generate(
        [ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama_dir, ids, 8)
