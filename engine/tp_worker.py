"""A tensor-parallel rank other than 0: load the shard, allocate the KV shard, replay steps.

The worker holds a ModelRunner like rank 0's, built from the same config (rank
0's, shared at join), so its KV cache, buffers and CUDA graphs have the same
shapes and its collectives come in the same order. Each step it receives rank
0's header and staged buffer (engine/step_channel.py) and runs the same path:
the same decode or prefill graph bucket, or the same eager forward, and
compute_logits as often as rank 0 does (the logits gather is a collective).
Its own logits and argmax are never read.

`serve_headless` is `python -m server --headless`: a node other than node 0,
which runs its ranks and no HTTP.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.lora import read_adapter
from engine.prompt_logprobs import SCORE_ROWS
from engine.step_channel import (
    DECODE_GRAPH,
    EAGER,
    LORA,
    PREFILL_GRAPH,
    STOP,
    VERIFY_GRAPH,
    ReceivedStep,
)
from engine.tp_group import Rendezvous, Workers, join

logger = logging.getLogger("pagoda.engine")


def worker_main(config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
    """A spawned rank's whole life; any failure exits non-zero (rank 0 watches)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s: %(message)s"
    )
    try:
        membership = join(config, rank, rendezvous.connect())
        follow_steps(build_runner(membership.config, membership))
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)
    # Rank 0 leaves as well: exit without tearing the group down. gloo's teardown
    # while the peers close their sockets can abort the process (std::terminate,
    # seen under load), and nothing here needs saving.
    logging.shutdown()
    os._exit(0)


def follow_steps(runner: ModelRunner) -> None:
    """Replay rank 0's steps as they are published, until it sends STOP."""
    while True:
        step = runner.channel.receive()
        if step.header.path == STOP:
            return
        if step.header.path == LORA:  # rank 0 has read and checked it
            runner.lora_slots.write(step.header.bucket, read_adapter(*step.adapter))
            continue
        replay(runner, step)


def build_runner(config: EngineConfig, membership) -> ModelRunner:
    from engine.models.demo import ensure_demo_model
    from engine.models.loader import load_config, load_for_engine

    model_dir = config.model or ensure_demo_model()
    hf_config = load_config(model_dir)
    model = load_for_engine(config, model_dir, hf_config, membership.tp)
    return ModelRunner(config, model, None, membership)


@torch.inference_mode()
def replay(runner: ModelRunner, step: ReceivedStep) -> None:
    """Run the forward rank 0 runs for this step (its staged buffer is in place)."""
    graphs, header, score_rows = runner.graphs, step.header, step.score_rows
    if header.path == DECODE_GRAPH:
        graphs.decode[header.bucket][0].replay()  # a worker's graphs differ only in copies out
    elif header.path == PREFILL_GRAPH:
        graphs.prefill[header.bucket][0].replay()
    elif header.path == VERIFY_GRAPH:
        graphs.verify[header.bucket].replay()
    elif header.path == EAGER:
        inp = runner.inputs(
            header.num_tokens,
            header.num_seqs,
            header.max_query_len,
            bool(header.is_decode),
            header.num_sampling,
            bool(header.per_token),
            bool(header.prompts_only),
            header.state_restores,
            header.state_saves,
        )
        if score_rows is None:
            runner.forward(inp, step.images)
            return
        # score_prompts' calls, in its order: the prompt rows a chunk at a time, then
        # the sampling rows.
        hidden = runner.hidden_states(inp, step.images)
        compute_logits = runner.model.compute_logits
        for i in range(0, len(score_rows), SCORE_ROWS):
            compute_logits(hidden[score_rows[i : i + SCORE_ROWS]])
        compute_logits(hidden[inp.logits_indices])
    else:
        raise ValueError(f"unknown step path {header.path}")


def serve_headless(config: EngineConfig) -> int:
    """Run this node's ranks until rank 0 stops them or one of them fails."""
    first = config.node_rank * config.ranks_per_node
    ranks = list(range(first, first + config.ranks_per_node))
    logger.info(
        "headless node %d of %d: ranks %s, rank 0 at %s:%d",
        config.node_rank,
        config.nnodes,
        ranks,
        config.master_addr,
        config.master_port,
    )
    rendezvous = Rendezvous(config.master_addr, config.master_port)
    workers = Workers(config, ranks, rendezvous, exit_ok=True)
    # SIGTERM or SIGINT: this node's ranks go too (rank 0 then fails its next step).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while workers.alive and not workers.failed.is_set() and not stop.is_set():
        stop.wait(0.5)
    if stop.is_set():
        workers.join(timeout=0.0)
        return 0
    workers.join(timeout=5.0)
    codes = [p.exitcode for p in workers.processes.values()]
    if any(codes):
        logger.error("headless node %d: ranks exited with codes %s", config.node_rank, codes)
        return 1
    return 0
