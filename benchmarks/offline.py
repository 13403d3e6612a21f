"""Offline throughput: Pagoda's engine vs transformers generate, same GPU, same run.

    python -m benchmarks.offline --model gpt2 --num-requests 64 --output-len 512 --compare-hf
    python -m benchmarks.offline --model qwen2-0.5b --workload nano-vllm
    python -m benchmarks.offline --model qwen3-30b-a3b --input-len 512 --output-len 512
    python -m benchmarks.offline --model llama3-8b --num-requests 1 --input-len 128 \
        --compare-hf-compile
    python -m benchmarks.offline --model llama3-8b --num-requests 1 --input-len 8192 \
        --output-len 1 --max-num-batched-tokens 2048 --compare-hf   # one long prompt's TTFT

The seeds' workload: N requests x M new tokens, prompt "Hello", EOS ignored,
prefix cache off (an MoE model's batch needs --input-len: random prompts). The
nano-vllm workload: 256 requests, input and output lengths uniform in [100, 1024],
random prompt tokens, seed 0.

Every run reports its decode steps against their bandwidth floors (`decode_vs_floor`):
each decode-only step's time over the bytes it must read (the weights it uses, its
batch's KV) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import model_dir as checkpoint_dir
from benchmarks.checkpoints import write_random_adapters
from benchmarks.decode_step import profile_decode_step
from benchmarks.floors import DecodeStep, copy_bandwidth, decode_floor_ms, decode_vs_floor
from benchmarks.provenance import package_version, provenance, write_result
from engine import LLM, SamplingParams
from engine.config import offline_budget


def workload(args, tokenizer) -> tuple[list[list[int]], list[int]]:
    if args.workload == "nano-vllm":
        rng = random.Random(0)
        vocab = min(len(tokenizer), 10000)
        lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(args.num_requests)]
        prompts = [[rng.randrange(vocab) for _ in range(i)] for i, _ in lens]
        return prompts, [o for _, o in lens]
    if args.input_len:  # random prompts of a fixed length, as the serving sweep sends
        rng = random.Random(0)
        vocab = min(len(tokenizer), 10000)
        prompts = [
            [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)
        ]
        return prompts, [args.output_len] * args.num_requests
    ids = tokenizer.encode("Hello")
    return [ids] * args.num_requests, [args.output_len] * args.num_requests


def routes_experts(model_dir: str) -> bool:
    """Whether the checkpoint's model (or its text model) is a mixture of experts."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    configs = [config, config.get("text_config") or {}]
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return any(c.get(k) for c in configs for k in keys)


def run_pagoda(
    llm: LLM,
    prompts: list[list[int]],
    output_lens: list[int],
    decode_steps: list[DecodeStep],
    temperature: float = 0.0,
    loras: list[str] = (),
) -> dict:
    """Drive the engine directly (final-only outputs, as LLM.generate does); each
    decode-only step is appended to decode_steps. With `loras`, request i generates
    with adapter i mod their count."""
    engine = llm.engine
    for i, (ids, n) in enumerate(zip(prompts, output_lens)):
        lora = loras[i % len(loras)] if loras else None
        params = SamplingParams(
            max_tokens=n, temperature=temperature, ignore_eos=True, final_only=True, lora_name=lora
        )
        engine.add_request(str(i), ids, params)
    schedule, scheduled = engine.scheduler.schedule, []

    def keep_schedule():  # each step's SchedulerOutput, for its batch and context
        scheduled.append(schedule())
        return scheduled[-1]

    engine.scheduler.schedule = keep_schedule
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start_wall, start = time.time(), time.perf_counter()
    finished = []
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            finished += engine.step()
            out = scheduled.pop()
            if out and out.is_decode_only:
                context = int((out.starts + out.num_new_tokens).sum())
                decode_steps.append(DecodeStep(time.perf_counter() - t0, out.num_seqs, context))
    finally:
        del engine.scheduler.schedule
    total = time.perf_counter() - start
    step_s = [d.seconds for d in decode_steps]
    tokens = sum(output_lens)
    assert sum(out.num_output_tokens for out in finished) == tokens
    metrics = [out.metrics for out in finished]
    ttft = [m.first_token_time - start_wall for m in metrics]
    tpot = [
        (m.finished_time - m.first_token_time) / (out.num_output_tokens - 1)
        for m, out in zip(metrics, finished)
        if out.num_output_tokens > 1
    ]
    return {
        "total_s": total,
        "output_tokens": tokens,
        "tok_per_s": tokens / total,
        "decode_s": max(m.finished_time for m in metrics)
        - max(m.first_token_time for m in metrics),
        "ttft_ms": {"p50": 1e3 * statistics.median(ttft), "mean": 1e3 * statistics.mean(ttft)},
        "tpot_ms": {  # none when every request produced one token
            "p50": 1e3 * statistics.median(tpot) if tpot else None,
            "mean": 1e3 * statistics.mean(tpot) if tpot else None,
        },
        "decode_step_ms": {
            "p50": 1e3 * statistics.median(step_s) if step_s else None,
            "count": len(step_s),
        },
    }


