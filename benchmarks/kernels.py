"""Kernel benchmarks on the GPU: decode attention and KV store against HBM bandwidth.

    python -m benchmarks.kernels --out benchmarks/results/kernels-h100.json [--sweep]

Decode attention is memory bound: each step reads every cached K/V byte of the batch once.
Its floor is that byte count over the bandwidth of a large device-to-device copy measured
in the same run (also reported against the H100's nominal 3.35 TB/s). Kernels are timed as
the engine runs them: one launch per layer of the model, each layer on its own blocks,
replayed from one CUDA graph, so Python launch overhead (tens of us, more than a small
case's kernel time) and the graph's launch are left out or shared, as in the engine;
triton.testing.do_bench flushes L2 before every replay, so no layer is served from cache.
Times are medians per layer. Decode rows also time each split count; --sweep times
alternative tile configs (how docs/kernels.md picked the defaults).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import triton
from triton.testing import do_bench

from benchmarks.provenance import git_commit
from kernels.decode_config import DecodeConfig, decode_config
from kernels.kv_store import kv_store
from kernels.paged_attention import paged_attention_decode

NOMINAL_GBPS = 3350.0  # H100 SXM HBM3
BLOCK_SIZE = 16
KV_BUDGET_BYTES = 4 * 2**30  # caps the layers a case allocates
# name -> (num_heads, num_kv_heads, head_dim, num_layers)
MODELS = {
    "gpt2": (12, 12, 64, 12),
    "qwen2.5-0.5b": (14, 2, 64, 24),
    "llama3-8b": (32, 8, 128, 32),
}
BATCH_SIZES = [1, 8, 64, 256]
CONTEXT_LENS = [128, 512, 2048, 8192]
SPLIT_COUNTS = [1, 2, 4, 8, 16, 32, 64]


def graph_median_us(fn: Callable[[], object], rep: int = 50) -> float:
    """Median time of `fn` replayed from a CUDA graph, L2 flushed before each replay."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * do_bench(graph.replay, warmup=10, rep=rep, return_mode="median")


