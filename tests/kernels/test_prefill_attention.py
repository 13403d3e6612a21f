"""paged_prefill_attention (Triton) against paged_prefill_attention_ref."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.attention_ref import paged_prefill_attention_ref
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_for
from kernels.prefill_config import prefill_config
from tests.kernels.test_paged_attention import score_mod

# (num_heads, num_kv_heads, head_dim, block_size): GPT-2, GQA groups of 4 and 7, a
# non-power-of-2 head_dim, both block sizes; groups of 12 (GLM-4.5-Air's) and 16, whose
# tiles hold a query or a few.
CASES = [
    (12, 12, 64, 16),
    (8, 2, 32, 32),
    (8, 2, 80, 16),
    (14, 2, 64, 32),
    (12, 1, 32, 16),
    (16, 1, 32, 16),
]


def split(num_splits: int, max_query_len: int, head_dim: int, group: int) -> dict:
    """Launch arguments that split the keys num_splits ways (1: the default config)."""
    if num_splits == 1:
        return {}
    config = prefill_config(max_query_len, head_dim, group)
    return {"config": dataclasses.replace(config, num_splits=num_splits)}


# Every case whole; three with the keys split (in the interpreter a split launch costs
# ~20x: one per head dim, group and block size is enough).
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "num_splits"),
    [(*case, 1) for case in CASES] + [(*case, 3) for case in CASES[:3]],
)
def test_prefill_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    # (query_len, seq_len): plain prefill over two query tiles, a chunk after a cached
    # prefix, an idle sequence, a prefix-cache hit on a block edge, a single new token.
    chunks = [(24, 24), (20, 57), (0, 9), (5, 2 * block_size + 5), (1, 40)]
    query_lens, seq_lens = zip(*chunks, strict=True)
    k_cache, v_cache, block_table = paged_kv(list(seq_lens), num_kv_heads, head_dim, block_size)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=rng).to(device)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    query_start_loc = query_start_loc.to(device=device, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, block_table, query_start_loc, lens, head_dim**-0.5)

    group = num_heads // num_kv_heads
    launch = split(num_splits, max(query_lens), head_dim, group)
    result = paged_prefill_attention(*args, max(query_lens), **launch)
    expected = paged_prefill_attention_ref(*args, max(query_lens))
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)


def test_prefill_splits_keys_only_for_few_tiles_over_long_contexts(monkeypatch) -> None:
    """The split count is a function of shapes: enough programs for the GPU when a step
    has few query tiles, none when its tiles fill it already or the keys are short."""
    monkeypatch.setattr("kernels.prefill_config.num_sms_of", lambda device: 132)
    cuda = torch.device("cuda")
    # A verify step of one sequence (1 + 4 tokens, Llama-3-8B's heads), a 4k context.
    one = prefill_config(5, 128, 4, 5, 8, 4096, cuda)
    assert (one.block_m, one.num_splits) == (32, 16)
    sixteen = prefill_config(5, 128, 4, 80, 8, 4096, cuda)  # 16 of them: 10+ tiles a head
    assert 1 < sixteen.num_splits < one.num_splits
    assert prefill_config(2048, 128, 4, 2048, 8, 4096, cuda).num_splits == 1
    assert prefill_config(5, 128, 4, 5, 8, 128, cuda).num_splits == 2  # two key tiles
    assert prefill_config(5, 128, 4, 5, 8, 4096).num_splits == 1  # no device: one launch


def test_prefill_with_padded_rows_and_sequences(
    rng: torch.Generator, device: torch.device, paged_kv
) -> None:
    """As a CUDA graph for steps with prefill runs it: more rows than the queries hold
    and trailing sequences with none, and a bound on the query length above the real
    one. The real rows must match; a tile must not stray into another's sequence."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    chunks = [(1, 30), (40, 40), (1, 17), (17, 17 + block_size)]  # 59 rows: 64-row tiles straddle
    query_lens, seq_lens = zip(*chunks, strict=True)
    k_cache, v_cache, block_table = paged_kv(list(seq_lens), num_kv_heads, head_dim, block_size)
    total, rows, padded_seqs = sum(query_lens), 80, 3
    query = torch.randn(rows, num_heads, head_dim, generator=rng).to(device)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    query_start_loc = torch.tensor(starts + [total] * padded_seqs, dtype=torch.int32, device=device)
    lens = torch.tensor(list(seq_lens) + [0] * padded_seqs, dtype=torch.int32, device=device)
    table = torch.cat([block_table, block_table[:padded_seqs] * 0])
    scale = head_dim**-0.5
    result = paged_prefill_attention(
        query, k_cache, v_cache, table, query_start_loc, lens, scale, 512
    )
    expected = paged_prefill_attention_ref(
        query[:total],
        k_cache,
        v_cache,
        block_table,
        query_start_loc[: len(chunks) + 1],
        lens[: len(chunks)],
        scale,
        max(query_lens),
    )
    torch.testing.assert_close(result[:total], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_of_short_queries_takes_a_tile_per_padded_sequence(
    num_splits: int, rng: torch.Generator, device: torch.device, paged_kv
) -> None:
    """A verify step's graph: no query longer than a tile (so tile i is sequence i's),
    padded rows and trailing sequences with no query, keys split or not."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    chunks = [(5, 40), (1, 17), (3, 70), (5, 5)]
    query_lens, seq_lens = zip(*chunks, strict=True)
    k_cache, v_cache, block_table = paged_kv(list(seq_lens), num_kv_heads, head_dim, block_size)
    total, rows, padded_seqs = sum(query_lens), 24, 3
    query = torch.randn(rows, num_heads, head_dim, generator=rng).to(device)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    query_start_loc = torch.tensor(starts + [total] * padded_seqs, dtype=torch.int32, device=device)
    lens = torch.tensor(list(seq_lens) + [0] * padded_seqs, dtype=torch.int32, device=device)
    table = torch.cat([block_table, block_table[:padded_seqs] * 0])
    launch = split(num_splits, 5, head_dim, num_heads // num_kv_heads)
    assert prefill_config(5, head_dim, num_heads // num_kv_heads).block_m // 4 >= 5  # one tile
    args = (k_cache, v_cache)
    result = paged_prefill_attention(query, *args, table, query_start_loc, lens, 0.3, 5, **launch)
    real = (query_start_loc[: len(chunks) + 1], lens[: len(chunks)], 0.3, 5)
    expected = paged_prefill_attention_ref(query[:total], *args, block_table, *real)
    torch.testing.assert_close(result[:total], expected, rtol=1e-4, atol=1e-5)


def test_prefill_for_picks_reference_off_cuda() -> None:
    assert paged_prefill_attention_for(torch.device("cpu")) is paged_prefill_attention_ref


@pytest.mark.parametrize(
    ("window", "kind", "num_splits"),
    [(0, "softcap", 1), (0, "sinks", 1), (24, "softcap", 1), (24, "sinks", 1)]
    + [(0, "softcap", 4), (24, "sinks", 4)],  # the keys split: each mod once
)
def test_prefill_score_mods_match_reference(
    kind: str, window: int, num_splits: int, rng: torch.Generator, device: torch.device, paged_kv
) -> None:
    # Gemma 2 soft-caps, and GPT-OSS has sinks, on sliding and global layers alike.
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    chunks = [(70, 70), (20, 57), (1, 40)]
    query_lens, seq_lens = zip(*chunks, strict=True)
    k_cache, v_cache, block_table = paged_kv(list(seq_lens), num_kv_heads, head_dim, block_size)
    mod, query_scale = score_mod(kind, num_heads, rng, device)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=rng).to(device)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query * query_scale, k_cache, v_cache, block_table, query_start_loc, lens, 0.5)
    args += (max(query_lens),)
    launch = split(num_splits, max(query_lens), head_dim, num_heads // num_kv_heads)
    result = paged_prefill_attention(*args, sliding_window=window, **mod, **launch)
    expected = paged_prefill_attention_ref(*args, sliding_window=window, **mod)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    plain = paged_prefill_attention_ref(*args, sliding_window=window)
    assert not torch.allclose(plain, expected, rtol=1e-2, atol=1e-2)


def first_seen(mask: dict, q_len: int, s_len: int) -> int:
    """The first key any of a chunk's queries sees under a sliding window or chunks."""
    first_query = s_len - q_len
    if "sliding_window" in mask:
        return max(first_query - mask["sliding_window"] + 1, 0)
    return first_query // mask["chunk"] * mask["chunk"]


@pytest.mark.parametrize(
    ("mask", "block_size", "num_splits"),
    [  # windows within and past a tile, split or not; Llama 4's chunks
        ({"sliding_window": 8}, 16, 1),
        ({"sliding_window": 24}, 16, 1),
        ({"sliding_window": 70}, 32, 1),
        ({"sliding_window": 8}, 16, 3),
        ({"sliding_window": 70}, 32, 3),
        ({"chunk": 8}, 16, 1),
        ({"chunk": 40}, 32, 3),
    ],
)
def test_prefill_sliding_window_and_chunks_match_reference(
    mask: dict,
    block_size: int,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    """A query sees the last `sliding_window` positions, or (Llama 4's chunks) the keys
    from the start of its own chunk, so a tile's rows start at different keys."""
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    # A prompt several windows long (query tiles whose first rows see no key of the
    # first tiles loaded), a chunk after a long prefix, a short prompt, one new token.
    chunks = [(90, 90), (20, 150), (5, 5), (1, 77)]
    query_lens, seq_lens = zip(*chunks, strict=True)
    k_cache, v_cache, block_table = paged_kv(list(seq_lens), num_kv_heads, head_dim, block_size)
    # Keys no query sees: NaN, so reading one shows.
    for seq, (q_len, s_len) in enumerate(chunks):
        for pos in range(first_seen(mask, q_len, s_len)):
            block = block_table[seq, pos // block_size].long()
            k_cache[block, pos % block_size] = float("nan")
            v_cache[block, pos % block_size] = float("nan")
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=rng).to(device)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, block_table, query_start_loc, lens, 0.2, max(query_lens))

    launch = split(num_splits, max(query_lens), head_dim, num_heads // num_kv_heads)
    result = paged_prefill_attention(*args, **mask, **launch)
    expected = paged_prefill_attention_ref(*args, **mask)
    assert not expected.isnan().any()
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert paged_prefill_attention_ref(*args).isnan().any()  # the poison is there to be read


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "num_splits"),
    [(*CASES[0], 1), (*CASES[1], 3), (*CASES[2], 1)],
)
def test_bidirectional_prefill_matches_reference_and_sdpa(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_splits: int,
    rng: torch.Generator,
    device: torch.device,
    paged_kv,
) -> None:
    """causal=False (an encoder's prompts, each whole in its step): every query sees every
    key of its own sequence, over tiles both full and partial, and no other sequence's."""
    seq_lens = [70, 3, 1, 2 * block_size]
    k_cache, v_cache, block_table = paged_kv(seq_lens, num_kv_heads, head_dim, block_size)
    num_tokens = sum(seq_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=rng).to(device)
    starts = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    query_start_loc = starts.to(device=device, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, block_table, query_start_loc, lens, head_dim**-0.5)
    launch = split(num_splits, max(seq_lens), head_dim, num_heads // num_kv_heads)
    result = paged_prefill_attention(*args, max(seq_lens), causal=False, **launch)
    expected = paged_prefill_attention_ref(*args, max(seq_lens), causal=False)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    causal = paged_prefill_attention_ref(*args, max(seq_lens))
    assert not torch.allclose(causal[:70], expected[:70], atol=1e-3)  # the flag does something
    for i, n in enumerate(seq_lens):  # the reference against SDPA without a mask
        blocks = block_table[i, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1).float()
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1).float()
        q = query[starts[i] : starts[i + 1]].transpose(0, 1).float()
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=head_dim**-0.5, enable_gqa=True
        )
        torch.testing.assert_close(
            expected[starts[i] : starts[i + 1]],
            want.transpose(0, 1).to(expected.dtype),
            rtol=1e-4,
            atol=1e-5,
        )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_bidirectional_sliding_window_matches_reference(
    num_splits: int, rng: torch.Generator, device: torch.device, paged_kv
) -> None:
    """causal=False with a window (ModernBERT's local layers): each query sees the keys at
    most `window` positions away on either side, and the reference agrees with a dense
    mask of |i - j| <= window."""
    window, seq_lens, head_dim = 5, [70, 3, 12], 32
    k_cache, v_cache, block_table = paged_kv(seq_lens, 2, head_dim, 16)
    query = torch.randn(sum(seq_lens), 4, head_dim, generator=rng).to(device)
    starts = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    loc = starts.to(device=device, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, block_table, loc, lens, head_dim**-0.5, max(seq_lens), window)
    launch = split(num_splits, max(seq_lens), head_dim, 2)
    result = paged_prefill_attention(*args, causal=False, **launch)
    expected = paged_prefill_attention_ref(*args, causal=False)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    n = seq_lens[0]
    k = k_cache[block_table[0, :5].long()].flatten(0, 1)[:n].repeat_interleave(2, 1)
    v = v_cache[block_table[0, :5].long()].flatten(0, 1)[:n].repeat_interleave(2, 1)
    pos = torch.arange(n, device=device)
    near = (pos[:, None] - pos[None, :]).abs() <= window
    want = torch.nn.functional.scaled_dot_product_attention(
        query[:n].transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=near,
        scale=head_dim**-0.5,
    )
    torch.testing.assert_close(expected[:n], want.transpose(0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("window", "num_splits"), [(0, 1), (24, 1), (24, 3)])
def test_horizons_let_image_tokens_see_their_image(
    window: int, num_splits: int, rng: torch.Generator, device: torch.device, paged_kv
) -> None:
    """horizons (Gemma 3's images): a query in an image run sees up to the run's end, the
    others causally; a window still bounds what lies behind. The reference agrees with a
    dense mask built as transformers builds Gemma 3's: AND(window, OR(causal, same run))."""
    head_dim, num_heads, num_kv_heads = 32, 8, 2
    # (query_len, seq_len, runs): a prompt with two images (the second across a tile
    # edge), a chunk after a cached prefix holding an image, a text-only chunk.
    chunks = [(70, 70, [(5, 20), (30, 66)]), (20, 50, [(33, 40)]), (6, 6, [])]
    query_lens = [q for q, _, _ in chunks]
    seq_lens = [s for _, s, _ in chunks]
    k_cache, v_cache, block_table = paged_kv(seq_lens, num_kv_heads, head_dim, 16)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=rng).to(device)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    loc = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    horizons, masks = [], []
    for q_len, s_len, runs in chunks:
        pos = torch.arange(s_len - q_len, s_len)
        see = pos.clone()
        keys = torch.arange(s_len)
        same = torch.zeros(q_len, s_len, dtype=torch.bool)
        for a, b in runs:  # positions a..b inclusive
            inside = (pos >= a) & (pos <= b)
            see[inside] = b
            same |= inside[:, None] & (keys[None, :] >= a) & (keys[None, :] <= b)
        horizons.append(see)
        mask = (keys[None, :] <= pos[:, None]) | same
        if window:
            mask &= keys[None, :] > pos[:, None] - window
        masks.append(mask)
    horizons = torch.cat(horizons).to(device=device, dtype=torch.int32)
    args = (query, k_cache, v_cache, block_table, loc, lens, head_dim**-0.5, max(query_lens))
    launch = split(num_splits, max(query_lens), head_dim, num_heads // num_kv_heads)
    result = paged_prefill_attention(*args, window, horizons=horizons, **launch)
    expected = paged_prefill_attention_ref(*args, window, horizons=horizons)
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(expected, paged_prefill_attention_ref(*args, window), atol=1e-3)
    for i, (_, s_len, _) in enumerate(chunks):  # the reference against a dense mask
        blocks = block_table[i, : -(-s_len // 16)].long()
        k = k_cache[blocks].flatten(0, 1)[:s_len].repeat_interleave(4, 1).transpose(0, 1)
        v = v_cache[blocks].flatten(0, 1)[:s_len].repeat_interleave(4, 1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            query[starts[i] : starts[i + 1]].transpose(0, 1).float(), k.float(), v.float(),
            attn_mask=masks[i].to(device), scale=head_dim**-0.5,
        )  # fmt: skip
        torch.testing.assert_close(
            expected[starts[i] : starts[i + 1]], want.transpose(0, 1), rtol=1e-4, atol=1e-5
        )
