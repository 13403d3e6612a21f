"""Prefill attention on the GPU: Pagoda's paged kernel against PyTorch's SDPA.

    python -m benchmarks.prefill_attention --out benchmarks/results/prefill-attention-h200.json

One prompt of each model's long-prompt shape, causal, bf16: Pagoda's Triton kernel reading
K/V from the paged cache through a shuffled block table (as the engine does), against
`torch.nn.functional.scaled_dot_product_attention` on contiguous tensors with
`is_causal=True` and the backend PyTorch picks, as transformers' SDPA path runs it
(cuDNN's attention on Hopper). Times are medians of one layer's call from `do_bench`,
which counts launch overhead (GPT-2's shape is host-bound there;
benchmarks.attention_libraries times from CUDA graphs and per SDPA backend); TFLOPS count
the causal half of QK^T and PV (4 * T^2 / 2 * head_dim * num_heads). The kernel's tile config per query length is `prefill_config`'s
(docs/kernels.md says how it was chosen).

Then steps of few query tiles over long contexts (speculative verify steps, a short chunk
after a cached prefix, a prompt beside decodes), Llama-3-8B's heads: the kernel as the
engine launches it (keys split when the tiles are few), unsplit, and for verify steps
the decode kernel run per token; each timed per layer from a CUDA graph over enough
layers' caches that L2 holds none, against reading the K/V once at the copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from benchmarks.floors import copy_bandwidth
from benchmarks.provenance import git_commit
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import paged_prefill_attention
from kernels.prefill_config import prefill_config

BLOCK_SIZE = 16
# name -> (prompt tokens, num_heads, num_kv_heads, head_dim)
SHAPES = {
    "gpt2": (2048, 12, 12, 64),
    "qwen2.5-0.5b": (4096, 14, 2, 64),
    "llama3-8b": (8191, 32, 8, 128),
}
# name -> [(query_len, context_len)] a sequence
FEW_TILES = {
    "verify 1 x (1+4) over 512": [(5, 512)],
    "verify 1 x (1+4) over 2048": [(5, 2048)],
    "verify 1 x (1+4) over 8192": [(5, 8192)],
    "verify 16 x (1+4) over 512": [(5, 512)] * 16,
    "verify 16 x (1+4) over 2048": [(5, 2048)] * 16,
    "verify 64 x (1+4) over 512": [(5, 512)] * 64,
    "16 new tokens after 1008 cached": [(16, 1024)],
    "64 new tokens after 4032 cached": [(64, 4096)],
    "256 new tokens after 7936 cached": [(256, 8192)],
    "a 2000-token prompt beside 48 decodes over 512": [(2000, 2000)] + [(1, 512)] * 48,
}


def bench_shape(name: str, tokens: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    query = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device, generator=gen)
    key = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device, generator=gen)
    value = torch.randn_like(key)
    # The paged cache: the same K/V, one block at a time, in shuffled blocks.
    num_blocks = -(-tokens // BLOCK_SIZE)
    padded = num_blocks * BLOCK_SIZE
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    pad = (0, 0, 0, 0, 0, padded - tokens)
    k_cache[order.long()] = F.pad(key, pad).view(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    v_cache[order.long()] = F.pad(value, pad).view(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    block_table = order[None].contiguous()
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    def pagoda() -> torch.Tensor:
        return paged_prefill_attention(
            query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, tokens
        )

    # SDPA's layout: [batch, heads, tokens, head_dim], K/V heads repeated for GQA.
    q4 = query.transpose(0, 1)[None]
    k4 = key.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)[None].contiguous()
    v4 = value.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)[None].contiguous()

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)

    ours, theirs = pagoda(), sdpa()[0].transpose(0, 1)
    max_err = (ours.float() - theirs.float()).abs().max().item()
    flops = 4 * tokens * tokens / 2 * head_dim * heads
    us = {fn.__name__: 1e3 * do_bench(fn, rep=200, return_mode="median") for fn in (pagoda, sdpa)}
    return {
        "model": name,
        "tokens": tokens,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "config": vars(prefill_config(tokens, head_dim, heads // kv_heads)),
        "pagoda_us": round(us["pagoda"], 1),
        "sdpa_us": round(us["sdpa"], 1),
        "pagoda_tflops": round(flops / us["pagoda"] / 1e6, 1),
        "sdpa_tflops": round(flops / us["sdpa"] / 1e6, 1),
        "pagoda_vs_sdpa": round(us["pagoda"] / us["sdpa"], 3),
        "max_abs_diff": max_err,
    }


def bench_few_tiles(name: str, chunks: list[tuple[int, int]], bandwidth: float) -> dict:
    """One layer's attention for sequences of (query_len, context_len), Llama-3-8B heads."""
    heads, kv_heads, head_dim = SHAPES["llama3-8b"][1:]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    query_lens, seq_lens = [q for q, _ in chunks], [c for _, c in chunks]
    seqs, tokens, max_query = len(chunks), sum(query_lens), max(query_lens)
    max_blocks = -(-max(seq_lens) // BLOCK_SIZE)
    kv_bytes = 2 * sum(seq_lens) * kv_heads * head_dim * dtype.itemsize
    layers = max(2, min(16, (768 << 20) // kv_bytes))  # caches past L2, each layer its own
    num_blocks = layers * seqs * max_blocks
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = order.view(layers, seqs, max_blocks)
    query = torch.randn(layers, tokens, heads, head_dim, dtype=dtype, device=device, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    query_start_loc = starts.to(device=device, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    default = prefill_config(
        max_query, head_dim, heads // kv_heads, tokens, kv_heads, max_blocks * BLOCK_SIZE,
        torch.device(device),
    )  # fmt: skip

    def per_layer_us(attend) -> float:
        def all_layers() -> None:
            for i in range(layers):
                attend(i)

        return 1e3 * do_bench_cudagraph(all_layers, rep=200) / layers

    def prefill(config):
        return lambda i: paged_prefill_attention(
            query[i], k_cache, v_cache, tables[i], query_start_loc, lens, scale, max_query,
            config=config,
        )  # fmt: skip

    row = {
        "step": name,
        "tokens": tokens,
        "sequences": seqs,
        "config": vars(default),
        "kv_mb": round(kv_bytes / 2**20, 2),
        "floor_us": round(1e6 * kv_bytes / bandwidth, 2),
        "pagoda_us": round(per_layer_us(prefill(default)), 2),
        "unsplit_us": round(per_layer_us(prefill(dataclasses.replace(default, num_splits=1))), 2),
    }
    if 1 < max_query <= 8:  # a verify step: each token a decode row of its own
        rows = torch.repeat_interleave(torch.arange(seqs), torch.tensor(query_lens)).to(device)
        ends = [torch.arange(c - q + 1, c + 1) for q, c in chunks]
        context = torch.cat(ends).to(device=device, dtype=torch.int32)
        per_token = tables[:, rows].contiguous()
        row["per_token_decode_us"] = round(
            per_layer_us(
                lambda i: paged_attention_decode(
                    query[i], k_cache, v_cache, per_token[i], context, scale
                )
            ),
            2,
        )
    row["pagoda_vs_floor"] = round(row["pagoda_us"] / row["floor_us"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--git-commit", default=None, help="commit to record (default: git HEAD)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.prefill_attention needs a CUDA device")
    rows = []
    for name, shape in SHAPES.items():
        rows.append(bench_shape(name, *shape))
        print(json.dumps(rows[-1]), flush=True)
    bandwidth = copy_bandwidth()
    few_tiles = []
    for name, chunks in FEW_TILES.items():
        few_tiles.append(bench_few_tiles(name, chunks, bandwidth))
        print(json.dumps(few_tiles[-1]), flush=True)
    result = {
        "benchmark": "prefill_attention",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": args.git_commit or git_commit(),
        "command": " ".join(["python -m benchmarks.prefill_attention", *sys.argv[1:]]),
        "rows": rows,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9),
        "few_tiles": few_tiles,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