def run_hf(model_dir: str, dtype: torch.dtype, prompt: list[int], n: int, output_len: int) -> dict:
    from benchmarks.hf_compile import load_model

    model = load_model(model_dir, dtype)  # random-weight shapes drawn on the GPU
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt] * n, device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(input_ids), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids, max_new_tokens=8, **kwargs)  # warm up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            input_ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs
        )
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    tokens = (out.shape[1] - len(prompt)) * n
    del model
    torch.cuda.empty_cache()
    return {"total_s": total, "output_tokens": tokens, "tok_per_s": tokens / total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="gpt2",
        help="a shape of benchmarks/shapes.py (gpt2, qwen2-0.5b, qwen3-30b-a3b, "
        "gpt-oss-20b, glm-4.5-air, llama3-8b, ...: random weights) or a model dir",
    )
    p.add_argument("--workload", default="seeds", choices=["seeds", "nano-vllm"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument(
        "--input-len", type=int, default=0, help="random prompts of this length (default: 'Hello')"
    )
    p.add_argument("--dtype", default=None, help="default: float16 for gpt2, bfloat16 otherwise")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--compare-hf", action="store_true", help="also time transformers generate")
    p.add_argument(
        "--compare-hf-compile",
        action="store_true",
        help="batch 1: also time transformers generate with a static cache and a compiled "
        "forward (benchmarks.hf_compile)",
    )
    p.add_argument("--profile", action="store_true", help="per-phase breakdown of a decode step")
    p.add_argument(
        "--profile-batch", type=int, default=None, help="batch of --profile (default: up to 64)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: 1024 (2048 for nano-vllm), or the prompt plus output if longer",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step; default: the offline LLM's (engine/config.py's "
        "offline_budget: 16,384 on a GPU of 70 GiB or more, as vLLM's and nano-vllm's), "
        "or max-model-len if longer: one chunk per prompt",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="serve N random LoRA adapters (every projection) and spread the requests over them",
    )
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="Pagoda's requests sample at this temperature (default 0: greedy); "
        "transformers, where compared, stays greedy",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 256 if args.workload == "nano-vllm" else 64
    if args.compare_hf_compile and (args.workload != "seeds" or args.num_requests != 1):
        p.error("--compare-hf-compile times batch 1: the seeds workload with --num-requests 1")
    dtype_name = args.dtype or ("float16" if args.model == "gpt2" else "bfloat16")
    dtype = getattr(torch, dtype_name)

    model_dir = checkpoint_dir(args.model, dtype_name)
    one_prompt = args.workload == "seeds" and not args.input_len and args.num_requests > 1
    if one_prompt and routes_experts(model_dir):  # not a batch an MoE model ever sees
        p.error(
            "an MoE model's requests need prompts of their own (--input-len N): one "
            "prompt repeated sends every sequence to the same experts"
        )
    loras = write_random_adapters(model_dir, args.lora, args.lora_rank) if args.lora else None
    max_len = args.max_model_len or max(
        2048 if args.workload == "nano-vllm" else 1024, args.input_len + args.output_len
    )
    budget = args.max_num_batched_tokens or max(offline_budget(torch.device("cuda")), max_len)
    llm = LLM(
        model_dir,
        dtype=dtype_name,
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enforce_eager=args.enforce_eager,
        lora_modules=loras,
    )
    prompts, output_lens = workload(args, llm.tokenizer)
    # Warm up on the run's own batch, as transformers is warmed up below: the first
    # launch at a new shape compiles Triton kernels. A prompt at the length limit warms
    # up on one token.
    warm = max(1, min(8, max_len - max(map(len, prompts))))
    llm.generate(prompts, SamplingParams(max_tokens=warm, ignore_eos=True), use_tqdm=False)

    result = {
        **provenance("offline", argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "dtype": dtype_name,
        "workload": args.workload,
        "num_requests": args.num_requests,
        "output_len": args.output_len if args.workload == "seeds" else "uniform[100, 1024]",
        "cuda_graphs": not args.enforce_eager,
        "temperature": args.temperature,
        "lora": {"adapters": args.lora, "rank": args.lora_rank} if args.lora else None,
    }
    decode_steps: list[DecodeStep] = []
    result["pagoda"] = run_pagoda(
        llm, prompts, output_lens, decode_steps, args.temperature, list(loras or ())
    )
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_gb_s"] = bandwidth / 1e9
    result["decode_vs_floor"] = decode_vs_floor(llm, decode_steps, bandwidth)
    if args.workload == "seeds":
        mean_ctx = len(prompts[0]) + args.output_len / 2  # prompts share one length
        floor = decode_floor_ms(llm, args.num_requests, mean_ctx, bandwidth)
        result["decode_step_floor_ms"] = floor
        step = result["pagoda"]["decode_step_ms"]["p50"]
        result["decode_step_vs_floor"] = step / floor if step else None
    if args.profile and not args.enforce_eager:
        batch = args.profile_batch or min(args.num_requests, 64)
        result["decode_step_profile_us"] = profile_decode_step(llm, batch, 256)
    if (args.compare_hf or args.compare_hf_compile) and args.workload == "seeds":
        # The engine's heap was frozen out of the collector (engine/heap.py): unfreeze it,
        # so that its cycles, the KV cache and graph pools among them, are freed.
        del llm
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()
    if args.compare_hf and args.workload == "seeds":
        result["transformers"] = run_hf(
            model_dir, dtype, prompts[0], args.num_requests, args.output_len
        ) | {"version": package_version("transformers")}
        result["speedup_vs_transformers"] = (
            result["pagoda"]["tok_per_s"] / result["transformers"]["tok_per_s"]
        )
    if args.compare_hf_compile:
        from benchmarks.hf_compile import time_static_compile

        hf = time_static_compile(model_dir, dtype, prompts[0], args.output_len)
        result["transformers_static_compile"] = hf
        step = result["pagoda"]["decode_step_ms"]["p50"]
        # Below 1: Pagoda's decode token is that much of transformers' time.
        result["decode_ms_vs_hf_compile"] = step / hf["decode_ms_per_token"] if step else None

    print(json.dumps(result, indent=2))
    pg = result["pagoda"]
    line = f"pagoda: {pg['tok_per_s']:,.0f} tok/s ({pg['output_tokens']} tokens in {pg['total_s']:.2f} s)"
    if "transformers" in result:
        line += f"; transformers: {result['transformers']['tok_per_s']:,.0f} tok/s"
        line += f"; ratio {result['speedup_vs_transformers']:.1f}x"
    floor = result["decode_vs_floor"]
    if floor["steps"]:
        line += f"; decode step {floor['step_ms_p50']:.2f} ms, {floor['ratio_p50']:.2f}x its floor"
    if "transformers_static_compile" in result:
        hf_ms = result["transformers_static_compile"]["decode_ms_per_token"]
        line += f"; transformers static+compile {hf_ms:.2f} ms/token"
    print(line)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
