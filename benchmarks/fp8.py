"""FP8 vs bf16 on one GPU, same run: a model shape with random weights (Llama-3-8B's, or
an MoE's, whose experts go FP8 too).

    python -m benchmarks.fp8 --out benchmarks/results/fp8-llama3-8b-h200.json
    python -m benchmarks.fp8 --model qwen3-30b-a3b --configs bf16 fp8 --out ...
    python -m benchmarks.fp8 --model llama3-70b --configs fp8 --no-bf16 --out ...

Each configuration runs in a process of its own (a fresh CUDA context, so one
engine's leftovers never shrink the next one's KV cache):
  bf16          bf16 weights, bf16 KV: batch-1 ms/token, 64 x 512/512 throughput,
                KV blocks, and the reference logits
  fp8           --quantization fp8 --kv-cache-dtype fp8: the same measurements
  bf16+fp8kv    bf16 weights, FP8 KV (eager: KV blocks and logits only)
  fp8+bf16kv    FP8 weights, bf16 KV (eager: KV blocks and logits only)
  fp8 reference the same with every FP8 projection computed by its torch reference
                (both sides dequantized, one fp32 matmul: `fp8_linear_ref`; MoE
                experts by `fused_moe_ref` on their dequantized weights)
  fp32          fp32 weights and activations (eager: logits only)
All of them draw the same random bf16 weights (seed 0, on the device), so FP8 runs the
quantized copy of the bf16 model and their logits compare like for like: the
last-position logits of 64 random-token prompts, as cosine similarity and top-1
agreement. Random weights give near-Gaussian activations and logits without the
outliers of trained models, and 32 random layers amplify any rounding: fp32 against
bf16 says how far rounding alone moves this model, and the FP8 projections against
their torch reference (`logits_vs_engine`) whether the engine computes the FP8 scheme
it claims. Neither says how a trained model's accuracy fares under FP8.

For Llama-3-8B the fp8 run also times the projections alone (bf16 GEMM, FP8 linear, the per-token
quantizer) at each Llama-3-8B projection shape and batches 1, 16 and 64, each inside
a CUDA graph, beside its weight-read floor: where the FP8 step's time goes.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import floors
from benchmarks.checkpoints import build_checkpoint
from benchmarks.decode_step import start_decoding
from benchmarks.floors import DecodeStep, copy_bandwidth, decode_vs_floor
from benchmarks.offline import run_pagoda
from benchmarks.provenance import git_commit, write_result
from benchmarks.shapes import CONFIGS as SHAPES
from engine import LLM, SamplingParams
from engine.models import experts
from engine.models.layers import AttentionMetadata, SequenceSpans
from engine.models.quantization import Fp8Linear
from kernels.fp8 import (
    Fp8Rows,
    fp8_linear,
    fp8_linear_ref,
    fp8_rows_linear_ref,
    quantize_per_channel,
    quantize_per_token,
)
from kernels.fused_moe import fused_moe_ref


@dataclass(frozen=True)
class Config:
    overrides: dict  # LLM arguments past the defaults (bf16, everything else off)
    full: bool = False  # time batch 1 and throughput with CUDA graphs; else logits only
    reference: bool = False  # FP8 projections by their torch reference


CONFIGS: dict[str, Config] = {
    "bf16": Config({}, full=True),
    "fp8": Config({"quantization": "fp8", "kv_cache_dtype": "fp8"}, full=True),
    "bf16+fp8kv": Config({"kv_cache_dtype": "fp8"}),
    "fp8+bf16kv": Config({"quantization": "fp8"}),
    "fp8 reference": Config({"quantization": "fp8"}, reference=True),
    "fp32": Config({"dtype": "float32"}),
}


# Llama-3-8B's projections, (K, N): qkv, o, gate_up, down.
GEMM_SHAPES = {
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Device time of one fn() call: `calls` of them captured in a CUDA graph (no host
    launch gaps), replayed `replays` times between events."""
    fn()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * replays)


def gemm_timings(bandwidth: float, batches: tuple[int, ...] = (1, 16, 64)) -> dict:
    """Per projection shape and batch: the bf16 GEMM, the FP8 linear (per-token quantizer
    + _scaled_mm), the engine's FP8 layer (Fp8Linear: split-K up to 64 rows) and the
    quantizer alone, in microseconds, beside each one's weight-read floor at the
    measured copy bandwidth."""
    return {
        f"{name} m={m}": _gemm_shape(k, n, m, bandwidth)
        for name, (k, n) in GEMM_SHAPES.items()
        for m in batches
    }


