"""fused_moe (Triton, grouped by expert) against fused_moe_ref, and the expert alignment."""

from __future__ import annotations

import dataclasses
from unittest.mock import patch

import pytest
import torch

from kernels.activation import ClampedSwiGLU, GeluTanhGLU, Relu2, expert_act_args
from kernels.fused_moe import (
    ExpertBiases,
    ExpertScales,
    MoeConfig,
    fused_moe,
    fused_moe_for,
    fused_moe_ref,
    select_experts,
)
from kernels.moe_align import align_by_expert, align_by_expert_ref
from kernels.moe_gemv import MAX_PAIRS


def uneven_topk_ids(num_tokens: int, top_k: int, num_experts: int, rng) -> torch.Tensor:
    """Expert 1 in every token's top-k, expert 0 in none, the rest spread at random."""
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for t in range(num_tokens):
        others = torch.randperm(num_experts - 2, generator=rng)[: top_k - 1] + 2
        ids[t] = torch.cat([torch.tensor([1]), others])[torch.randperm(top_k, generator=rng)]
    return ids


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_groups_every_pair_once_by_expert(block_m: int, rng: torch.Generator) -> None:
    num_experts, top_k = 6, 2
    topk_ids = uneven_topk_ids(37, top_k, num_experts, rng)
    sorted_ids, expert_ids, num_padded = align_by_expert_ref(topk_ids, num_experts, block_m)
    num_pairs = topk_ids.numel()
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert num_padded.item() == padded.sum().item()
    used = sorted_ids[: num_padded.item()]
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once
    assert (sorted_ids[num_padded.item() :] == num_pairs).all()
    flat = topk_ids.flatten()
    for tile, expert in enumerate(expert_ids[: num_padded.item() // block_m].tolist()):
        rows = used[tile * block_m : (tile + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert (flat[rows] == expert).all(), "a tile mixes experts"
    assert 0 not in expert_ids[: num_padded.item() // block_m].tolist()  # no tile for expert 0


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"),
    [(37, 2, 6, 16), (64, 6, 64, 64), (150, 4, 40, 16), (5, 8, 256, 16), (128, 8, 128, 16)],
)
def test_align_kernel_equals_the_reference(num_tokens, top_k, num_experts, block_m, rng, device):
    """The one-program kernel gives the torch version's three tensors exactly: pairs in
    stable order, padding rows, tile experts (tiles past the runs: the last expert), the
    row count. Shapes: pairs not a power of two, padded rows over several fill steps,
    experts not a power of two, experts with no pair, and more experts than pairs."""
    topk_ids = uneven_topk_ids(num_tokens, top_k, num_experts, rng)
    want = align_by_expert_ref(topk_ids, num_experts, block_m)
    with patch("kernels.moe_align.align_by_expert_ref", side_effect=AssertionError):
        got = align_by_expert(topk_ids.to(device), num_experts, block_m)  # the kernel's
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "config"),
    [
        (1, 2, None),
        (30, 2, None),  # moe_config's tiles of 16 rows (10 pairs an expert), 32, 64
        (37, 2, None),
        (70, 3, None),
        (37, 2, MoeConfig(block_m=16, block_n=32, block_k=16)),  # K loop over several tiles
    ],
)
def test_fused_moe_matches_reference_on_uneven_loads(
    num_tokens: int, top_k: int, config: MoeConfig | None, rng: torch.Generator, device
) -> None:
    # hidden and inter off the 64-wide tiles, so both masks are exercised.
    num_experts, hidden, inter = 6, 48, 40
    x = torch.randn(num_tokens, hidden, generator=rng)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=rng) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=rng) * inter**-0.5
    topk_ids = uneven_topk_ids(num_tokens, top_k, num_experts, rng)
    topk_weights = torch.rand(num_tokens, top_k, generator=rng)
    args = [t.to(device) for t in (x, w13, w2, topk_weights, topk_ids)]
    result = fused_moe(*args, config=config)
    expected = fused_moe_ref(*args)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)


