"""Kernels compiled ahead of time for an H100 (sm_90), no GPU needed: Triton's
interpreter runs Python, so it accepts code the compiler rejects (a loop-carried
variable changing dtype across a constexpr branch, or a global that is not a constexpr).
Here the variants that only the FP8 paths take, and the greedy-ids kernels (a global
constant), each compiled through to a cubin, in a child process: this one's kernels were
re-decorated for the interpreter (conftest)."""

from __future__ import annotations

import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(fn, signature: dict[str, str], constexprs: dict[str, object]) -> dict:
    for name in constexprs:
        signature[name] = "constexpr"
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=HOPPER).asm


def compile_variants() -> None:
    """Run in the child: print one line per variant compiled."""
    from kernels.argmax import _chunk_argmax_kernel, _row_argmax_kernel
    from kernels.fp8 import _per_token_quant_kernel
    from kernels.linear import _splitk_linear_kernel

    for one_tile in (True, False):
        signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        signature |= {"K": "i32", "stride_xm": "i32", "stride_qm": "i32"}
        constexprs = {"BLOCK_K": 4096 if one_tile else 2048, "ONE_TILE": one_tile}
        assert "cubin" in compile_for_hopper(_per_token_quant_kernel, signature, constexprs)
        print(f"quantizer one_tile={one_tile}")
    for x_scale in (True, False):
        signature = {"x_ptr": "*fp8e4nv" if x_scale else "*bf16", "weight_ptr": "*fp8e4nv"}
        signature |= {"scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "bias_ptr": "*bf16"}
        signature |= {"out_ptr": "*bf16", "partials_ptr": "*fp32", "counters_ptr": "*i32"}
        names = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_ps", "stride_pm")
        signature |= {name: "i32" for name in names}
        constexprs = {"HAS_SCALE": True, "X_SCALE": x_scale, "HAS_BIAS": True, "BLOCK_M": 64}
        constexprs |= {"BLOCK_N": 64, "BLOCK_K": 256, "NUM_SPLITS": 2, "DOT_PRECISION": "tf32"}
        constexprs |= {"PDL": True}
        ptx = compile_for_hopper(_splitk_linear_kernel, signature, constexprs)["ptx"]
        # e4m3 by e4m3 dots (wgmma) widen nothing; weight-only FP8 widens the weights.
        widened = ".e4m3x2" in ptx
        assert "wgmma.mma" in ptx and widened != x_scale
        print(f"split-K x_scale={x_scale}")
    signature = {"logits_ptr": "*bf16", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32"}
    signature |= {"vocab": "i32", "num_chunks": "i32", "stride_row": "i32"}
    compile_for_hopper(_chunk_argmax_kernel, signature, {"BLOCK": 2048, "TILES": 4})
    signature = {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "out_ptr": "*i64"}
    compile_for_hopper(_row_argmax_kernel, signature | {"num_chunks": "i32"}, {"CHUNKS_P2": 32})
    print("greedy ids")


def test_kernel_variants_compile_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernels.test_compiles_for_hopper import compile_variants; compile_variants()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:5] == [
        "quantizer one_tile=True",
        "quantizer one_tile=False",
        "split-K x_scale=True",
        "split-K x_scale=False",
        "greedy ids",
    ]
