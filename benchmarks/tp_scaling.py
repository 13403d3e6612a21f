"""Tensor-parallel scaling on one multi-GPU host, with random bf16 weights at real shapes.

- Llama-3-8B's shape at TP 1/2/4/8: batch-1 decode ms/token, beside the time
  an all-reduce of one token's hidden state takes (inside a CUDA graph, in as
  many processes; NCCL's and the one-shot kernel's, engine/one_shot.py) times
  the all-reduces a decode step makes (two per layer), and the time rank 0's
  collectives took per token inside the engine's own steps (the profiler's
  collective kernel time over a short batch-1 run). --compare-all-reduce runs
  each TP size twice: as served by default and with --disable-custom-all-reduce.
- Llama-3-70B's shape at TP 4/8 (or 2, on GPUs that hold half of its ~141 GB):
  64 requests of 512 random prompt tokens and 512 output tokens (offline
  throughput), and batch-1 ms/token against the floor of one GPU reading its
  shard (weights and KV) at its copy bandwidth.

    python -m benchmarks.tp_scaling --out results/tp_scaling.json

TP sizes past the host's GPU count are skipped; a run that fails (a model that
does not fit before its layers are sharded) is recorded with its error. Each engine
runs in a process of its own: only a process's first tensor-parallel engine can set up
the one-shot all-reduce (engine/tp_group.py), and each run records whether it did.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.floors import DecodeStep, copy_bandwidth, decode_floor_ms, decode_vs_floor
from benchmarks.offline import run_pagoda
from benchmarks.provenance import provenance, write_result
from benchmarks.shapes import CONFIGS
from engine import LLM
from engine.tp_group import WORKER_ENV, Rendezvous, host_rendezvous

BATCH1_PROMPT, BATCH1_OUTPUT = 128, 256
THROUGHPUT_REQUESTS, THROUGHPUT_LEN = 64, 512


def _graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 50) -> float:
    """Microseconds per call of `fn`, `calls` of them captured in one CUDA graph (as the
    engine's decode graphs run collectives), median over the replays. Not
    benchmarks.kernels.graph_median_us: do_bench picks its replay count from each
    process's own timing, and every rank must replay the collectives equally often."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def _all_reduce_worker(rank: int, size: int, rendezvous: Rendezvous, hidden: int, out) -> None:
    import torch.distributed as dist

    from engine.one_shot import OneShotAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=rendezvous.connect(), rank=rank, world_size=size)
    one_shot = OneShotAllReduce.create(dist.group.WORLD, size, device)
    x = torch.ones(1, hidden, dtype=torch.bfloat16, device=device)
    times = {
        "nccl": _graph_us(lambda: dist.all_reduce(x)),
        "one_shot": _graph_us(lambda: one_shot(x)),
    }
    if rank == 0:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def all_reduce_us(size: int, hidden: int) -> dict[str, float]:
    """Microseconds per all-reduce of [1, hidden] bf16 over `size` GPUs inside a CUDA graph,
    by NCCL and by the one-shot kernel (engine/one_shot.py)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    _store, rendezvous = host_rendezvous("127.0.0.1", 0)  # held here; every rank connects
    mp.start_processes(
        _all_reduce_worker, args=(size, rendezvous, hidden, out), nprocs=size, start_method="spawn"
    )
    return out.get()


PROFILED_TOKENS = 32
COLLECTIVE_NAMES = ("allreduce", "all_reduce", "allgather", "all_gather")


def collective_share(llm: LLM, prompt: list[int], tokens: int = PROFILED_TOKENS) -> dict:
    """Rank 0's time in collectives per generated token, from the profiler, at batch 1:
    on CUDA the NCCL kernels' device time (inside the decode graphs too; a kernel
    that waits for a late peer counts its wait), on the CPU gloo's host time. One
    prefill and tokens - 1 decode steps; `step_us` is all device (or host) time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.engine.config.torch_device.type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        run_pagoda(llm, [prompt], [tokens], [])
        if cuda:
            torch.cuda.synchronize()
    collective_us = total_us = 0.0
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        total_us += us
        if any(name in event.key.lower() for name in COLLECTIVE_NAMES):
            collective_us += us
    return {
        "tokens": tokens,
        "collective_us_per_token": collective_us / tokens,
        "step_us": total_us / tokens,
        "measured_on": "device kernels" if cuda else "host ops",
    }


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 10000)) for _ in range(length)] for _ in range(n)]


