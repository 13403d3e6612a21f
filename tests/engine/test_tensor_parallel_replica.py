"""The other tensor-parallel rank's side: until the layers shard, every rank holds the
whole model and only rank 0's logits count, so greedy output alone cannot show that
rank 1 replays rank 0's steps. Here the test runs rank 1 itself (a second "node")
and compares its state with rank 0's at the end.

(A module of its own: one process holds one process group at a time, and
test_tensor_parallel.py keeps its LLM for the whole module.)
"""

from __future__ import annotations

import multiprocessing

import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.tp_group import Rendezvous
from tests.engine.test_tensor_parallel import CONFIG, greedy
from tests.ports import free_port
from tests.reference import PROMPTS


def _recording_rank(config: EngineConfig, rendezvous: Rendezvous, path: str) -> None:
    """Rank 1 as a second "node": the worker's own loop, then its state saved to path."""
    from engine.tp_group import join, leave
    from engine.tp_worker import build_runner, follow_steps

    membership = join(config, 1, rendezvous.connect())
    runner = build_runner(membership.config, membership)
    follow_steps(runner)
    torch.save(replica_state(runner), path)
    leave()


def replica_state(runner) -> dict:
    """What every rank must agree on, sharded or not: the block table, the last step's
    metadata, and which KV slots hold something."""
    return {
        "table": runner.block_table.gpu.clone(),
        "staged": runner.staged.staged.clone(),
        "written": [
            (layer.k_cache.abs().sum(dim=(-2, -1)) != 0) for layer in runner.attn_layers
        ],  # [num_blocks, block_size] per layer
    }


def test_the_other_rank_replays_rank_0s_steps(tiny_llama_dir, tmp_path):
    """Through preemption, prefix hits, chunks, prompt scoring and sampling, rank 1 ends
    with rank 0's block table and metadata, and has written the same KV slots."""
    port = free_port()
    config = EngineConfig(
        model=tiny_llama_dir, tensor_parallel_size=2, nnodes=2, master_port=port, **CONFIG
    )
    path = tmp_path / "rank1.pt"
    rank1 = multiprocessing.get_context("spawn").Process(
        target=_recording_rank, args=(config, Rendezvous("127.0.0.1", port), str(path))
    )
    rank1.start()
    try:
        llm = LLM(tiny_llama_dir, tensor_parallel_size=2, nnodes=2, master_port=port, **CONFIG)
        shared = PROMPTS[5]
        llm.generate(PROMPTS[1:7] + [shared, shared + " one"], greedy(), use_tqdm=False)
        sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=3, prompt_logprobs=1)
        llm.generate(PROMPTS[3:5], sampled, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        mine = replica_state(llm.engine.runner)
        llm.shutdown()
        rank1.join(timeout=30)
        assert rank1.exitcode == 0
    finally:
        if rank1.is_alive():
            rank1.kill()
    theirs = torch.load(path)
    assert torch.equal(mine["table"], theirs["table"])
    assert torch.equal(mine["staged"], theirs["staged"])
    assert all(torch.equal(a, b) for a, b in zip(mine["written"], theirs["written"]))
    assert mine["written"][0].any()
