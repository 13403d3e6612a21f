"""Per-kernel GPU time of one decode step, on random weights at a real size.

    python -m benchmarks.profile_decode gpt2 64     # model (gpt2 | qwen2-0.5b | llama3-8b), batch
    python -m benchmarks.profile_decode llama3-8b 1 --quantization fp8

Brings `batch` sequences to a context of 256 tokens, times the decode CUDA graph
replayed back to back, then prints torch.profiler's kernel table for the same
forward run eagerly (the graph's kernels, one by one). Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.checkpoints import build_checkpoint
from benchmarks.offline import start_decoding
from engine import LLM

CONTEXT = 256


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="gpt2")
    p.add_argument("batch", nargs="?", type=int, default=64)
    p.add_argument("--quantization", default=None, choices=["fp8"])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--rows", type=int, default=20, help="kernel table rows")
    args = p.parse_args(argv)
    name, batch = args.model, args.batch
    dtype = torch.float16 if name == "gpt2" else torch.bfloat16
    model_dir = build_checkpoint(name, Path(tempfile.gettempdir()) / f"pagoda-bench-{name}", dtype)
    llm = LLM(
        model_dir,
        dtype=str(dtype).removeprefix("torch."),
        enable_prefix_caching=False,
        max_model_len=1024,
        max_num_seqs=max(batch, 8),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine, runner = llm.engine, llm.engine.runner
    start_decoding(engine, batch, CONTEXT, max_tokens=600)

    batch_out = engine.scheduler.schedule()
    assert batch_out.is_decode_only and batch_out.num_seqs == batch
    runner.fill(batch_out)
    bucket = runner.graphs.decode_bucket[batch]
    runner.graphs.pad_decode(batch, bucket)
    inp = runner.send(bucket, bucket, 1, True)
    graph = runner.graphs.decode[bucket][runner.parity]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    print(f"{name} B={batch}: graph replay {1e6 * (time.perf_counter() - start) / 200:.1f} us")

    with torch.inference_mode():
        for _ in range(5):
            runner.forward(inp)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                runner.forward(inp)
            torch.cuda.synchronize()
    print("20 forwards:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
