"""Tensor parallelism on two GPUs (NCCL): the same greedy tokens as one GPU and as
transformers, with CUDA graphs (decode and prefill, the collectives captured inside) and
without."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from tests.conftest import PROMPTS, hf_greedy
from tests.gpu.conftest import GPU

pytestmark = [
    *GPU,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MAX_NEW = 16


def generate(model_dir: str, prompts: list[str], **config) -> tuple[list[list[int]], dict]:
    """fp32, so that a sharded model's reductions cannot flip a near-tie."""
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16, **config)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], dict(llm.engine.runner.steps_by_path)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_two_gpus_give_one_gpus_tokens(tiny_model_dir, eager):
    # A 40-token budget chunks the longer prompts: steps mix prefill chunks and decodes.
    prompts = [p * 3 for p in PROMPTS]
    config = dict(max_num_batched_tokens=40, enforce_eager=eager)
    want, _ = generate(tiny_model_dir, prompts, **config)
    got, paths = generate(tiny_model_dir, prompts, tensor_parallel_size=2, **config)
    assert got == want
    tokenizer = load_tokenizer(tiny_model_dir)
    assert got == [hf_greedy(tiny_model_dir, tokenizer.encode(p), MAX_NEW) for p in prompts]
    if eager:
        assert paths["graph"] == paths["prefill graph"] == 0
    else:
        assert paths["graph"] > 0 and paths["prefill graph"] > 0


def test_shared_prefixes_and_few_kv_blocks_on_two_gpus(tiny_llama_dir):
    shared = PROMPTS[5] * 2
    prompts = [shared + s for s in ("", " one", " two", " three")] + PROMPTS
    config = dict(block_size=16, num_kv_blocks=24, max_model_len=128)
    want, _ = generate(tiny_llama_dir, prompts, **config)
    got, _ = generate(tiny_llama_dir, prompts, tensor_parallel_size=2, **config)
    assert got == want
