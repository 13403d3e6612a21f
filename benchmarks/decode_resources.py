"""What each decode attention launch the engine picks holds on an H100's SM, from the
kernel compiled for sm_90 on the CPU (no GPU needed): registers and local memory (spills)
a thread, shared memory, and so the programs an SM holds, against the programs the grid
has. A grid past what 132 SMs hold at once runs a second wave that starts as the first
ends; a config that spills reads its registers back from local memory.

    python -m benchmarks.decode_resources --out FILE    # GPT-2, Qwen2.5-0.5B, Llama-3-8B
    python -m benchmarks.decode_resources --model gpt2 --batch 32 64 96 --kv-cache-dtype auto

Registers depend on the Triton version that compiles the kernel (recorded in the result).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest.mock import patch

import torch
import triton

from benchmarks.hopper_compile import Footprint, by_name, compile_for_hopper, footprint
from benchmarks.provenance import provenance, write_result
from benchmarks.shapes import CONFIGS
from engine.config import EngineConfig
from kernels.decode_config import DecodeConfig, decode_config
from kernels.paged_attention import head_pack

H100_SMS = 132
BLOCK_SIZE = EngineConfig.block_size  # the engine's default KV block
MAX_MODEL_LEN = 8192  # the block table's width: max_model_len's blocks


@dataclass(frozen=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: bool  # rotary applied by the attention kernel (every model here but GPT-2)

    @property
    def group(self) -> int:  # query heads a kv head serves
        return self.num_heads // self.num_kv_heads

    def pack(self, batch: int) -> int:  # kv heads a program reads (MHA's small heads)
        return head_pack(batch, self.num_kv_heads, self.group, self.head_dim, self.rope, H100_SMS)


def heads_of(model: str) -> Heads:
    config = CONFIGS[model]()
    num_heads = getattr(config, "num_attention_heads", None) or config.n_head
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    return Heads(num_heads, num_kv_heads, head_dim, rope=config.model_type != "gpt2")


def compile_decode(
    heads: Heads, pack: int, config: DecodeConfig, kv_fp8: bool, dtype: str
) -> Footprint:
    """The decode kernel as the engine launches it for these heads: storing the new
    K/V itself, rotating q and K where the model has rotary embeddings."""
    from kernels.paged_attention import _decode_kernel

    group = heads.group
    cache = "*fp8e4nv" if kv_fp8 else f"*{dtype}"
    pointers = {"k_cache_ptr": cache, "v_cache_ptr": cache, "block_table_ptr": "*i32"}
    pointers |= {"context_lens_ptr": "*i32", "slot_mapping_ptr": "*i64", "positions_ptr": "*i64"}
    pointers |= {"cos_sin_ptr": "*fp32", "split_out_ptr": "*fp32", "split_lse_ptr": "*fp32"}
    pointers |= {"sinks_ptr": "*fp32"}
    for name in ("query_ptr", "new_k_ptr", "new_v_ptr", "out_ptr", "q_norm_ptr", "k_norm_ptr"):
        pointers[name] = f"*{dtype}"
    floats = {"qk_scale", "out_scale", "k_scale_inv", "v_scale_inv", "norm_eps", "softcap"}
    constexprs = {"GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group * pack))}
    constexprs |= {"PACK": pack}
    constexprs |= {"HEAD_DIM": heads.head_dim}
    constexprs |= {"HEAD_DIM_P2": triton.next_power_of_2(heads.head_dim)}
    constexprs |= {"BLOCK_SIZE": BLOCK_SIZE, "BLOCK_N": config.block_n}
    constexprs |= {"IS_SPLIT": config.num_splits > 1, "STORE_NEW": True, "KV_FP8": kv_fp8}
    constexprs |= {"ROPE": heads.rope, "ROPE_NORM": False, "SOFT_CAP": False, "SINKS": False}
    constexprs |= {"DOT_PRECISION": "tf32", "PDL": True}
    signature = by_name(_decode_kernel, constexprs, pointers, floats)
    strides = {name for name in signature if name.startswith("stride_")} - {"stride_bts"}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    kernel = compile_for_hopper(_decode_kernel, signature, constexprs, strides, options)
    return footprint(kernel)


def rows_for(model: str, batches: list[int], kv_fp8: bool) -> list[dict]:
    heads = heads_of(model)
    dtype = "fp16" if model == "gpt2" else "bf16"
    rows, compiled = [], {}
    for batch in batches:
        pack = heads.pack(batch)
        with patch("kernels.decode_config.num_sms_of", lambda _: H100_SMS):
            config = decode_config(
                batch, heads.num_kv_heads // pack, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE,
                torch.device("cuda"), heads.group * pack, heads.head_dim * pack, kv_fp8,
            )  # fmt: skip
        if (pack, config) not in compiled:
            compiled[pack, config] = compile_decode(heads, pack, config, kv_fp8, dtype)
        fp = compiled[pack, config]
        programs = batch * heads.num_kv_heads // pack * config.num_splits
        per_sm = fp.programs_per_sm()
        rows.append(
            {"batch": batch, "config": asdict(config), **asdict(fp), "programs_per_sm": per_sm}
            | {"programs": programs, "waves": round(programs / (per_sm * H100_SMS), 2)}
        )
        cache = " e4m3" if kv_fp8 else ""
        print(
            f"{model}{cache} batch {batch}: splits {config.num_splits}, "
            f"{config.block_n}-token tiles, {config.num_warps} warps, {config.num_stages} stages: "
            f"{fp.registers} registers, "
            f"{fp.local_bytes} B local, {fp.shared_bytes} B shared -> {per_sm} programs an SM; "
            f"{programs} programs, {rows[-1]['waves']} waves",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=sorted(CONFIGS), default=None)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], nargs="+", default=["auto", "fp8"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        p.error("TRITON_INTERPRET is set: the interpreter compiles nothing")
    result = provenance("decode_resources", argv) | {
        "triton": triton.__version__,
        "target": "sm_90, 132 SMs",
        "runs": {
            f"{model}, kv {kv}": rows_for(model, args.batch, kv == "fp8")
            for model in args.model or ["gpt2", "qwen2-0.5b", "llama3-8b"]
            for kv in args.kv_cache_dtype
        },
    }
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
