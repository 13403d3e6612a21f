"""Shared by the CUDA tests: their marks, and greedy fp32 generation on CUDA."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

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