def copy_bandwidth_gbps() -> float:
    """Achievable HBM bandwidth: a 2 GiB device-to-device copy (read + write bytes)."""
    src = torch.empty(2**29, dtype=torch.float32, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")  # launch cost is negligible
    return 2 * src.nbytes / ms / 1e6


def layers_within_budget(model: str, layer_bytes: int) -> int:
    return max(1, min(MODELS[model][3], KV_BUDGET_BYTES // layer_bytes))


class DecodeCase:
    """One decode step's attention through a model's layers, as the engine's graph runs it.

    `num_seqs` sequences of `context_len` tokens; each layer reads its own shuffled blocks,
    as each layer reads its own cache, so no layer finds another's K/V in L2.
    """

    def __init__(self, model: str, num_seqs: int, context_len: int, dtype: torch.dtype) -> None:
        num_heads, num_kv_heads, head_dim, _ = MODELS[model]
        max_blocks = context_len // BLOCK_SIZE
        blocks_per_layer = num_seqs * max_blocks
        kv_bytes = 2 * blocks_per_layer * BLOCK_SIZE * num_kv_heads * head_dim * dtype.itemsize
        self.num_layers = layers_within_budget(model, kv_bytes)
        shape = (self.num_layers * blocks_per_layer, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.v_cache = torch.randn(shape, dtype=dtype, device="cuda")
        blocks = torch.randperm(shape[0], device="cuda", dtype=torch.int32)
        self.block_tables = blocks.view(self.num_layers, num_seqs, max_blocks)
        self.context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device="cuda")
        # [num_layers, num_seqs, num_heads, head_dim]
        self.query = torch.randn(
            self.num_layers, num_seqs, num_heads, head_dim, dtype=dtype, device="cuda"
        )
        self.scale = head_dim**-0.5
        self.default_config = decode_config(
            num_seqs,
            num_kv_heads,
            max_blocks,
            BLOCK_SIZE,
            self.query.device,
            num_heads // num_kv_heads,
            head_dim,
        )
        # Bytes one layer must move: its K/V, queries, outputs and block table.
        q_bytes = self.query[0].nbytes
        self.bytes = kv_bytes + 2 * q_bytes + self.block_tables[0].nbytes

    def time_us(self, config: DecodeConfig, rep: int = 50) -> float:
        """Median time per layer."""

        def step() -> None:
            for layer in range(self.num_layers):
                paged_attention_decode(
                    self.query[layer],
                    self.k_cache,
                    self.v_cache,
                    self.block_tables[layer],
                    self.context_lens,
                    self.scale,
                    config=config,
                )

        return graph_median_us(step, rep) / self.num_layers


def bench_decode(peak_gbps: float) -> list[dict]:
    """Default configs, and the time of each split count beside them."""
    rows = []
    for model, num_seqs, context_len in itertools.product(MODELS, BATCH_SIZES, CONTEXT_LENS):
        case = DecodeCase(model, num_seqs, context_len, torch.float16)
        us = case.time_us(case.default_config)
        gbps = case.bytes / us / 1e3
        by_splits = {
            n: case.time_us(replace(case.default_config, num_splits=n)) for n in SPLIT_COUNTS
        }
        rows.append(
            {
                "model": model,
                "num_seqs": num_seqs,
                "context_len": context_len,
                "layers_timed": case.num_layers,
                "config": asdict(case.default_config),
                "bytes": case.bytes,
                "median_us": round(us, 2),
                "floor_us": round(case.bytes / peak_gbps / 1e3, 2),
                "gbps": round(gbps, 1),
                "pct_of_copy_peak": round(100 * gbps / peak_gbps, 1),
                "pct_of_nominal": round(100 * gbps / NOMINAL_GBPS, 1),
                "median_us_by_num_splits": {n: round(t, 2) for n, t in by_splits.items()},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del case
    return rows


def sweep_tiles() -> list[dict]:
    """Time alternative tile configs (block_n, warps, stages) at the target shapes."""
    rows = []
    tiles = itertools.product([32, 64, 128], [2, 4, 8], [2, 3])
    shapes = [("gpt2", 64, 512), ("qwen2.5-0.5b", 64, 512), ("qwen2.5-0.5b", 8, 8192)]
    cases = [DecodeCase(*shape, torch.float16) for shape in shapes]
    for block_n, num_warps, num_stages in tiles:
        for (model, num_seqs, context_len), case in zip(shapes, cases, strict=True):
            config = replace(
                case.default_config, block_n=block_n, num_warps=num_warps, num_stages=num_stages
            )
            row = {
                "model": model,
                "num_seqs": num_seqs,
                "context_len": context_len,
                **asdict(config),
            }
            row["median_us"] = round(case.time_us(config), 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def store_every_layer(
    key: torch.Tensor,
    value: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    slot_mapping: torch.Tensor,
) -> None:
    for k_cache, v_cache in caches:
        kv_store(key, value, k_cache, v_cache, slot_mapping)


def bench_kv_store(peak_gbps: float) -> list[dict]:
    rows = []
    for model, num_tokens in itertools.product(MODELS, [64, 512, 4096, 16384]):
        _, num_kv_heads, head_dim, _ = MODELS[model]
        num_blocks = 2 * num_tokens // BLOCK_SIZE
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.float16, device="cuda")
        value = torch.randn_like(key)
        moved = 2 * (key.nbytes + value.nbytes)  # read from key/value, written to the caches
        # One cache pair per layer, as in the engine.
        caches = [
            (
                torch.zeros(shape, dtype=key.dtype, device="cuda"),
                torch.zeros(shape, dtype=key.dtype, device="cuda"),
            )
            for _ in range(layers_within_budget(model, 2 * moved))
        ]
        slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
        step = functools.partial(store_every_layer, key, value, caches, slot_mapping)
        us = graph_median_us(step) / len(caches)
        gbps = moved / us / 1e3
        rows.append(
            {
                "model": model,
                "num_tokens": num_tokens,
                "bytes_moved": moved,
                "median_us": round(us, 2),
                "gbps": round(gbps, 1),
                "pct_of_copy_peak": round(100 * gbps / peak_gbps, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


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
        result["decode_tile_sweep"] = sweep_tiles()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
