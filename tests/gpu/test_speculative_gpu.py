"""Speculative decoding on CUDA: greedy tokens equal transformers' with graphs on and off
(verify steps replay prefill graphs with a logits row per draft), and sampled rows run."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from tests.gpu.on_cuda import GPU, CountedGraph, generate
from tests.reference import PROMPTS, hf_greedy

pytestmark = GPU

MAX_NEW = 64
SPEC = dict(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.mark.parametrize("eager", [False, True])
def test_greedy_speculation_matches_transformers(tiny_model_dir, eager):
    tokenizer = load_tokenizer(tiny_model_dir)
    want = [hf_greedy(tiny_model_dir, tokenizer.encode(p), MAX_NEW) for p in PROMPTS]
    assert generate(tiny_model_dir, PROMPTS, MAX_NEW, enforce_eager=eager, **SPEC) == want


def test_verify_steps_replay_their_graphs_and_sample(tiny_llama_dir):
    """Verify steps of up to max_num_seqs tokens replay verify graphs (every token a
    decode row); larger ones run eagerly. Greedy and random rows both run."""
    llm = LLM(tiny_llama_dir, device="cuda", max_num_seqs=8, **SPEC)
    graphs = llm.engine.runner.graphs
    assert sorted(graphs.verify) == [1, 2, 4, 8]
    replays: list[int] = []
    graphs.verify = {b: CountedGraph(b, g, replays) for b, g in graphs.verify.items()}
    params = [
        SamplingParams(max_tokens=MAX_NEW, temperature=t, top_p=0.9, ignore_eos=True)
        for t in (0.0, 0.8)
    ]
    eager_before = llm.engine.runner.steps_by_path["eager"]
    outs = llm.generate(PROMPTS[:6], params * 3, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert replays  # the batch's tail: few rows left
    assert llm.engine.runner.steps_by_path["eager"] > eager_before  # six rows' drafts
    tokenizer = load_tokenizer(tiny_llama_dir)
    want = hf_greedy(tiny_llama_dir, tokenizer.encode(PROMPTS[0]), MAX_NEW)
    one = LLM(tiny_llama_dir, device="cuda", dtype="float32", max_num_seqs=8, **SPEC)
    got = one.generate(PROMPTS[0], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
