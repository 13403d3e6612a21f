"""Structured outputs on CUDA: the mask applies to the decode graphs' logits (graphs stay
on), constrained greedy output is the same with graphs and without, and equals
transformers masked by the same matcher."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from engine.structured.spec import GrammarSpec
from tests.engine.test_structured import REGEX, SCHEMA, Reference, masked_greedy
from tests.engine.test_structured_batches import check_padding_masks
from tests.gpu.on_cuda import GPU

pytestmark = GPU

PROMPTS = ["Hello", "The quick brown fox", "1 2 3 4 5", "def forward(self, x):"]


def llm(model_dir: str, **config) -> LLM:
    return LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=64, **config)


def test_sampled_outputs_validate_with_graphs_on(tiny_gpt2_dir):
    engine_llm = llm(tiny_gpt2_dir)
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=i, grammar=spec) for i in range(64)
    ]
    outs = engine_llm.generate((PROMPTS * 16)[:64], params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert engine_llm.engine.runner.steps_by_path["graph"] > 0


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", REGEX)])
def test_greedy_with_graphs_equals_eager_and_masked_transformers(tiny_model_dir, spec):
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=spec)
    graphs_llm = llm(tiny_model_dir)
    graphs = graphs_llm.generate(PROMPTS, params, use_tqdm=False)
    # The masked argmax was replayed from its own graphs after its first steps.
    assert graphs_llm.engine.grammars.masks.argmax_graphs
    eager = llm(tiny_model_dir, enforce_eager=True).generate(PROMPTS, params, use_tqdm=False)
    ref = Reference.load(tiny_model_dir)
    for prompt, a, b in zip(PROMPTS, graphs, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].token_ids == masked_greedy(ref, ref.tokenizer.encode(prompt), spec, 60)


def test_mixed_batch_matches_alone_on_cuda(tiny_gpt2_dir):
    engine_llm = llm(tiny_gpt2_dir)
    specs = [None, GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", REGEX), None] * 4
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=s)
        for i, s in enumerate(specs)
    ]
    prompts = (PROMPTS * 4)[: len(specs)]
    together = [o.outputs[0].token_ids for o in engine_llm.generate(prompts, params)]
    alone = [
        engine_llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params)
    ]
    assert together == alone


def test_padding_ids_are_masked_in_grammar_rows_only_on_cuda(tiny_gpt2_dir):
    """The per-slot host rows reach the device through a strided copy and a gather."""
    check_padding_masks(load_tokenizer(tiny_gpt2_dir), "cuda", greedy=True)


def test_the_stream_waits_for_the_device_flag():
    """What is queued after wait(n) runs only once a host thread set n: a copy queued
    behind it reads what the host wrote just before setting the flag."""
    import threading
    import time

    import torch

    from engine.structured.device_flag import DeviceFlag

    device = torch.device("cuda")
    flag = DeviceFlag.create(device)
    assert flag is not None
    source = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    target = torch.zeros(1, dtype=torch.int32, device=device)
    flag.wait(1)
    target.copy_(source, non_blocking=True)

    def later():
        time.sleep(0.2)
        source.fill_(7)
        flag.set(1)

    thread = threading.Thread(target=later)
    start = time.perf_counter()
    thread.start()
    torch.cuda.synchronize()
    thread.join()
    assert time.perf_counter() - start >= 0.2
    assert target.item() == 7
