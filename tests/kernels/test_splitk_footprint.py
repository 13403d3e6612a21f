"""The split-K GEMM's many-row launches as the engine configures them on an H100 or H200
(`splitk_configs`, 132 SMs), compiled for sm_90 on the CPU: each must fit an SM. A
config past Hopper's shared memory only fails at launch, on a GPU; here it fails in CI."""

from __future__ import annotations

import json

from benchmarks.hopper_compile import SM90_SHARED_PER_PROGRAM
from tests.kernels.test_compiles_for_hopper import (
    SPLITK_ALIGNED,
    compiled_in_child,
    splitk_signature,
)

# [n, k] weights: Llama-3-8B's qkv, o, gate_up and down, GPT-2's qkv and mlp_proj,
# Qwen2.5-0.5B's down.
SHAPES = {
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o": (4096, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
    "gpt2 qkv": (2304, 768),
    "gpt2 mlp_proj": (768, 3072),
    "qwen2-0.5b down": (896, 4864),
}


def launched(n: int, k: int) -> tuple[bool, ...]:
    """The dtypes whose [n, k] weight takes the kernel at 64 rows: FP8 always, bf16 where
    `dense` picks it (not the 8B's gate_up, which goes to cuBLAS)."""
    from kernels.linear import SPLITK_MAX_M, splitk_max_rows

    return (False, True) if splitk_max_rows(n, k, 2) >= SPLITK_MAX_M else (True,)


def compile_rows_launches() -> None:
    """Run in the child (this process's kernels were re-decorated for the interpreter):
    one JSON line per (shape, dtype) launch at 64 rows."""
    from benchmarks.hopper_compile import compile_for_hopper, footprint
    from kernels.linear import _splitk_linear_kernel, splitk_configs

    for name, (n, k) in SHAPES.items():
        for fp8 in launched(n, k):
            config = splitk_configs(n, k, fp8, sms=132, hopper=True)[1]
            signature = splitk_signature(fp8)
            constexprs = {"FP8": fp8, "HAS_BIAS": False, "LORA": False, "LORA_BLOCK": 16}
            constexprs |= {"KEEP_GROUP": False, "GELU_TANH": False, "BLOCK_M": 64}
            constexprs |= {"BLOCK_N": config.block_n}
            constexprs |= {"BLOCK_K": config.block_k, "NUM_SPLITS": config.num_splits}
            constexprs |= {"DEFER": False, "DOT_PRECISION": "tf32", "PDL": True}
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            kernel = compile_for_hopper(
                _splitk_linear_kernel, signature, constexprs, SPLITK_ALIGNED, options
            )
            used = footprint(kernel)
            row = {"shape": name, "fp8": fp8, "num_stages": config.num_stages}
            row |= {"shared_bytes": used.shared_bytes, "local_bytes": used.local_bytes}
            print(json.dumps(row | {"programs_per_sm": used.programs_per_sm()}), flush=True)


def test_many_row_splitk_launches_fit_a_hopper_sm() -> None:
    code = "from tests.kernels.test_splitk_footprint import compile_rows_launches as c; c()"
    rows = [json.loads(line) for line in compiled_in_child(code).splitlines()]
    want = [(name, fp8) for name, shape in SHAPES.items() for fp8 in launched(*shape)]
    assert [(r["shape"], r["fp8"]) for r in rows] == want
    assert ("llama3-8b gate_up", False) not in want and len(want) == 13
    for row in rows:
        assert row["local_bytes"] == 0, row  # nothing spilled
        assert row["shared_bytes"] <= SM90_SHARED_PER_PROGRAM, row
        assert row["programs_per_sm"] >= 1, row
    by_shape = {(r["shape"], r["fp8"]): r for r in rows}
    # The 8B's bf16 o and down pipeline 5 stages of 64-row tiles (160 KB of them).
    for name in ("llama3-8b o", "llama3-8b down"):
        row = by_shape[(name, False)]
        assert row["num_stages"] == 5 and row["shared_bytes"] >= 5 * 32 * 1024, row
