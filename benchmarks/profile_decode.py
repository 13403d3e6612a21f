"""Where a decode step's device time goes, kernel by kernel (torch.profiler).

    python -m benchmarks.profile_decode gpt2 64     # model (a benchmarks.shapes name), batch
    python -m benchmarks.profile_decode llama3-8b 64 --context 768 --out FILE
    python -m benchmarks.profile_decode llama3-8b 1 --quantization fp8
    python -m benchmarks.profile_decode llama3-8b 1 --lora 1     # every request on an adapter

`batch` greedy requests of `--context` prompt tokens are admitted and decoding
(benchmarks.offline's start_decoding), a few steps warm up, then `--steps` engine
steps run under the profiler: the kernels inside CUDA graphs are recorded too.
Per kernel name: microseconds and calls per step, and the step's kernel time
against the device's span over those steps (the share of it the GPU was busy);
where the device sat idle, by the kernels on either side of each idle stretch.
On the CPU the rows are the host's ops instead, without a span.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.checkpoints import write_random_adapters
from benchmarks.decode_step import start_decoding
from benchmarks.provenance import provenance, write_result
from engine import LLM, SamplingParams

WARMUP = 16


def kernel_table(
    llm: LLM, batch: int, context: int, steps: int = 40, lora_name: str | None = None
) -> dict:
    """The table of `steps` full-batch decode steps: the requests may run to
    max_model_len, which must leave room for the admission, warm-up and steps."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    cuda = engine.config.torch_device.type == "cuda"
    max_tokens = engine.config.max_model_len - context
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        final_only=True,
        lora_name=lora_name,
    )
    start_decoding(engine, batch, context, max_tokens, params)
    for _ in range(WARMUP):
        engine.step()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    if len(engine.scheduler.running) != batch:
        raise ValueError(f"requests ended inside the table: raise max_model_len past {context}")
    rows = []
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append(
                {"name": event.key, "us_per_step": us / steps, "calls": event.count / steps}
            )
    rows.sort(key=lambda row: -row["us_per_step"])
    total = sum(row["us_per_step"] for row in rows)
    table = {"batch": batch, "context": context, "steps": steps, "us_per_step": total}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
        table["span_us_per_step"] = span / steps
        table["busy"] = total * steps / span
        table |= idle_gaps(kernels, steps)
    table["launches_per_step"] = sum(row["calls"] for row in rows)
    return table | {"rows": rows}


def idle_gaps(kernels: list, steps: int, top: int = 12) -> dict:
    """Where the device sat idle: each stretch with no kernel or copy running, per step,
    summed by the pair around it (`last one to end -> next to start`). Under PDL kernels
    overlap, so the kernel time can exceed the span; the idle time cannot."""
    kernels = sorted(kernels, key=lambda e: e.time_range.start)
    gaps: dict[str, list[float]] = {}
    last = kernels[0]
    for event in kernels[1:]:
        idle = event.time_range.start - last.time_range.end
        if idle > 0:
            gaps.setdefault(f"{short_name(last.name)} -> {short_name(event.name)}", []).append(idle)
        if event.time_range.end > last.time_range.end:
            last = event
    pairs = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "idle_us_per_step": sum(sum(v) for v in gaps.values()) / steps,
        "idle_gaps": [
            {"between": k, "us_per_step": sum(v) / steps, "per_step": len(v) / steps}
            for k, v in pairs
        ],
    }


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and signature."""
    return kernel.removeprefix("void ").split("(")[0].split("<")[0].strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", nargs="?", default="gpt2", help="a benchmarks.shapes name")
    p.add_argument("batch", nargs="?", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--quantization", default=None, choices=["fp8"])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="N random LoRA adapters; requests use the first",
    )
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=30, help="table rows printed")
    p.add_argument("--out", type=Path, default=None, help="the whole table as JSON here")
    args = p.parse_args(argv)
    dtype = "float16" if args.model == "gpt2" else "bfloat16"
    model_dir = checkpoint_dir(args.model, dtype)
    loras = write_random_adapters(model_dir, args.lora, args.lora_rank) if args.lora else None
    llm = LLM(
        model_dir,
        dtype=dtype,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch, 8),
        max_num_batched_tokens=4096,
        max_model_len=args.context + WARMUP + args.steps + 128,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        lora_modules=loras,
    )
    result = {
        **provenance("profile_decode", argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model,
        "dtype": dtype,
        "lora": {"adapters": args.lora, "rank": args.lora_rank} if args.lora else None,
        **kernel_table(llm, args.batch, args.context, args.steps, "lora0" if loras else None),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    for row in result["rows"][: args.rows]:
        print(f"{row['us_per_step']:9.1f} us {row['calls']:6.1f}x  {row['name'][:100]}")
    for gap in result.get("idle_gaps", [])[:5]:
        print(f"{gap['us_per_step']:9.1f} us idle {gap['per_step']:5.1f}x  {gap['between'][:100]}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
