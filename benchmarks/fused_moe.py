"""Fused-MoE kernel benchmark on the GPU: the Triton grouped GEMM against the torch
reference and against transformers' per-expert loop, for one MoE layer.

    python -m benchmarks.fused_moe --out benchmarks/results/fused-moe-h100.json [--sweep]
    python -m benchmarks.fused_moe --shape gpt-oss-20b --sweep

Shapes: Qwen3-30B-A3B's (128 experts, top-8, hidden 2048, expert intermediate 768) and
gpt-oss-20b's (32 experts, top-4, hidden 2880, intermediate 2880, with its expert biases
and clamped SwiGLU), bf16, at batch 1, 64 and 256 tokens; routing from random router
logits (near uniform). A decode
step's MoE layer is memory bound: its floor is the bytes of the experts the batch hits
(each read once) over the bandwidth of a large device-to-device copy in the same run.
The Triton path (alignment included) is timed replayed from a CUDA graph, as the engine
runs it; the reference and the loop read routing back to the host, so they cannot be
captured and are timed eagerly. All times are medians with L2 flushed between runs.
--sweep also times other tile configs of the Triton kernel (how to pick moe_config's).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from benchmarks.kernels import copy_bandwidth_gbps, graph_median_us
from benchmarks.provenance import git_commit, write_result
from kernels.activation import ClampedSwiGLU
from kernels.fused_moe import (
    ExpertBiases,
    MoeConfig,
    fused_moe,
    fused_moe_ref,
    moe_config,
    select_experts,
)

# name -> (experts, top_k, hidden, expert intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "gpt-oss-20b": (32, 4, 2880, 2880)}
BATCH_SIZES = [1, 64, 256]


def per_expert_loop(w13: torch.Tensor, w2: torch.Tensor, biases: ExpertBiases | None):
    """transformers' experts module (a loop over the experts hit) on the same weights:
    Qwen3-MoE's, or GPT-OSS's (gate/up interleaved, [E, in, out]) where there are biases.
    Called as loop(x, ids, weights)."""
    num_experts, hidden, inter = w2.shape
    if biases is None:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts
        )
        experts = Qwen3MoeExperts(config).to(device=w13.device, dtype=w13.dtype)
        experts.gate_up_proj.data = w13  # the same [E, 2 * inter, hidden] layout as ours
        experts.down_proj.data = w2
        return experts
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts
    )
    experts = GptOssExperts(config).to(device=w13.device, dtype=w13.dtype)
    gate, up = w13.transpose(1, 2).chunk(2, dim=-1)  # [E, hidden, inter] each
    experts.gate_up_proj.data = torch.stack([gate, up], dim=-1).flatten(-2).contiguous()
    gate_b, up_b = biases.b13.chunk(2, dim=-1)
    experts.gate_up_proj_bias.data = torch.stack([gate_b, up_b], dim=-1).flatten(-2)
    experts.down_proj.data = w2.transpose(1, 2).contiguous()
    experts.down_proj_bias.data = biases.b2
    return experts


def sweep(batch, x, w13, w2, weights, ids, extras, floor_us: float) -> list[dict]:
    rows = []
    for block_m, block_n, block_k, num_stages in itertools.product(
        (16, 32, 64), (32, 64, 128), (64, 128), (3, 4)
    ):
        config = MoeConfig(block_m, block_n, block_k, num_warps=4, num_stages=num_stages)
        try:
            us = graph_median_us(
                lambda c=config: fused_moe(x, w13, w2, weights, ids, *extras, config=c)
            )
        except OutOfResources:  # more shared memory than the GPU has: not a candidate
            continue
        rows.append({"batch": batch, **config.__dict__, "us": us, "vs_floor": us / floor_us})
    return sorted(rows, key=lambda r: r["us"])


def bench(shape: str, batch: int, peak_gbps: float, gen: torch.Generator, tiles: bool) -> dict:
    dtype, device = torch.bfloat16, "cuda"
    num_experts, top_k, hidden, inter = SHAPES[shape]

    def randn(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=device, generator=gen) * 0.02).to(dtype)

    w13, w2 = randn(num_experts, 2 * inter, hidden), randn(num_experts, hidden, inter)
    x = torch.randn(batch, hidden, device=device, generator=gen).to(dtype)
    logits = torch.randn(batch, num_experts, device=device, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    experts_hit = ids.unique().numel()
    expert_bytes = (w13[0].nbytes + w2[0].nbytes) * experts_hit
    floor_us = expert_bytes / peak_gbps / 1e3
    biases, clamped = None, None
    if shape == "gpt-oss-20b":
        biases = ExpertBiases(randn(num_experts, 2 * inter), randn(num_experts, hidden))
        clamped = ClampedSwiGLU(alpha=1.702, limit=7.0)
    extras = (biases, clamped)

    loop = per_expert_loop(w13, w2, biases)
    with torch.no_grad():
        out = fused_moe(x, w13, w2, weights, ids, *extras)
        ref = fused_moe_ref(x, w13, w2, weights, ids, *extras)
        hf = loop(x, ids, weights.to(dtype))
        triton_us = graph_median_us(lambda: fused_moe(x, w13, w2, weights, ids, *extras))
        ref_us = 1e3 * do_bench(
            lambda: fused_moe_ref(x, w13, w2, weights, ids, *extras), return_mode="median"
        )
        loop_us = 1e3 * do_bench(lambda: loop(x, ids, weights.to(dtype)), return_mode="median")
    row = {
        "batch": batch,
        "config": moe_config(batch * top_k, num_experts).__dict__,
        "experts_hit": experts_hit,
        "floor_us": floor_us,
        "triton_us": triton_us,
        "reference_us": ref_us,
        "per_expert_loop_us": loop_us,
        "triton_vs_floor": triton_us / floor_us,
        "triton_gbps": expert_bytes / triton_us / 1e3,
        "speedup_vs_reference": ref_us / triton_us,
        "speedup_vs_per_expert_loop": loop_us / triton_us,
        "max_abs_diff_vs_reference": (out.float() - ref.float()).abs().max().item(),
        "max_abs_diff_vs_transformers": (out.float() - hf.float()).abs().max().item(),
        "reference_abs_max": ref.float().abs().max().item(),
    }
    if tiles:
        with torch.no_grad():
            row["sweep"] = sweep(batch, x, w13, w2, weights, ids, extras, floor_us)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    args = p.parse_args(argv)
    peak = copy_bandwidth_gbps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [bench(args.shape, batch, peak, gen, args.sweep) for batch in BATCH_SIZES]
    num_experts, top_k, hidden, inter = SHAPES[args.shape]
    result = {
        "benchmark": "fused_moe",
        "command": "python -m benchmarks.fused_moe "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {
            "name": args.shape,
            "experts": num_experts,
            "top_k": top_k,
            "hidden": hidden,
            "inter": inter,
        },
        "dtype": "bfloat16",
        "copy_bandwidth_gbps": peak,
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    for r in rows:
        print(
            f"batch {r['batch']:>3}: triton {r['triton_us']:8.1f} us "
            f"({r['triton_vs_floor']:.2f}x floor), reference {r['reference_us']:8.1f} us, "
            f"per-expert loop {r['per_expert_loop_us']:8.1f} us"
        )
        if args.sweep:
            best = r["sweep"][0]
            print(f"  best tiles: {best}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