def gated_experts(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    rng: torch.Generator,
    device: torch.device,
) -> list[torch.Tensor]:
    """x, w13, w2, routing weights and ids (uneven over the experts), gate and up values
    of std ~1.5: an activation's bends on both sides of 0 count."""
    x = torch.randn(num_tokens, hidden, generator=rng)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=rng) * 1.5 * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=rng) * inter**-0.5
    topk_ids = uneven_topk_ids(num_tokens, top_k, num_experts, rng)
    topk_weights = torch.rand(num_tokens, top_k, generator=rng)
    return [t.to(device) for t in (x, w13, w2, topk_weights, topk_ids)]


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fused_moe_biases_and_clamped_swiglu_match_reference(
    num_tokens: int, rng: torch.Generator, device
) -> None:
    # GPT-OSS's experts: biases on both projections, and a clamp (1.0) that the gate and
    # up values (std ~1.5) cross on both sides.
    num_experts, hidden, inter = 6, 48, 40
    b13 = torch.randn(num_experts, 2 * inter, generator=rng)
    b2 = torch.randn(num_experts, hidden, generator=rng)
    args = gated_experts(num_tokens, num_experts, hidden, inter, 2, rng, device)
    biases = ExpertBiases(b13.to(device), b2.to(device))
    clamped = ClampedSwiGLU(alpha=1.702, limit=1.0)
    result = fused_moe(*args, biases, clamped, config=MoeConfig(block_m=16, block_n=32))
    expected = fused_moe_ref(*args, biases, clamped)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    for other in (fused_moe_ref(*args, biases), fused_moe_ref(*args, None, clamped)):
        assert not torch.allclose(other, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_tokens", [1, 37])  # the pairs' GEMVs, the grouped GEMMs
def test_gelu_tanh_experts_match_reference(num_tokens: int, rng: torch.Generator, device) -> None:
    # Gemma 4's experts: gelu_tanh(gate) * up, gate values (std ~1.5) on both sides of 0.
    args = gated_experts(num_tokens, 6, 48, 40, 2, rng, device)
    expected = fused_moe_ref(*args, None, GeluTanhGLU())
    torch.testing.assert_close(
        fused_moe(*args, None, GeluTanhGLU()), expected, rtol=1e-4, atol=1e-5
    )
    assert not torch.allclose(fused_moe_ref(*args), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("num_tokens", "num_splits"), [(1, 1), (1, 3), (37, None)])
def test_ungated_relu2_experts_match_reference(
    num_tokens: int, num_splits: int | None, fp8: bool, rng: torch.Generator, device
) -> None:
    # Nemotron 3's experts: relu(up)^2, no gate rows in w13 ([experts, inter, hidden]); the
    # pairs' GEMVs over K splits and the grouped GEMMs, fp32 and e4m3 weights.
    num_experts, hidden, inter, top_k = 6, 300, 72, 4
    x, w13, w2, topk_weights, topk_ids = gated_experts(
        num_tokens, num_experts, hidden, inter, top_k, rng, device
    )
    w1 = w13[:, :inter].contiguous()
    scales = None
    w8a8 = fp8 and num_tokens * top_k > MAX_PAIRS  # the grouped GEMMs
    atol = 1e-4
    if fp8:
        x = e4m3_exact_rows(num_tokens, hidden, rng).to(device)
        q1, s1 = integer_experts(num_experts, inter, hidden, 2.0**-6, rng)
        q2, s2 = integer_experts(num_experts, hidden, inter, 2.0**-8, rng)
        w1, w2 = q1.to(device), q2.to(device)
        scales = ExpertScales(s1.to(device), s2.to(device))
    args = (x, w1, w2, topk_weights, topk_ids)
    expected = fused_moe_ref(*args, None, Relu2(), scales, w8a8=w8a8)
    with patch("kernels.moe_gemv._num_splits", lambda *_: num_splits or 1):
        result = fused_moe(*args, None, Relu2(), scales)
    if w8a8:  # the down GEMM's e4m3 sums are not exact on Hopper
        atol = 1e-3 * expected.abs().max().item()
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=atol)
    assert expected.abs().max() > 0.1


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_splits"), [(1, 4, 1), (1, 4, 3), (2, 4, 2), (1, 10, 2)]
)
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_decode_pairs_match_reference(
    num_tokens: int, top_k: int, num_splits: int, gpt_oss: bool, rng: torch.Generator, device
) -> None:
    # Up to MAX_PAIRS pairs: each its own GEMV over K splits; the two tokens of the third
    # case share an expert (1) and their other experts may coincide; the last is top-10.
    num_experts, hidden, inter = 12, 300, 72  # K of several 128-wide tiles, N off 64
    args = gated_experts(num_tokens, num_experts, hidden, inter, top_k, rng, device)
    biases, clamped = None, None
    if gpt_oss:
        b13, b2 = torch.randn(num_experts, 2 * inter), torch.randn(num_experts, hidden)
        biases = ExpertBiases(b13.to(device), b2.to(device))
        clamped = ClampedSwiGLU(alpha=1.702, limit=1.0)
    expected = fused_moe_ref(*args, biases, clamped)
    with patch("kernels.moe_gemv._num_splits", lambda *_: num_splits):
        result = fused_moe(*args, biases, clamped)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert num_tokens * top_k <= MAX_PAIRS


