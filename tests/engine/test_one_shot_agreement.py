"""Whether the ranks set up the one-shot all-reduce (engine/tp_group.py), over gloo with
its creation and the GPUs' peer access faked: all of them or none; none when a rank's
process has set one up before (torch could not meet the new workers: each would wait out
a store timeout), or when a rank's GPU cannot map another's memory."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import torch
import torch.distributed as dist

import engine.one_shot
from engine import tp_group
from engine.config import EngineConfig
from tests.ports import free_port

# name: (set-ups each rank made before, whether each rank's GPU reaches the other's)
CASES = {
    "fresh": ((0, 0), (True, True)),
    "rank 0 made one before": ((1, 0), (True, True)),
    "both made one": ((1, 1), (True, True)),
    "rank 1's GPU reaches no peer": ((0, 0), (True, False)),
}


def _ranks_agree(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    made: list[int] = []

    def create(*args) -> SimpleNamespace:
        made.append(1)
        return SimpleNamespace(max_bytes=1 << 20)

    reaches: list[bool] = []
    tp_group.OneShotAllReduce.create = create  # this spawned process's only
    torch.cuda.can_device_access_peer = lambda device, peer: reaches[0] and peer == 1 - rank
    config = EngineConfig(tensor_parallel_size=2, custom_all_reduce=True)
    try:
        for name, (counts, reach) in CASES.items():
            engine.one_shot._rendezvous_made = counts[rank]
            reaches[:] = [reach[rank]]
            made.clear()
            got = tp_group._one_shot(config, torch.device("cuda", rank), dist.group.WORLD)
            out.put((name, rank, got is not None, len(made)))
    finally:
        dist.destroy_process_group()


def test_ranks_set_up_the_one_shot_all_reduce_all_or_none():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ranks_agree, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in range(2 * len(CASES)))
    for p in procs:
        p.join(10)
    assert got == sorted(
        [("fresh", r, True, 1) for r in (0, 1)]
        + [("rank 0 made one before", r, False, 0) for r in (0, 1)]
        + [("both made one", r, True, 1) for r in (0, 1)]
        + [("rank 1's GPU reaches no peer", r, False, 0) for r in (0, 1)]
    )
