"""paged_attention_decode (Triton, split-KV) against paged_attention_decode_ref."""

from __future__ import annotations

import functools
from unittest.mock import patch

import pytest
import torch

from kernels.attention_ref import paged_attention_decode_ref
from kernels.decode_config import DecodeConfig, decode_config, decode_workspace
from kernels.paged_attention import head_pack, paged_attention_decode, paged_attention_decode_for
from kernels.rotary import QKNorm, Rope, rotary
from kernels.score_mods import softmax_with_sinks
from tests.kernels.test_rotary import cos_sin_cache

# (num_heads, num_kv_heads, head_dim, block_size, num_splits): GPT-2 (two heads a program),
# six heads of 32 (two a program, as six do not pack by four), GQA groups of 4 and 7, a
# non-power-of-2 head_dim, both block sizes, with and without split-KV (the interpreter is
# slow, so a covering subset rather than the full product).
CASES = [
    (12, 12, 64, 16, 1),
    (12, 12, 64, 32, 3),
    (6, 6, 32, 16, 2),
    (8, 2, 32, 32, 1),
    (8, 2, 64, 16, 3),
    (8, 2, 80, 32, 3),
    (8, 2, 80, 16, 1),
    (14, 2, 64, 16, 3),
    (14, 2, 64, 32, 1),
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "num_splits"), CASES
)
def test_decode_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    # Ragged contexts: empty (a padded graph entry), 1 token, a block edge, many blocks,
    # whole tiles only (block_n 32: no partial tile).
    context_lens = [0, 1, block_size, 3 * block_size + 5, 200, 96]
    # Spare block-table columns, as in a CUDA-graph table sized for max_model_len.
    k_cache, v_cache, block_table = paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, max_blocks_per_seq=16
    )
    num_seqs = len(context_lens)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=rng).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    # NaN-poisoned outputs prove that every element is written.
    out = torch.full_like(query, float("nan"))
    workspace = decode_workspace(num_seqs, num_heads, head_dim, num_splits, device)
    for buffer in workspace:
        buffer.fill_(float("nan"))
    config = DecodeConfig(num_splits=num_splits, block_n=32)
    result = paged_attention_decode(
        query,
        k_cache,
        v_cache,
        block_table,
        lens,
        scale,
        out=out,
        config=config,
        workspace=workspace,
    )
    expected = paged_attention_decode_ref(query, k_cache, v_cache, block_table, lens, scale)
    assert result is out
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert not result[0].any()  # context_len 0 gives zeros


# The same factors for the fused store, pairwise covered in five cases: MHA and GQA 4,
# head_dim 64 and 80, block sizes 16 and 32, 1 and 3 splits.
STORE_CASES = [
    (12, 12, 64, 16, 1),
    (12, 12, 80, 32, 3),
    (8, 2, 64, 32, 3),
    (8, 2, 80, 16, 3),
    (8, 2, 80, 32, 1),
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "num_splits"), STORE_CASES
)
def test_decode_stores_new_kv_then_attends(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    # A padding row (context 0, slot -1), a new token opening the first block, ending a
    # block, opening the second, and in contexts whose last tile falls in split 1 of 3
    # (3 * block_size + 5 at block 32: tiles 0-1, 2-3, none) and in the last split (200).
    context_lens = [0, 1, block_size, block_size + 1, 3 * block_size + 5, 200]
    k_cache, v_cache, block_table = paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, max_blocks_per_seq=16
    )
    num_seqs = len(context_lens)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    positions = (lens - 1).clamp(min=0).long()  # the new tokens'
    blocks = block_table.long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = blocks * block_size + positions % block_size  # [num_seqs] int64, as the engine's
    slots[0] = -1  # the padding row
    # As the model passes them: views of one fused QKV projection, rows strided.
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_seqs, q_size + 2 * kv_size, generator=rng).to(device)
    query, new_k, new_v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.view(-1, num_heads, head_dim)  # [num_seqs, num_heads, head_dim]
    new_k = new_k.view(-1, num_kv_heads, head_dim)  # [num_seqs, num_kv_heads, head_dim]
    new_v = new_v.view(-1, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    # NaN in the new slots: attending to them before (or without) the store shows.
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots[1:]] = float("nan")
    # After the call: the new rows at their slots, every other element as it was.
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, num_kv_heads, head_dim)[slots[1:]] = new_k[1:]
    want_v.view(-1, num_kv_heads, head_dim)[slots[1:]] = new_v[1:]

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = paged_attention_decode_ref(
        query, ref_k, ref_v, block_table, lens, scale, new_k=new_k, new_v=new_v, slot_mapping=slots
    )
    out = torch.full_like(query, float("nan"))
    result = paged_attention_decode(
        query,
        k_cache,
        v_cache,
        block_table,
        lens,
        scale,
        out=out,
        config=DecodeConfig(num_splits=num_splits, block_n=32),
        new_k=new_k,
        new_v=new_v,
        slot_mapping=slots,
    )
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert not result[0].any()  # the padding row reads nothing
    for cache, want in ((k_cache, want_k), (v_cache, want_v), (ref_k, want_k), (ref_v, want_v)):
        torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("num_sms", "head_dim"), [(1, 64), (132, 64), (132, 256)])
