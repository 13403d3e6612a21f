"""Prefill attention on the GPU: Pagoda's paged kernel against PyTorch's SDPA.

    python -m benchmarks.prefill_attention --out benchmarks/results/prefill-attention-h100.json

One prompt of each model's long-prompt shape, causal, bf16: Pagoda's Triton kernel reading
K/V from the paged cache through a shuffled block table (as the engine does), against
`torch.nn.functional.scaled_dot_product_attention` on contiguous tensors with
`is_causal=True` and the backend PyTorch picks, as transformers' SDPA path runs it
(cuDNN's attention on Hopper). Times are medians of one layer's call from `do_bench`,
which counts launch overhead (GPT-2's shape is host-bound there;
benchmarks.attention_libraries times from CUDA graphs and per SDPA backend); TFLOPS count
the causal half of QK^T and PV (4 * T^2 / 2 * head_dim * num_heads). The kernel's tile config per query length is `prefill_config`'s
(docs/kernels.md says how it was chosen).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from benchmarks.provenance import git_commit
from kernels.prefill_attention import paged_prefill_attention, prefill_config

BLOCK_SIZE = 16
# name -> (prompt tokens, num_heads, num_kv_heads, head_dim)
SHAPES = {
    "gpt2": (2048, 12, 12, 64),
    "qwen2.5-0.5b": (4096, 14, 2, 64),
    "llama3-8b": (8191, 32, 8, 128),
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
        "config": vars(prefill_config(tokens, head_dim)),
        "pagoda_us": round(us["pagoda"], 1),
        "sdpa_us": round(us["sdpa"], 1),
        "pagoda_tflops": round(flops / us["pagoda"] / 1e6, 1),
        "sdpa_tflops": round(flops / us["sdpa"] / 1e6, 1),
        "pagoda_vs_sdpa": round(us["pagoda"] / us["sdpa"], 3),
        "max_abs_diff": max_err,
    }


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
    result = {
        "benchmark": "prefill_attention",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": args.git_commit or git_commit(),
        "command": " ".join(["python -m benchmarks.prefill_attention", *sys.argv[1:]]),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
