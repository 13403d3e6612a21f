"""Kernel benchmarks on the GPU: decode attention and KV store against HBM bandwidth.

    python -m benchmarks.kernels --out benchmarks/results/kernels-h100.json [--sweep]

Decode attention is memory bound: each step reads every cached K/V byte of the batch once.
Its floor is that byte count over the bandwidth of a large device-to-device copy measured
in the same run (also reported against the H100's nominal 3.35 TB/s). Kernels are timed as
the engine runs them, replayed from a CUDA graph, so Python launch overhead (tens of us,
more than the small cases' kernel time) is left out; triton.testing.do_bench flushes L2
before every replay, so no case is served from cache. Times are medians. --sweep also
times alternative launch configs (how docs/kernels.md picked them).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import triton
from triton.testing import do_bench

from kernels.kv_store import kv_store
from kernels.paged_attention import DecodeConfig, decode_config, paged_attention_decode

NOMINAL_GBPS = 3350.0  # H100 SXM HBM3
BLOCK_SIZE = 16
# name -> (num_heads, num_kv_heads, head_dim)
MODELS = {"gpt2": (12, 12, 64), "qwen2.5-0.5b": (14, 2, 64)}
BATCH_SIZES = [1, 8, 64, 256]
CONTEXT_LENS = [128, 512, 2048, 8192]


def graph_median_ms(fn: Callable[[], object], rep: int = 100) -> float:
    """Median time of `fn` replayed from a CUDA graph, L2 flushed before each replay."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth_gbps() -> float:
    """Achievable HBM bandwidth: a 2 GiB device-to-device copy (read + write bytes)."""
    src = torch.empty(2**29, dtype=torch.float32, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")  # launch cost is negligible
    return 2 * src.nbytes / ms / 1e6


class DecodeCase:
    """Decode inputs for `num_seqs` sequences of `context_len` tokens, blocks shuffled."""

    def __init__(self, model: str, num_seqs: int, context_len: int, dtype: torch.dtype) -> None:
        num_heads, num_kv_heads, head_dim = MODELS[model]
        max_blocks = context_len // BLOCK_SIZE
        num_blocks = num_seqs * max_blocks
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.v_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.block_table = (
            torch.randperm(num_blocks, device="cuda").view(num_seqs, max_blocks).int()
        )
        self.context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device="cuda")
        self.query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device="cuda")
        self.scale = head_dim**-0.5
        self.default_config = decode_config(
            num_seqs, num_kv_heads, max_blocks, BLOCK_SIZE, self.query.device
        )
        # Bytes that must cross HBM: all K/V of the batch, queries, outputs, block table.
        self.bytes = 2 * self.k_cache.nbytes + 2 * self.query.nbytes + self.block_table.nbytes

    def time_ms(self, config: DecodeConfig, rep: int = 100) -> float:
        def run() -> None:
            paged_attention_decode(
                self.query,
                self.k_cache,
                self.v_cache,
                self.block_table,
                self.context_lens,
                self.scale,
                config=config,
            )

        return graph_median_ms(run, rep)


def bench_decode(peak_gbps: float) -> list[dict]:
    rows = []
    for model, num_seqs, context_len in itertools.product(MODELS, BATCH_SIZES, CONTEXT_LENS):
        case = DecodeCase(model, num_seqs, context_len, torch.float16)
        ms = case.time_ms(case.default_config)
        gbps = case.bytes / ms / 1e6
        rows.append(
            {
                "model": model,
                "num_seqs": num_seqs,
                "context_len": context_len,
                "config": asdict(case.default_config),
                "bytes": case.bytes,
                "median_us": round(ms * 1e3, 2),
                "floor_us": round(case.bytes / peak_gbps / 1e3, 2),
                "gbps": round(gbps, 1),
                "pct_of_copy_peak": round(100 * gbps / peak_gbps, 1),
                "pct_of_nominal": round(100 * gbps / NOMINAL_GBPS, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del case
    return rows


def sweep_decode() -> list[dict]:
    """Time alternative tile configs at the target shapes, and split counts at small batches."""
    rows = []
    tiles = list(itertools.product([32, 64, 128], [2, 4, 8], [2, 3, 4]))  # block_n, warps, stages
    shapes = [("gpt2", 64, 512), ("gpt2", 64, 2048), ("qwen2.5-0.5b", 64, 512)]
    shapes += [("qwen2.5-0.5b", 64, 2048), ("qwen2.5-0.5b", 8, 8192)]
    for model, num_seqs, context_len in shapes:
        case = DecodeCase(model, num_seqs, context_len, torch.float16)
        for block_n, num_warps, num_stages in tiles:
            config = replace(
                case.default_config, block_n=block_n, num_warps=num_warps, num_stages=num_stages
            )
            rows.append(sweep_row(model, num_seqs, context_len, config, case.time_ms(config, 30)))
        del case
    for model, num_seqs, context_len in itertools.product(MODELS, [1, 8, 64], [512, 2048, 8192]):
        case = DecodeCase(model, num_seqs, context_len, torch.float16)
        for num_splits in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128]:
            config = replace(case.default_config, num_splits=num_splits)
            rows.append(sweep_row(model, num_seqs, context_len, config, case.time_ms(config, 30)))
        del case
    return rows


def sweep_row(model: str, num_seqs: int, context_len: int, config: DecodeConfig, ms: float) -> dict:
    row = {"model": model, "num_seqs": num_seqs, "context_len": context_len, **asdict(config)}
    row["median_us"] = round(ms * 1e3, 2)
    print(json.dumps(row), flush=True)
    return row


def bench_kv_store(peak_gbps: float) -> list[dict]:
    rows = []
    for model, num_tokens in itertools.product(MODELS, [64, 512, 4096, 16384]):
        _, num_kv_heads, head_dim = MODELS[model]
        num_blocks = 2 * num_tokens // BLOCK_SIZE
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        k_cache = torch.zeros(shape, dtype=torch.float16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.float16, device="cuda")
        value = torch.randn_like(key)
        slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
        ms = graph_median_ms(
            functools.partial(kv_store, key, value, k_cache, v_cache, slot_mapping)
        )
        moved = 2 * (key.nbytes + value.nbytes)  # read from key/value, written to the caches
        gbps = moved / ms / 1e6
        rows.append(
            {
                "model": model,
                "num_tokens": num_tokens,
                "bytes_moved": moved,
                "median_us": round(ms * 1e3, 2),
                "gbps": round(gbps, 1),
                "pct_of_copy_peak": round(100 * gbps / peak_gbps, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--sweep", action="store_true", help="also time alternative configs")
    parser.add_argument("--git-commit", default=None, help="commit to record (default: git HEAD)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.kernels needs a CUDA device")

    peak_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy: {peak_gbps:.0f} GB/s", flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": args.git_commit or git_commit(),
        "command": " ".join(["python -m benchmarks.kernels", *sys.argv[1:]]),
        "copy_peak_gbps": round(peak_gbps, 1),
        "nominal_gbps": NOMINAL_GBPS,
        "decode_fp16": bench_decode(peak_gbps),
        "kv_store_fp16": bench_kv_store(peak_gbps),
    }
    if args.sweep:
        result["decode_sweep"] = sweep_decode()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