def _gemm_shape(k: int, n: int, m: int, bandwidth: float) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    w_q, w_scale = quantize_per_channel(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear(w_q, w_scale, None)
    return {
        "bf16_us": graph_us(lambda: torch.nn.functional.linear(x, w)),
        "fp8_us": graph_us(lambda: fp8_linear(x, w_q, w_scale, None)),
        "engine_fp8_us": graph_us(lambda: layer(x)),
        "quantize_us": graph_us(lambda: quantize_per_token(x)),
        "bf16_floor_us": 1e6 * 2 * n * k / bandwidth,
        "fp8_floor_us": 1e6 * n * k / bandwidth,
    }


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads once: every parameter and buffer (FP8 weights and
    their scales are buffers) but the embedding table, which is gathered by row."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            total += t.numel() * t.element_size()
    return total


def batch1_decode(llm: LLM, context: int, steps: int, bandwidth: float) -> dict:
    """ms per token of one sequence decoding at ~context tokens, and its floors."""
    engine = llm.engine
    start_decoding(engine, 1, context, max_tokens=steps + 64)
    for _ in range(16):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / steps
    engine.abort_request("p0")
    while engine.has_unfinished_requests():
        engine.step()
    runner = engine.runner
    weights = floors.weight_bytes(llm, 1)  # of an MoE, the experts one token hits
    kv = (context + 16 + steps / 2) * runner.bytes_per_block() / runner.block_size
    return {
        "context": context,
        "steps": steps,
        "ms_per_token": ms,
        "weight_bytes": weights,
        "weights_only_floor_ms": 1e3 * weights / bandwidth,
        "floor_ms": 1e3 * (weights + kv) / bandwidth,
        "vs_weights_only_floor": ms / (1e3 * weights / bandwidth),
    }


@torch.inference_mode()
def last_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:  # [num_prompts, vocab] fp32
    """Each prompt's last-position logits from one eager prefill through the paged cache
    (the engine is idle and prefix caching off, so its blocks are free to write)."""
    engine, device = llm.engine, llm.engine.runner.device
    rows = []
    for ids in prompts:
        n = len(ids)
        blocks = -(-n // engine.config.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            block_table=torch.arange(blocks, device=device, dtype=torch.int32)[None],
            seq_lens=torch.tensor([n], device=device, dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], device=device, dtype=torch.int32),
            max_query_len=n,
            is_decode=False,
        )
        if engine.runner.state_layers:  # recurrent layers: slot 0's states, started afresh
            meta.state_slots = torch.zeros(1, dtype=torch.int64, device=device)
            meta.spans = SequenceSpans.of(meta)
        input_ids = torch.tensor(ids, device=device)
        hidden = engine.model(input_ids, torch.arange(n, device=device), meta)
        rows.append(engine.model.compute_logits(hidden[-1:]).float().cpu())
    return torch.cat(rows)


