"""Kernels compiled ahead of time for an H100 (sm_90), no GPU needed: Triton's
interpreter runs Python, so it accepts code the compiler rejects (a loop-carried
variable changing dtype across a constexpr branch, or a global that is not a constexpr).
Here the variants that only the FP8 paths take (the quantizer, e4m3 dots, a norm and
the gated activation quantizing their rows), the split-K epilogues adding LoRA deltas and keeping a shrink's row groups, the decode attention rotating q and K
itself (with GPT-OSS's sinks in one variant), GPT-OSS's MoE launches and DeepSeek-V2's group-limited routing, MLA's latent store and attention (one row a sequence, split or
not, storing the new rows itself, and query tiles), the greedy-ids kernels (a global constant; with and without a bitmask,
whole or picked by row from a table), and the recurrent layers' decode steps and prompt walks,
each compiled through to a cubin, in a child process: this one's kernels were
re-decorated for the interpreter (conftest). Compiled with the alignment hints a launch
gives, the decode attention's and the split-K GEMM's tiles must stream in as 16-byte
async copies (the PTX is read for it)."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.hopper_compile import by_name, compile_for_hopper


def assert_tiles_stream(ptx: str) -> None:
    """The tiles reach shared memory as 16-byte async copies, not one load a value: a
    mask or offset the compiler cannot prove contiguous does that, 256 byte loads a
    thread for an e4m3 128 x 128 tile. (A few halfword loads are the new token's rows.)"""
    assert "cp.async.cg.shared.global" in ptx
    assert ptx.count("ld.global.b8") + ptx.count("ld.global.u8") == 0
    assert ptx.count("ld.global.b16") + ptx.count("ld.global.u16") < 16


# The split-K GEMM's int arguments a launch passes as multiples of 16.
SPLITK_ALIGNED = {"N", "K", "stride_xm", "stride_wn", "stride_om", "stride_ps", "stride_pm"}


def splitk_signature(fp8: bool) -> dict[str, str]:
    """The split-K GEMM's arguments, x and the weight in e4m3 or bf16."""
    x = "*fp8e4nv" if fp8 else "*bf16"
    signature = {"x_ptr": x, "weight_ptr": x}
    signature |= {"scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "bias_ptr": "*bf16"}
    signature |= {"out_ptr": "*bf16", "partials_ptr": "*fp32", "counters_ptr": "*i32"}
    signature |= {"lora_shrink_ptr": "*bf16", "lora_b_ptr": "*bf16", "lora_ids_ptr": "*i64"}
    names = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_ps", "stride_pm")
    return signature | {name: "i32" for name in (*names, "lora_adapters", "lora_group")}


def compile_variants() -> None:
    """Run in the child: print one line per variant compiled."""
    from kernels.argmax import _chunk_argmax_kernel, _row_argmax_kernel
    from kernels.fp8 import _per_token_quant_kernel
    from kernels.linear import _splitk_linear_kernel

    for one_tile in (True, False):
        signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        signature |= {"K": "i32", "stride_xm": "i32", "stride_qm": "i32"}
        constexprs = {"BLOCK_K": 4096 if one_tile else 2048, "ONE_TILE": one_tile, "PDL": True}
        assert "cubin" in compile_for_hopper(_per_token_quant_kernel, signature, constexprs).asm
        print(f"quantizer one_tile={one_tile}")
    for fp8, lora, keep, defer in ((True, False, False, False), (True, True, False, False),
                                   (False, True, False, False), (False, False, True, False),
                                   (True, False, False, True)):  # fmt: skip
        signature = splitk_signature(fp8)
        constexprs = {"FP8": fp8, "HAS_BIAS": True, "LORA": lora, "LORA_BLOCK": 64}
        constexprs |= {"KEEP_GROUP": keep, "GELU_TANH": False}
        constexprs |= {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256 if fp8 else 128}
        constexprs |= {"NUM_SPLITS": 2, "DEFER": defer, "DOT_PRECISION": "tf32", "PDL": True}
        kernel = compile_for_hopper(_splitk_linear_kernel, signature, constexprs, SPLITK_ALIGNED)
        ptx = kernel.asm["ptx"]
        if not lora:  # the adapters' rows are gathered by id, a value at a time
            assert_tiles_stream(ptx)
            if fp8:  # e4m3 by e4m3 dots (wgmma) widen nothing.
                assert "wgmma.mma" in ptx and ".e4m3x2" not in ptx
        if defer:  # the splits left unsummed: no arrival counter
            assert "atom." not in ptx
        print(f"split-K fp8={fp8} lora={lora} keep={keep} defer={defer}")
    compile_fp8_producers()
    print("norm and activation fp8_out")
    for kv_fp8, norm in ((False, False), (True, True)):
        compile_decode_with_rope(kv_fp8, norm)
        print(f"decode rope kv_fp8={kv_fp8} norm={norm}")
    # masked: a grammar's token bitmask; selected: rows picked from the host's table.
    for masked, selected in ((False, False), (True, False), (True, True)):
        signature = {"logits_ptr": "*bf16", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32"}
        signature |= {"bitmask_ptr": "*i32" if masked else "*bf16"}
        signature |= {"select_ptr": "*i32" if selected else "*bf16"}
        names = ("vocab", "num_chunks", "stride_row", "stride_mask_row", "mask_words")
        signature |= {name: "i32" for name in (*names, "stride_select")}
        constexprs = {"BLOCK": 2048, "TILES": 4, "MASKED": masked, "SELECTED": selected}
        compile_for_hopper(_chunk_argmax_kernel, signature, constexprs)
    signature = {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "out_ptr": "*i64"}
    compile_for_hopper(_row_argmax_kernel, signature | {"num_chunks": "i32"}, {"CHUNKS_P2": 32})
    print("greedy ids")
    compile_moe()
    print("moe")
    from kernels.mla import _mla_attention_kernel
    from kernels.mla_store import _mla_store_kernel

    constexprs = {"LATENT": 512, "LATENT_P2": 512, "ROPE": 64, "ROPE_P2": 64, "PDL": True}
    for kv_fp8 in (False, True):  # an e4m3 cache: the rows rounded as they are stored
        store = constexprs | {"KV_FP8": kv_fp8}
        cache = {"cache_ptr": "*fp8e4nv" if kv_fp8 else "*bf16"}
        signature = by_name(_mla_store_kernel, store, cache, {"scale_inv"})
        compile_for_hopper(_mla_store_kernel, signature, store)
    variants = (
        (True, 1, False, False), (True, 8, False, False), (False, 1, False, False),
        (True, 1, True, False), (True, 8, False, True), (True, 1, True, True),
    )  # fmt: skip
    floats = {"qk_scale", "out_scale", "scale_inv", "norm_eps"}
    for one_per_seq, splits, kv_fp8, store_new in variants:
        block_q = 1 if one_per_seq else 4
        constexprs |= {"BLOCK_SIZE": 16, "HEADS": 16, "BLOCK_Q": block_q, "BLOCK_M": 16 * block_q}
        constexprs |= {"BLOCK_N": 32, "NUM_SPLITS": splits, "ONE_PER_SEQ": one_per_seq}
        constexprs |= {"KV_FP8": kv_fp8, "DOT_PRECISION": "tf32", "STORE_NEW": store_new}
        pointers = {name: "*i32" for name in ("block_table_ptr", "query_start_loc_ptr")}
        pointers |= {"seq_lens_ptr": "*i32", "split_out_ptr": "*fp32", "split_lse_ptr": "*fp32"}
        pointers |= {"cache_ptr": "*fp8e4nv" if kv_fp8 else "*bf16", "cos_sin_ptr": "*fp32"}
        pointers |= {"positions_ptr": "*i64", "slot_mapping_ptr": "*i64"}
        signature = by_name(_mla_attention_kernel, constexprs, pointers, floats)
        ptx = compile_for_hopper(_mla_attention_kernel, signature, constexprs).asm["ptx"]
        assert "wgmma.mma" in ptx or "mma.sync" in ptx
        print(f"mla one_per_seq={one_per_seq} splits={splits} kv_fp8={kv_fp8} new={store_new}")
    compile_recurrent()
    print("recurrent steps and prompt walks")


def compile_recurrent() -> None:
    """The DeltaNet's and Mamba-2's decode steps and prompt walks (a loop over a
    sequence's tokens, its bounds loaded, the state slice carried through a helper), and
    the convolution over a step's tokens and its states' update."""
    from kernels.conv_step import _conv_states_kernel, _conv_tokens_kernel
    from kernels.gated_delta import _gated_delta_step_kernel, _gated_delta_tokens_kernel
    from kernels.mamba2_step import _mamba2_step_kernel, _mamba2_tokens_kernel

    pointers = {"state_ptr": "*fp32", "slots_ptr": "*i64", "has_state_ptr": "*i1"}
    pointers |= {"lengths_ptr": "*i32", "starts_ptr": "*i32", "out_ptr": "*fp32"}
    pointers |= {"a_log_ptr": "*fp32", "d_ptr": "*fp32", "token_seqs_ptr": "*i64"}
    delta = {"REPEAT": 2, "K_DIM": 128, "V_DIM": 128, "BLOCK_V": 32}
    mamba = {"PER_GROUP": 16, "D_STATE": 128, "HEAD_DIM": 64, "BLOCK_P": 32}
    conv = {"KERNEL": 4, "BLOCK_C": 128}
    for kernel, constexprs, floats in (
        (_gated_delta_step_kernel, delta | {"PDL": True}, {"q_scale"}),
        (_gated_delta_tokens_kernel, delta, {"q_scale"}),
        (_mamba2_step_kernel, mamba | {"PDL": True}, {"dt_min", "dt_max"}),
        (_mamba2_tokens_kernel, mamba, {"dt_min", "dt_max"}),
        (_conv_tokens_kernel, conv | {"HAS_BIAS": True, "SILU": True, "BLOCK_T": 16}, set()),
        (_conv_states_kernel, conv | {"TAPS": 4}, set()),
    ):
        signature = by_name(kernel, constexprs, pointers, floats)
        assert "cubin" in compile_for_hopper(kernel, signature, dict(constexprs)).asm


def compile_moe() -> None:
    """GPT-OSS's MoE launches (expert biases, the clamped SwiGLU): the grouped GEMM's
    gate/up on FP8 experts (e4m3 dots; and Nemotron 3's ungated one), the per-pair GEMV's
    gate/up (bf16) and its down summing a token's four pairs (FP8), the routing kernel,
    and the pairs' grouping by expert."""
    from kernels.fused_moe import _grouped_gemm_kernel
    from kernels.moe_align import _align_kernel
    from kernels.moe_gemv import _pair_gemv_kernel
    from kernels.moe_routing import _topk_softmax_kernel

    pointers = {"topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32"}
    pointers |= {"num_padded_ptr": "*i32", "ids_ptr": "*i64", "partials_ptr": "*fp32"}
    pointers |= {"counters_ptr": "*i32", "scale_ptr": "*fp32"}
    fp8 = pointers | {"w_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32"}
    # GPT-OSS's clamped SwiGLU at decode's 16-row tiles (mma.sync); Nemotron 3's ungated
    # relu^2 (no up rows) at prefill's 64-row tiles (wgmma).
    for act, block_m in ((1, 16), (3, 64)):
        constexprs = {"A_ROW_DIV": 4, "GATED": True, "UP": act != 3, "ACT": act}
        constexprs |= {"BIAS": act == 1, "SCALED": True, "MUL_WEIGHT": False}
        constexprs |= {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64}
        constexprs |= {"DOT_PRECISION": "tf32"}
        types = fp8 | {"a_ptr": "*fp8e4nv"}
        signature = by_name(_grouped_gemm_kernel, constexprs, types, {"alpha", "limit"})
        asm = compile_for_hopper(_grouped_gemm_kernel, signature, constexprs).asm
        if block_m == 64:  # wgmma takes e4m3 as it is (16-row mma.sync tiles widen it)
            assert "wgmma.mma" in asm["ptx"] and ".e4m3x2" not in asm["ptx"]
        assert "cubin" in asm
    for gated in (True, False):
        constexprs = {"A_ROW_DIV": 4 if gated else 1, "TOP_K": 1 if gated else 4}
        constexprs |= {"GATED": gated, "UP": gated, "ACT": int(gated), "BIAS": True}
        constexprs |= {"WEIGHTED": not gated}
        constexprs |= {"SCALED": not gated, "BLOCK_N": 32, "BLOCK_K": 128, "NUM_SPLITS": 2}
        constexprs |= {"DOT_PRECISION": "tf32"}
        types = pointers if gated else fp8
        signature = by_name(_pair_gemv_kernel, constexprs, types, {"alpha", "limit"})
        assert "cubin" in compile_for_hopper(_pair_gemv_kernel, signature, constexprs).asm
    for groups in (1, 8):  # Qwen3-MoE's and gpt-oss's; DeepSeek-V2's group-limited
        constexprs = {"TOP_K": 6, "TOP_K_P2": 8, "RENORMALIZE": groups == 1, "BLOCK_E": 256}
        constexprs |= {"NUM_GROUPS": groups, "TOPK_GROUPS": 3}
        signature = by_name(
            _topk_softmax_kernel, constexprs, {"weights_ptr": "*fp32", "ids_ptr": "*i64"}, {"scale"}
        )
        assert "cubin" in compile_for_hopper(_topk_softmax_kernel, signature, constexprs).asm
    constexprs = {"PAIRS_P2": 512, "FILL": 1024, "PDL": True}
    signature = by_name(_align_kernel, constexprs, pointers)
    assert "cubin" in compile_for_hopper(_align_kernel, signature, constexprs).asm


def compile_fp8_producers() -> None:
    """The norm and the gated activation writing e4m3 rows and their scales."""
    from kernels.activation import _act_and_mul_kernel
    from kernels.norms import _add_norm_kernel

    for parts in (1, 2):  # x a projection's output, or its two splits (fp32) to sum
        names = ("residual_ptr", "weight_ptr", "bias_ptr", "residual_out_ptr")
        signature = {"x_ptr": "*bf16" if parts == 1 else "*fp32"}
        signature |= {name: "*bf16" for name in names}
        signature |= {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "num_cols": "i32"}
        signature |= {"eps": "fp32", "stride_x": "i32", "stride_residual": "i32"}
        signature |= {"stride_part": "i32"}
        constexprs = {"PARTS": parts, "HAS_RESIDUAL": True, "HAS_BIAS": False, "RMS": True}
        constexprs |= {"FP8_OUT": True, "BLOCK": 4096, "PDL": True}
        assert "cubin" in compile_for_hopper(_add_norm_kernel, signature, constexprs).asm
    signature = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    signature |= {"inter": "i32", "stride_x": "i32"}
    constexprs = {"GELU_TANH": False, "FP8_OUT": True, "BLOCK": 16384, "PDL": True}
    assert "cubin" in compile_for_hopper(_act_and_mul_kernel, signature, constexprs).asm


def compile_decode_with_rope(kv_fp8: bool, norm: bool) -> None:
    """The decode kernel rotating q and the new K itself (a Llama-3-8B layer's shape)."""
    from kernels.paged_attention import _decode_kernel

    pointers = {"k_cache_ptr": "*fp8e4nv" if kv_fp8 else "*bf16", "block_table_ptr": "*i32"}
    pointers |= {"context_lens_ptr": "*i32", "slot_mapping_ptr": "*i64", "positions_ptr": "*i64"}
    pointers |= {"cos_sin_ptr": "*fp32", "split_out_ptr": "*fp32", "split_lse_ptr": "*fp32"}
    pointers["v_cache_ptr"] = pointers["k_cache_ptr"]
    floats = {"qk_scale", "out_scale", "k_scale_inv", "v_scale_inv", "norm_eps"}
    constexprs = {"GROUP": 4, "GROUP_PAD": 16, "PACK": 1, "HEAD_DIM": 128, "HEAD_DIM_P2": 128}
    constexprs |= {"BLOCK_SIZE": 16, "BLOCK_N": 64, "IS_SPLIT": True, "STORE_NEW": True}
    constexprs |= {"KV_FP8": kv_fp8, "ROPE": True, "ROPE_NORM": norm}
    constexprs |= {"SOFT_CAP": False, "SINKS": kv_fp8}  # GPT-OSS's sinks in one variant
    constexprs |= {"DOT_PRECISION": "tf32", "PDL": True}
    signature = by_name(_decode_kernel, constexprs, pointers, floats | {"softcap"})
    # Every stride but the block table's, whose width is the longest sequence's blocks.
    strides = {name for name in signature if name.startswith("stride_")} - {"stride_bts"}
    assert_tiles_stream(
        compile_for_hopper(_decode_kernel, signature, constexprs, strides).asm["ptx"]
    )


def compiled_in_child(code: str) -> str:
    """Run Python `code` in a child process and return what it printed: this process's
    kernels were re-decorated for the interpreter (conftest), the child's compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_kernel_variants_compile_for_hopper() -> None:
    code = "from tests.kernels.test_compiles_for_hopper import compile_variants; compile_variants()"
    assert compiled_in_child(code).split("\n")[:19] == [
        "quantizer one_tile=True",
        "quantizer one_tile=False",
        "split-K fp8=True lora=False keep=False defer=False",
        "split-K fp8=True lora=True keep=False defer=False",
        "split-K fp8=False lora=True keep=False defer=False",
        "split-K fp8=False lora=False keep=True defer=False",
        "split-K fp8=True lora=False keep=False defer=True",
        "norm and activation fp8_out",
        "decode rope kv_fp8=False norm=False",
        "decode rope kv_fp8=True norm=True",
        "greedy ids",
        "moe",
        "mla one_per_seq=True splits=1 kv_fp8=False new=False",
        "mla one_per_seq=True splits=8 kv_fp8=False new=False",
        "mla one_per_seq=False splits=1 kv_fp8=False new=False",
        "mla one_per_seq=True splits=1 kv_fp8=True new=False",
        "mla one_per_seq=True splits=8 kv_fp8=False new=True",
        "mla one_per_seq=True splits=1 kv_fp8=True new=True",
        "recurrent steps and prompt walks",
    ]
