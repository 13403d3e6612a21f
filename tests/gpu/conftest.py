"""Shared by the CUDA tests: their marks, and greedy fp32 generation on CUDA."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import hf_model

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class CountedGraph:
    """A captured graph whose replays append its bucket to `replays`."""

    def __init__(self, bucket: int, graph: torch.cuda.CUDAGraph, replays: list[int]) -> None:
        self.bucket, self.graph, self.replays = bucket, graph, replays

    def replay(self) -> None:
        self.replays.append(self.bucket)
        self.graph.replay()


def generate(model_dir: str, prompts: list[str], max_new: int, **config) -> list[list[int]]:
    """Token ids of `max_new` greedy tokens per prompt (EOS ignored), fp32 on CUDA."""
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16, **config)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# fp32 on CUDA rounds otherwise than on the CPU: where transformers' two best logits are
# this close, either token is the greedy one.
NEAR_TIE = 1e-4


def assert_greedy_matches(
    model_dir: str, prompt_ids: list[list[int]], got: list[list[int]], want: list[list[int]]
) -> None:
    """Each of `got` equals transformers' `want`, or parts from it at a near-tie (the two
    tokens' logits, given what came before, within NEAR_TIE); what follows is not compared."""
    assert len(got) == len(want)
    for ids, ours, theirs in zip(prompt_ids, got, want, strict=True):
        assert len(ours) == len(theirs)
        parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if parted is None:
            continue
        with torch.no_grad():
            logits = hf_model(model_dir)(torch.tensor([ids + theirs[:parted]])).logits[0, -1]
        gap = float(logits[theirs[parted]] - logits[ours[parted]])
        assert gap <= NEAR_TIE, (
            f"token {parted}: {ours[parted]} where transformers takes {theirs[parted]}, "
            f"{gap:.2e} ahead: {ours} != {theirs}"
        )
