"""The one-shot all-reduce over peer memory (engine/one_shot.py) on two GPUs: the same
bits as NCCL's sum, eagerly and replayed from a CUDA graph; what it does not take goes to
NCCL; and a rank that never arrives does not leave the other's kernel waiting forever
once it is unblocked."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed import TensorParallel
from engine.one_shot import OneShotAllReduce, unblock_until_drained
from tests.gpu.on_cuda import GPU
from tests.ports import free_port

pytestmark = [
    *GPU,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _join(rank: int, port: int) -> TensorParallel:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    one_shot = OneShotAllReduce.create(dist.group.WORLD, 2, device)
    return TensorParallel(rank, 2, dist.group.WORLD, one_shot)


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def _sums(rank: int, port: int) -> None:
    tp = _join(rank, port)
    try:
        gen = torch.Generator(device="cuda").manual_seed(rank)
        largest = tp.one_shot.max_bytes // 2  # bf16 elements
        for dtype in (torch.bfloat16, torch.float32):
            for shape in ((1, 4096), (64, 896), (largest * 2 // dtype.itemsize,)):
                x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
                before = x.clone()
                got = tp.all_reduce(x)
                assert got is not x and torch.equal(x, before)  # a new tensor; x untouched
                assert torch.equal(got, _nccl_sum(before)), (dtype, shape)
        for x in (  # not the kernel's: NCCL sums them in place
            torch.randn(4, 64, generator=gen, device="cuda").half(),
            torch.randn(largest + 8, generator=gen, device="cuda").bfloat16(),
        ):
            want = _nccl_sum(x)
            assert tp.all_reduce(x) is x and torch.equal(x, want)
        # Captured in a graph, replayed with new inputs.
        x = torch.zeros(8, 4096, dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tp.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tp.all_reduce(tp.all_reduce(x) * 0.5)
        for _ in range(3):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
            graph.replay()
            assert torch.equal(out, _nccl_sum(_nccl_sum(x) * 0.5))
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_one_shot_sums_equal_nccls_eagerly_and_in_graphs():
    mp.spawn(_sums, args=(free_port(),), nprocs=2)


def _stranded(rank: int, port: int, queue) -> None:
    """Rank 1 joins and never sums; rank 0 sums without it, and a thread unblocks it."""
    tp = _join(rank, port)
    if rank == 1:
        time.sleep(120)  # alive, never arriving (the test kills it)
        return
    try:
        x = torch.ones(4, 4096, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            x = tp.all_reduce(x)
        stop = torch.cuda.Event()
        stop.record()
        time.sleep(1.0)
        waiting = not stop.query()
        start = time.monotonic()
        thread = unblock_until_drained(timeout_s=30.0)
        stop.synchronize()
        unblocked_s = time.monotonic() - start
        thread.join(5.0)  # it stops by itself once the work queued before it has ended
        queue.put((waiting, unblocked_s, thread.is_alive()))
    except BaseException as exc:
        queue.put(repr(exc))


def test_unblocking_finishes_kernels_stranded_by_an_absent_rank():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_stranded, args=(r, port, queue), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=35)
        assert isinstance(result, tuple), result
        waiting, unblocked_s, still_unblocking = result
        assert waiting  # it would have hung: rank 1 never arrived
        assert unblocked_s < 5.0
        assert not still_unblocking
    finally:
        for p in procs:
            p.kill()