def e4m3_exact_rows(num_rows: int, k: int, rng: torch.Generator) -> torch.Tensor:
    """Rows that per-row e4m3 quantization keeps exactly: integers up to 7 in size, one of
    them +-7, times a power of two a row (its scale r/64 maps n to 64n, all e4m3 values)."""
    ints = torch.randint(-7, 8, (num_rows, k), generator=rng).float()
    ints[:, 0] = 7.0 * (torch.rand(num_rows, generator=rng) - 0.5).sign()
    return ints * 2.0 ** torch.randint(-2, 3, (num_rows, 1), generator=rng)


def integer_experts(
    num_experts: int, n: int, k: int, scale: float, rng: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 experts [E, N, K] of integers up to 4 in size, and a power-of-two scale per
    (expert, row) near `scale` (a scale read from the wrong row shows). With
    `e4m3_exact_rows`, the gate/up dots' sums are exact in any order and in Hopper's e4m3
    accumulators, which hold less than fp32: the kernel and the reference agree on h
    before it is rounded to e4m3 again, where a 2^-13 difference could move it a step."""
    q = torch.randint(-4, 5, (num_experts, n, k), generator=rng).float()
    exponents = torch.randint(-1, 2, (num_experts, n), generator=rng).float()
    return q.to(torch.float8_e4m3fn), scale * 2.0**exponents


@pytest.mark.parametrize(
    ("num_tokens", "gpt_oss"), [(1, False), (1, True), (2, False), (37, False), (37, True)]
)
def test_fp8_experts_match_reference(
    num_tokens: int, gpt_oss: bool, rng: torch.Generator, device
) -> None:
    # e4m3 experts, scaled per (expert, row), through the per-pair GEMVs (up to 8 pairs:
    # gate/up's K in two splits, down's in one) and the grouped GEMMs (37 tokens: e4m3
    # dots); with GPT-OSS's biases and clamp or without.
    num_experts, hidden, inter, top_k = 6, 300, 72, 4
    x = e4m3_exact_rows(num_tokens, hidden, rng)
    q13, s13 = integer_experts(num_experts, 2 * inter, hidden, 2.0**-6, rng)
    q2, s2 = integer_experts(num_experts, hidden, inter, 2.0**-8, rng)
    topk_ids = uneven_topk_ids(num_tokens, top_k, num_experts, rng)
    topk_weights = torch.rand(num_tokens, top_k, generator=rng)
    args = [t.to(device) for t in (x, q13, q2, topk_weights, topk_ids)]
    scales = ExpertScales(s13.to(device), s2.to(device))
    biases, clamped = None, None
    if gpt_oss:
        b13, b2 = torch.randn(num_experts, 2 * inter), torch.randn(num_experts, hidden)
        biases = ExpertBiases(b13.to(device), b2.to(device))
        clamped = ClampedSwiGLU(alpha=1.702, limit=1.0)
    w8a8 = num_tokens * top_k > MAX_PAIRS  # the grouped GEMMs
    expected = fused_moe_ref(*args, biases, clamped, scales, w8a8=w8a8)
    result = fused_moe(*args, biases, clamped, scales)
    # The down GEMM's e4m3 sums are not exact on Hopper.
    atol = 1e-3 * expected.abs().max().item() if w8a8 else 1e-4
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=atol)
    # The reference is the dequantized weights' MoE, and a scale off by one row is not.
    w13 = q13.float() * s13[..., None]
    w2 = q2.float() * s2[..., None]
    dense = [t.to(device) for t in (x, w13, w2, topk_weights, topk_ids)]
    torch.testing.assert_close(expected, fused_moe_ref(*dense, biases, clamped, w8a8=w8a8))
    shifted = ExpertScales(scales.s13.roll(1, dims=1), scales.s2)
    assert not torch.allclose(fused_moe_ref(*args, biases, clamped, shifted, w8a8=w8a8), expected)


def test_an_activation_is_read_by_its_code_not_its_class() -> None:
    # The models take kernels/activation.py's classes before this directory's conftest
    # reloads it for the interpreter: an instance of the class as it was must still pass
    # its own activation to the kernels.
    before_reload = dataclasses.make_dataclass(
        "ClampedSwiGLU", ["alpha", "limit"], namespace={"CODE": ClampedSwiGLU.CODE}
    )
    assert expert_act_args(before_reload(1.702, 7.0)) == (1.702, 7.0, 1)
    assert expert_act_args(GeluTanhGLU())[2] == 2 and expert_act_args(None)[2] == 0


def test_clamped_swiglu_clamps_gate_above_and_up_both_ways() -> None:
    act = ClampedSwiGLU(alpha=2.0, limit=1.0)
    gate = torch.tensor([5.0, -5.0, 0.5])
    up = torch.tensor([-3.0, 3.0, 0.25])
    expected = torch.tensor(
        [
            0.0,
            2.0 * -5.0 * torch.sigmoid(torch.tensor(-10.0)),
            1.25 * 0.5 * torch.sigmoid(torch.tensor(1.0)),
        ]
    )
    torch.testing.assert_close(act(gate, up), expected)


def test_fused_moe_fp16_close_to_fp32(rng: torch.Generator, device: torch.device) -> None:
    num_experts, hidden, inter, num_tokens, top_k = 4, 64, 32, 20, 2
    x = torch.randn(num_tokens, hidden, generator=rng)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=rng) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=rng) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=rng)
    topk_weights, topk_ids = select_experts(logits, top_k, renormalize=True)
    args = [t.to(device) for t in (x, w13, w2)]
    routing = (topk_weights.to(device), topk_ids.to(device))
    result = fused_moe(*[t.half() for t in args], *routing)
    expected = fused_moe_ref(*args, *routing)
    assert result.dtype == torch.float16  # (the interpreter has no bf16 dot)
    torch.testing.assert_close(result.float(), expected, rtol=3e-2, atol=3e-2)


def test_select_experts_top_k_softmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))


def test_fused_moe_for_picks_reference_off_cuda() -> None:
    assert fused_moe_for(torch.device("cpu")) is fused_moe_ref


@pytest.mark.parametrize("gated", [True, False])
def test_fp8_experts_at_prefill_sizes_take_e4m3_dots(gated: bool, rng, device) -> None:
    # Past MAX_PAIRS pairs, x and each pair's h are quantized per row and the grouped
    # GEMMs' dots run on e4m3: the reference with both rows rounded so, and not the
    # weight-only one; at a run of 64-row tiles an expert (Hopper's wgmma).
    num_experts, hidden, inter, top_k, num_tokens = 4, 96, 80, 2, 131
    x = e4m3_exact_rows(num_tokens, hidden, rng)
    rows13 = (2 if gated else 1) * inter
    q13, s13 = integer_experts(num_experts, rows13, hidden, 2.0**-6, rng)
    q2, s2 = integer_experts(num_experts, hidden, inter, 2.0**-6, rng)
    scales = ExpertScales(s13.to(device), s2.to(device))
    topk_ids = uneven_topk_ids(num_tokens, top_k, num_experts, rng)
    topk_weights = torch.rand(num_tokens, top_k, generator=rng)
    args = [t.to(device) for t in (x, q13, q2, topk_weights, topk_ids)]
    act = None if gated else Relu2()
    expected = fused_moe_ref(*args, None, act, scales, w8a8=True)
    result = fused_moe(*args, None, act, scales, config=MoeConfig(block_m=64))
    # The down GEMM's e4m3 sums are not exact on Hopper.
    atol = 1e-3 * expected.abs().max().item()
    torch.testing.assert_close(result, expected, rtol=1e-3, atol=atol)
    weight_only = fused_moe_ref(*args, None, act, scales)
    assert (result - weight_only).abs().max() > 10 * (result - expected).abs().max()