def reference_forward(linear: Fp8Linear, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """An Fp8Linear's output by the torch reference of its scheme (x per token; rows a
    norm or activation quantized are bit for bit quantize_per_token_ref's, tested)."""
    if not isinstance(x, torch.Tensor):  # Fp8Rows
        return fp8_rows_linear_ref(x, linear.weight, linear.weight_scale, linear.bias)
    rows = x.reshape(-1, x.shape[-1])
    out = fp8_linear_ref(rows, linear.weight, linear.weight_scale, linear.bias)
    return out.view(*x.shape[:-1], linear.out_features)


def compare_logits(got: torch.Tensor, ref: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return {
        "prompts": len(ref),
        "cosine_mean": cos.mean().item(),
        "cosine_min": cos.min().item(),
        "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "max_abs_diff_over_ref_std": ((got - ref).abs().max() / ref.std()).item(),
    }


def run_config(name: str, args, model_dir: str, work: Path) -> dict:
    config = CONFIGS[name]
    full = config.full
    max_len = 8192  # the model's own: the KV block count is not capped by max_num_seqs * len
    llm = LLM(
        model_dir,
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=not full,
        **{"dtype": "bfloat16", **config.overrides},
    )
    if config.reference:
        for module in llm.engine.model.modules():
            if isinstance(module, Fp8Linear):
                module.forward = functools.partial(reference_forward, module)
        experts.fused_moe_for = lambda device: fused_moe_ref  # this child's MoE layers
    runner = llm.engine.runner
    out: dict = {
        "gpu": torch.cuda.get_device_name(),
        "config": config.overrides,
        "fp8_reference": config.reference,
        "cuda_graphs": full,
        "kv_blocks": runner.num_blocks,
        "kv_tokens": runner.num_blocks * runner.block_size,
        "kv_bytes_per_block": runner.bytes_per_block(),
        "kv_cache_dtype": str(runner.kv_dtype),
        "weight_bytes": weight_bytes(llm.engine.model),
    }
    rng = random.Random(0)
    vocab = min(llm.engine.vocab_size, 50257)
    prompts = [[rng.randrange(vocab) for _ in range(args.logit_prompt_len)] for _ in range(64)]
    logits = last_logits(llm, prompts)
    torch.save(logits, work / f"{name}_logits.pt")
    if name != "bf16" and (work / "bf16_logits.pt").exists():  # a 70B runs FP8 only
        out["logits_vs_bf16"] = compare_logits(logits, torch.load(work / "bf16_logits.pt"))
    engine_logits = work / "fp8+bf16kv_logits.pt"
    if config.reference and engine_logits.exists():
        out["logits_vs_engine"] = compare_logits(torch.load(engine_logits), logits)
    if full:
        bandwidth = copy_bandwidth()
        out["copy_bandwidth_gb_s"] = bandwidth / 1e9
        out["batch1"] = batch1_decode(llm, args.input_len, args.batch1_steps, bandwidth)
        n = args.num_requests
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(n)]
        lens = [args.output_len] * n
        # Warm up at the run's own shapes (Triton compiles per shape).
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        steps: list[DecodeStep] = []
        out["throughput"] = run_pagoda(llm, prompts, lens, steps)
        out["decode_vs_floor"] = decode_vs_floor(llm, steps, bandwidth)
        if name == "fp8" and args.model == "llama3-8b":
            out["gemm_us"] = gemm_timings(bandwidth)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="write the JSON result here")
    p.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES), help="the shape")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--batch1-steps", type=int, default=256)
    p.add_argument("--logit-prompt-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument(
        "--no-bf16",
        dest="bf16",
        action="store_false",
        help="leave out bf16, which otherwise always runs as the reference (for a model "
        "whose bf16 weights do not fit the GPU: the Llama-3-70B shape on one H200)",
    )
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one config, in a child
    p.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]

    model = args.model
    model_dir = build_checkpoint(model, Path(tempfile.gettempdir()) / f"pagoda-bench-{model}")
    if args.only:
        result = run_config(args.only, args, model_dir, args.work)
        write_result(args.out, result)
        return 0

    result: dict = {
        "benchmark": "fp8",
        "command": "python -m benchmarks.fp8 " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
        "gpu": None,  # from the children: this process leaves CUDA alone
        "torch": torch.__version__,
        "model": f"{model} (random weights, bf16)",
        "workload": f"{args.num_requests} x {args.input_len} in / {args.output_len} out",
        "configs": {},
    }
    # bf16's logits first (every other config's reference), the engine's FP8
    # projections' before their reference's.
    configs = set(args.configs) | ({"bf16"} if args.bf16 else set())
    configs = sorted(configs, key=list(CONFIGS).index)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in configs:
            part = work / f"{name}.json"
            child = [*argv, "--only", name, "--work", str(work), "--out", str(part)]
            subprocess.run([sys.executable, "-m", "benchmarks.fp8", *child], check=True)
            result["configs"][name] = json.loads(part.read_text())
            result["gpu"] = result["configs"][name].pop("gpu")
            print(f"{name}: {json.dumps(result['configs'][name])}", flush=True)
    result["summary"] = summary(result["configs"])
    print(json.dumps(result["summary"], indent=2))
    write_result(args.out, result)
    return 0


def summary(configs: dict) -> dict:
    """The issue's figures: FP8 over bf16 and the KV block ratios."""
    bf16, fp8 = configs.get("bf16"), configs.get("fp8")
    out: dict = {}
    if fp8 and "batch1" in fp8:
        out["batch1_ms_per_token"] = {
            "fp8": fp8["batch1"]["ms_per_token"],
            "fp8_weights_only_floor": fp8["batch1"]["weights_only_floor_ms"],
        }
        fp8_tok_s = fp8["throughput"]["tok_per_s"]
        out["throughput_tok_s"] = {"fp8": fp8_tok_s}
    if fp8 and bf16 and "batch1" in fp8:
        out["batch1_ms_per_token"]["bf16"] = bf16["batch1"]["ms_per_token"]
        bf16_tok_s = bf16["throughput"]["tok_per_s"]
        out["throughput_tok_s"] |= {"bf16": bf16_tok_s, "ratio": fp8_tok_s / bf16_tok_s}
    pairs = {"bf16 weights": ("bf16", "bf16+fp8kv"), "fp8 weights": ("fp8+bf16kv", "fp8")}
    for label, (auto, kv8) in pairs.items():
        if auto in configs and kv8 in configs:
            blocks = (configs[auto]["kv_blocks"], configs[kv8]["kv_blocks"])
            out[f"kv_blocks_{label}"] = {
                "bf16_kv": blocks[0],
                "fp8_kv": blocks[1],
                "ratio": blocks[1] / blocks[0],
            }
    out["logits_vs_bf16"] = {
        name: c["logits_vs_bf16"] for name, c in configs.items() if "logits_vs_bf16" in c
    }
    if "logits_vs_engine" in configs.get("fp8 reference", {}):
        out["fp8_engine_vs_reference"] = configs["fp8 reference"]["logits_vs_engine"]
    return out


if __name__ == "__main__":
    sys.exit(main())