def test_decode_default_config_and_strided_query(
    num_sms: int, head_dim: int, rng: torch.Generator, device: torch.device, paged_kv
) -> None:
    # On 132 SMs the six programs split as many ways as the table has 64-token tiles (3),
    # on 2 warps, or on 4 for 256-wide heads.
    context_lens = [70, 3, 129]
    k_cache, v_cache, block_table = paged_kv(context_lens, 2, head_dim, 16)
    # The query as a view into a fused QKV projection: [num_seqs, num_heads, head_dim].
    qkv = torch.randn(3, 8 + 2 * 2, head_dim, generator=rng).to(device)
    query = qkv[:, :8]
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    with patch("kernels.decode_config.num_sms_of", lambda _: num_sms):
        result = paged_attention_decode(query, k_cache, v_cache, block_table, lens, 0.125)
    expected = paged_attention_decode_ref(query, k_cache, v_cache, block_table, lens, 0.125)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("kv_fp8", "head_dim"), [(False, 128), (True, 128), (False, 256), (True, 256)]
)
def test_decode_config_splits_small_grids_to_a_few_programs_an_sm(
    kv_fp8: bool, head_dim: int
) -> None:
    # Llama-3-8B's heads (and Gemma's 256-wide ones) on 132 SMs: a grid of fewer programs
    # than a few an SM splits its keys by a power of two until it holds that many, never
    # more; a sliding window leaves each split two of its 64-token tiles or more.
    per_sm = 2 if head_dim > 128 else 6 if kv_fp8 else 4
    with patch("kernels.decode_config.num_sms_of", lambda _: 132):
        for num_seqs in (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256):
            config = decode_config(num_seqs, 8, 512, 16, torch.device("cuda"), 4, head_dim, kv_fp8)
            splits, grid = config.num_splits, num_seqs * 8 * config.num_splits
            assert splits & (splits - 1) == 0 and splits <= 64
            if splits == 1:
                assert 2 * num_seqs * 8 > per_sm * 132
            elif splits < 64:
                assert grid <= per_sm * 132 < 2 * grid
            for window in (128, 1024):
                windowed = decode_config(
                    num_seqs, 8, 512, 16, torch.device("cuda"), 4, head_dim, kv_fp8, window
                )
                assert windowed.num_splits == min(splits, window // 128)


def test_multi_head_programs_read_rows_of_128_values() -> None:
    # 256 of GPT-2's sequences on 132 SMs: 23 programs an SM a head each; 128 make 12.
    assert head_pack(256, 12, 1, 64, False, 132) == 2
    assert head_pack(128, 12, 1, 64, False, 132) == 1  # under 16 programs an SM
    assert head_pack(64, 6, 1, 32, False, 1) == 2 and head_pack(64, 8, 1, 32, False, 1) == 4
    assert head_pack(64, 12, 1, 16, False, 1) == 4  # eight would not divide twelve heads
    # Query groups share their kv head's rows already; rotary rotates each head alone;
    # 128-dim heads are rows of 128 already, and 80 dims do not tile by powers of two.
    for group, head_dim, rope in ((4, 64, False), (1, 64, True), (1, 128, False), (1, 80, False)):
        assert head_pack(64, 8, group, head_dim, rope, 1) == 1


def test_decode_for_picks_reference_off_cuda() -> None:
    assert paged_attention_decode_for(torch.device("cpu")) is paged_attention_decode_ref


def poison_outside_window(
    cache: torch.Tensor, block_table: torch.Tensor, context_lens: list[int], window: int
) -> None:
    """NaN into every cached key older than the window: a kernel that reads one shows."""
    block_size = cache.shape[1]
    for seq, n in enumerate(context_lens):
        for pos in range(max(n - window, 0)):
            cache[block_table[seq, pos // block_size].long(), pos % block_size] = float("nan")


# (window, block_size, num_splits): windows below, across, on and above a tile (block_n 32),
# with and without split-KV.
WINDOW_CASES = [(8, 16, 1), (8, 16, 3), (40, 32, 3), (100, 16, 2), (64, 16, 2)]


@pytest.mark.parametrize(("window", "block_size", "num_splits"), WINDOW_CASES)
def test_decode_sliding_window_matches_reference(
    window: int,
    block_size: int,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    # Contexts inside the window, on its edge, and several windows long; the fused store
    # writes each sequence's newest token (its owner split must still be inside the window).
    context_lens = [0, 5, window, window + 1, 3 * window + 7, 200]
    k_cache, v_cache, block_table = paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, max_blocks_per_seq=24
    )
    for cache in (k_cache, v_cache):
        poison_outside_window(cache, block_table, context_lens, window)
    num_seqs = len(context_lens)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    positions = (lens - 1).clamp(min=0).long()
    blocks = block_table.long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = blocks * block_size + positions % block_size
    slots[0] = -1
    query = torch.randn(num_seqs, num_heads, head_dim, generator=rng).to(device)
    new_k = torch.randn(num_seqs, num_kv_heads, head_dim, generator=rng).to(device)
    new_v = torch.randn(num_seqs, num_kv_heads, head_dim, generator=rng).to(device)
    kwargs = dict(new_k=new_k, new_v=new_v, slot_mapping=slots, sliding_window=window)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = paged_attention_decode_ref(query, ref_k, ref_v, block_table, lens, 0.2, **kwargs)
    result = paged_attention_decode(
        query,
        k_cache,
        v_cache,
        block_table,
        lens,
        0.2,
        config=DecodeConfig(num_splits=num_splits, block_n=32),
        **kwargs,
    )
    assert not expected.isnan().any()
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)


def score_mod(kind: str, num_heads: int, rng: torch.Generator, device) -> tuple[dict, float]:
    """(the kernels' keyword, the query's scale) of a score modifier: Gemma 2's soft-cap,
    small enough (scores up to ~10) that tanh saturates; or GPT-OSS's sinks, around the
    scores' size so that they take a visible share."""
    if kind == "softcap":
        return {"softcap": 2.0}, 3.0
    return {"sinks": torch.randn(num_heads, generator=rng).to(device) * 2}, 1.0


@pytest.mark.parametrize("kind", ["softcap", "sinks"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "num_splits"), [(4, 4, 1), (8, 2, 3)])
def test_decode_score_mods_match_reference(
    kind: str,
    num_heads: int,
    num_kv_heads: int,
    num_splits: int,
    rng: torch.Generator,
    device,
    paged_kv,
) -> None:
    # Split 0 of the split launch counts the sinks; a context of 0 stays zeros.
    head_dim, block_size = 32, 16
    context_lens = [0, 1, 3 * block_size + 5, 90]
    k_cache, v_cache, block_table = paged_kv(context_lens, num_kv_heads, head_dim, block_size)
    mod, query_scale = score_mod(kind, num_heads, rng, device)
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=rng).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    args = (query * query_scale, k_cache, v_cache, block_table, lens, 0.5)
    config = DecodeConfig(num_splits=num_splits, block_n=32)
    result = paged_attention_decode(*args, config=config, **mod)
    expected = paged_attention_decode_ref(*args, **mod)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(paged_attention_decode_ref(*args), expected, rtol=1e-2, atol=1e-2)
    assert expected[0].abs().max() == 0


def test_sinks_take_their_share_of_the_softmax() -> None:
    scores = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    sinks = torch.tensor([0.0, float("-inf")])
    probs = softmax_with_sinks(scores, sinks)
    torch.testing.assert_close(probs[0], torch.tensor([1 / 3, 1 / 3]))  # e^0 / (3 e^0)
    torch.testing.assert_close(probs[1], scores[1].softmax(-1))  # a -inf sink: none


# (num_heads, num_kv_heads, head_dim, num_splits, dtype, q/k norm): MHA and GQA, a head
# of 80 (its padded tail past the halves), split and not, with and without the norm. Not
# bf16: Triton's interpreter gets this kernel wrong in bf16 (compiled, it is right).
ROPE_CASES = [
    (4, 4, 64, 1, torch.float32, False),
    (8, 2, 80, 3, torch.float32, True),
    (8, 2, 64, 1, torch.float16, True),
    (4, 4, 64, 3, torch.float16, False),
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "num_splits", "dtype", "qk_norm"), ROPE_CASES
)
def test_decode_rotates_query_and_new_k_as_the_rotary_kernel_would(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_splits: int,
    dtype: torch.dtype,
    qk_norm: bool,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    """With rope, the kernel gives the bits of the rotary kernel followed by the kernel
    without it (close to them with the norm): the same output, the same rotated K stored,
    the query left as it was."""
    block_size = 16
    context_lens = [0, 1, block_size + 1, 70]
    k_cache, v_cache, block_table = paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, max_blocks_per_seq=8
    )
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    positions = (lens - 1).clamp(min=0).long()
    blocks = block_table.long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = blocks * block_size + positions % block_size
    slots[0] = -1
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (2 * torch.randn(len(context_lens), q_size + 2 * kv_size, generator=rng)).to(dtype)
    norm = None
    if qk_norm:
        weights = (1 + 0.1 * torch.randn(2, head_dim, generator=rng)).to(dtype).to(device)
        norm = QKNorm(weights[0], weights[1], 1e-6)
    rope = Rope(positions, cos_sin_cache(head_dim).to(device), norm)

    def run(qkv: torch.Tensor, rope: Rope | None, k_cache, v_cache) -> torch.Tensor:
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return paged_attention_decode(
            q.view(-1, num_heads, head_dim),
            k_cache,
            v_cache,
            block_table,
            lens,
            head_dim**-0.5,
            config=DecodeConfig(num_splits=num_splits, block_n=32),
            new_k=k.view(-1, num_kv_heads, head_dim),
            new_v=v.view(-1, num_kv_heads, head_dim),
            slot_mapping=slots,
            rope=rope,
        )

    # (.to(device) copies nothing on CPU: each run gets its own copy.)
    fused_qkv, fused_k, fused_v = qkv.to(device).clone(), k_cache.clone(), v_cache.clone()
    fused = run(fused_qkv, rope, fused_k, fused_v)
    assert torch.equal(fused_qkv.cpu(), qkv)  # the query and new K are read, not rotated in place

    apart_qkv = qkv.to(device).clone()
    q, k, _ = apart_qkv.split([q_size, kv_size, kv_size], dim=-1)
    rotary(rope.positions, q, k, rope.cos_sin, norm)
    apart = run(apart_qkv, None, k_cache, v_cache)
    # The same bits, but for the norm's sum of squares, taken in another order.
    tol = 0 if not qk_norm else 1e-6 if dtype == torch.float32 else 1e-2
    close = functools.partial(torch.testing.assert_close, rtol=tol, atol=tol, equal_nan=True)
    close(fused, apart)
    close(fused_k, k_cache)  # unused cache rows hold NaN
    torch.testing.assert_close(fused_v, v_cache, rtol=0, atol=0, equal_nan=True)

    ref_k, ref_v = fused_k.clone(), fused_v.clone()  # the new rows already in: stored again
    q, k, v = qkv.to(device).clone().split([q_size, kv_size, kv_size], dim=-1)
    expected = paged_attention_decode_ref(
        q.view(-1, num_heads, head_dim),
        ref_k,
        ref_v,
        block_table,
        lens,
        head_dim**-0.5,
        new_k=k.view(-1, num_kv_heads, head_dim),
        new_v=v.view(-1, num_kv_heads, head_dim),
        slot_mapping=slots,
        rope=rope,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), expected.float(), rtol=tol, atol=tol)
    close(ref_k, k_cache)


@pytest.mark.parametrize(
    ("chunk", "block_size", "num_splits"), [(8, 16, 1), (8, 16, 3), (40, 32, 3)]
)
def test_decode_chunked_attention_matches_reference(
    chunk: int,
    block_size: int,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    """Llama 4's chunks: the new token sees the keys of its own chunk only (older ones are
    NaN here, so reading one shows), its chunk new or several tiles long."""
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    context_lens = [5, chunk, chunk + 1, 3 * chunk + 7, 200]
    k_cache, v_cache, block_table = paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, max_blocks_per_seq=24
    )
    for cache in (k_cache, v_cache):
        for seq, n in enumerate(context_lens):
            for pos in range((n - 1) // chunk * chunk):
                cache[block_table[seq, pos // block_size].long(), pos % block_size] = float("nan")
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=rng).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, block_table, lens, 0.2)
    expected = paged_attention_decode_ref(*args, chunk=chunk)
    config = DecodeConfig(num_splits=num_splits, block_n=32)
    result = paged_attention_decode(*args, config=config, chunk=chunk)
    assert not expected.isnan().any()
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert paged_attention_decode_ref(*args).isnan().any()  # the poison is there to be read