def measure(
    model_dir: str, tp: int, bandwidth: float, throughput: bool, one_shot: bool = True
) -> dict:
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        tensor_parallel_size=tp,
        custom_all_reduce=one_shot,
        enable_prefix_caching=False,
        max_num_seqs=THROUGHPUT_REQUESTS if throughput else 8,
        max_num_batched_tokens=2048,
        max_model_len=2 * THROUGHPUT_LEN + 64,
    )
    try:
        result: dict = {}
        if tp > 1:
            result["one_shot_in_use"] = llm.engine.runner.tp.one_shot is not None
        vocab = llm.engine.vocab_size
        prompt = random_prompts(1, BATCH1_PROMPT, vocab, seed=1)
        run_pagoda(llm, prompt, [16], [])  # warm up
        steps: list[DecodeStep] = []
        one = run_pagoda(llm, prompt, [BATCH1_OUTPUT], steps)
        ms_per_token = 1e3 * one["decode_s"] / (BATCH1_OUTPUT - 1)
        floor = decode_floor_ms(llm, 1, BATCH1_PROMPT + BATCH1_OUTPUT / 2, bandwidth)
        result["batch1"] = {
            "ms_per_token": ms_per_token,
            "shard_floor_ms": floor,
            "vs_floor": ms_per_token / floor,
            "decode_vs_floor": decode_vs_floor(llm, steps, bandwidth),
        }
        if tp > 1:
            result["batch1"]["profiled"] = collective_share(llm, prompt[0])
        if throughput:
            prompts = random_prompts(THROUGHPUT_REQUESTS, THROUGHPUT_LEN, vocab)
            lens = [THROUGHPUT_LEN] * THROUGHPUT_REQUESTS
            run_pagoda(llm, prompts, [8] * THROUGHPUT_REQUESTS, [])  # warm up at this batch
            steps = []
            many = run_pagoda(llm, prompts, lens, steps)
            result["offline_64x512"] = {
                "tok_per_s": many["tok_per_s"],
                "total_s": many["total_s"],
                "decode_vs_floor": decode_vs_floor(llm, steps, bandwidth),
            }
        return result
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


LENGTHS = ("BATCH1_PROMPT", "BATCH1_OUTPUT", "PROFILED_TOKENS", "THROUGHPUT_LEN")
MEASURE_TIMEOUT_S = 1800


def measure_apart(
    model_dir: str, tp: int, bandwidth: float, throughput: bool, one_shot: bool
) -> dict:
    """`measure` in a fresh process (`--measure`), whose engine is its first, with this
    module's lengths; the result is the JSON line it prints last. A failure raises with
    the process's output."""
    spec = {"model_dir": model_dir, "tp": tp, "bandwidth": bandwidth}
    spec |= {"throughput": throughput, "one_shot": one_shot}
    spec["lengths"] = {name: globals()[name] for name in LENGTHS}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.tp_scaling", "--measure", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=MEASURE_TIMEOUT_S,  # a hung rank fails this run, and the next size runs
    )
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes-8b", default="1,2,4,8", help="TP sizes for the 8B shape")
    p.add_argument("--sizes-70b", default="4,8", help="TP sizes for the 70B shape ('' for none)")
    p.add_argument(
        "--compare-all-reduce",
        action="store_true",
        help="run each TP size > 1 twice: small all-reduces one-shot (the default), and all on NCCL",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # measure_apart's child: its spec
    args = p.parse_args(argv)
    for key, value in WORKER_ENV.items():  # NVLink multicast stays off here too
        os.environ.setdefault(key, value)
    if args.measure:
        spec = json.loads(args.measure)
        globals().update(spec.pop("lengths"))
        print(json.dumps(measure(**spec)), flush=True)
        return 0
    gpus = torch.cuda.device_count()

    def sizes(text: str) -> list[int]:
        return [n for n in (int(s) for s in text.split(",") if s) if n <= gpus]

    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    result: dict = {
        **provenance("tp_scaling", argv),
        "gpu": torch.cuda.get_device_name(),
        "gpus": gpus,
        "torch": torch.__version__,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "runs": [],
    }
    plan = [("llama3-8b", n, False) for n in sizes(args.sizes_8b)]
    plan += [("llama3-70b", n, True) for n in sizes(args.sizes_70b)]
    for name, tp, throughput in plan:
        ways = ["one-shot", "nccl"] if tp > 1 and args.compare_all_reduce else ["one-shot"]
        model_dir = checkpoint_dir(name, "bfloat16")
        config = CONFIGS[name]()
        per_call = all_reduce_us(tp, config.hidden_size) if tp > 1 else {}
        for way in ways:
            run: dict = {"model": name, "tp": tp}
            if tp > 1:
                run["all_reduce"] = way
                run["all_reduce_us"] = per_call  # each way, timed alone
                # Two per layer (attention out, MLP down); the logits' gather is left out.
                us = per_call["nccl" if way == "nccl" else "one_shot"]
                run["all_reduce_ms_per_step"] = 1e-3 * us * 2 * config.num_hidden_layers
            try:
                run |= measure_apart(model_dir, tp, bandwidth, throughput, one_shot=way != "nccl")
            except Exception as exc:  # recorded, and the next size runs
                run["error"] = f"{type(exc).__name__}: {exc}"
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
