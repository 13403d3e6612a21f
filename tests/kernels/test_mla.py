"""The MLA kernels (Triton) against their references: the latent cache's store, and the
attention of every query head over its one row a token, one row a sequence (decode,
verify rows) and over varlen chunks after cached prefixes, split and unsplit."""

from __future__ import annotations

import pytest
import torch

from kernels.mla import (
    MlaConfig,
    mla_attention,
    mla_attention_for,
    mla_attention_ref,
    mla_store,
    mla_store_ref,
)

# (latent, rope, heads): the tests' tiny checkpoints' shape (dims below tl.dot's 16,
# padded), and DeepSeek-V2-Lite's (16 heads; V3's at TP 8).
SHAPES = [(32, 8, 4), (512, 64, 16)]


def queries(rng, n: int, heads: int, latent: int, rope: int, device):
    q_lat = torch.randn(heads, n, latent, generator=rng).transpose(0, 1)  # as the model's bmm
    q_pe = torch.randn(n, heads * (rope + 3), generator=rng)[:, : heads * rope]  # strided rows
    return q_lat, q_pe.view(n, heads, rope), q_lat.to(device), q_pe.view(n, heads, rope).to(device)


@pytest.mark.parametrize(("latent", "rope", "heads"), SHAPES)
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_rows_match_reference(latent, rope, heads, splits, rng, device, paged_kv):
    context_lens = [1, 17, 40, 0]  # the last a padded row: zeros
    cache, _, block_table = paged_kv(context_lens, 1, latent + rope, 16)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q_lat, q_pe, q_lat_d, q_pe_d = queries(rng, 4, heads, latent, rope, device)
    scale = (latent + rope) ** -0.5
    want = mla_attention_ref(
        q_lat, q_pe, cache.cpu(), block_table.cpu(), None, seq_lens.cpu(), scale
    )
    config = None if splits is None else MlaConfig(1, 16, splits)
    got = mla_attention(
        q_lat_d, q_pe_d, cache, block_table, None, seq_lens, scale, config=config
    ).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not want[3].any() and not got[3].any()
    assert got.transpose(0, 1).is_contiguous()  # head-major, for the product by W_UV


@pytest.mark.parametrize(("latent", "rope", "heads"), SHAPES)
@pytest.mark.parametrize("splits", [None, 2])
def test_varlen_chunks_match_reference(latent, rope, heads, splits, rng, device, paged_kv):
    # A chunk after a 15-token prefix, a whole prompt, one decode row in the same step,
    # and a padded sequence with no query; two padded rows at the end.
    seq_lens, query_lens = [20, 9, 33, 0], [5, 9, 1, 0]
    cache, _, block_table = paged_kv(seq_lens, 1, latent + rope, 8)
    starts = torch.tensor([0, 5, 14, 15, 15], dtype=torch.int32)
    q_lat, q_pe, q_lat_d, q_pe_d = queries(rng, 17, heads, latent, rope, device)
    scale = 0.3
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = mla_attention_ref(q_lat, q_pe, cache.cpu(), block_table.cpu(), starts, lens, scale)
    config = None if splits is None else MlaConfig(2, 16, splits, num_warps=4)
    got = mla_attention(
        q_lat_d, q_pe_d, cache, block_table, starts.to(device), lens.to(device), scale,
        max(query_lens), config=config,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(got[:15], want[:15], atol=1e-4, rtol=1e-4)
    # Causal: the prefix chunk's first query sees keys 0..15 only (key 16 changed: same).
    cache[block_table[0, 16 // 8].long(), 16 % 8] += 1.0
    again = mla_attention_ref(q_lat, q_pe, cache.cpu(), block_table.cpu(), starts, lens, scale)
    assert torch.equal(again[0], want[0]) and not torch.equal(again[1], want[1])


def test_store_writes_latent_then_rope_and_skips_padding(rng, device):
    cache = torch.zeros(3, 4, 1, 40)
    latent = torch.randn(5, 32 + 8, generator=rng)  # c and k_pe: column ranges, as the model's
    slots = torch.tensor([2, 9, -1, 0, 11])
    want = cache.clone()
    mla_store_ref(latent[:, :32], latent[:, 32:], want, slots)
    got = cache.to(device)
    lat = latent.to(device)
    mla_store(lat[:, :32], lat[:, 32:], got, slots.to(device))
    assert torch.equal(got.cpu(), want)
    rows = want.view(-1, 40)
    assert torch.equal(rows[9], latent[1]) and not rows[[1, 3, 4]].any()


def test_mla_attention_for_picks_reference_off_cuda():
    assert mla_attention_for(torch.device("cpu")) is mla_attention_ref
