"""The MLA kernels (Triton) against their references: the latent cache's store, and the
attention of every query head over its one row a token, one row a sequence (decode,
verify rows) and over varlen chunks after cached prefixes, split and unsplit; decode
rows finishing and storing their own new rows."""

from __future__ import annotations

import pytest
import torch

from kernels.mla import MlaConfig, mla_attention, mla_attention_for, mla_attention_ref
from kernels.mla_store import LatentRows, finish_rows_ref, mla_store, mla_store_ref
from kernels.rotary import Rope

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


@pytest.mark.parametrize("splits", [None, 2])
def test_an_fp8_cache_stores_and_reads_as_its_reference(splits, rng, device):
    """--kv-cache-dtype fp8: the row / kv_scale in e4m3 (the store's bytes are the
    reference's), read back times kv_scale by decode rows and by varlen chunks."""
    latent, rope, heads, block_size, kv_scale = 32, 8, 4, 8, 0.37
    seq_lens, query_lens = [20, 9], [5, 9]
    blocks = torch.tensor([[0, 4, 2], [3, 1, 0]], dtype=torch.int32)  # seq 1: two blocks
    slots = torch.cat([blocks[s, torch.arange(n) // block_size] * block_size
                       + torch.arange(n) % block_size for s, n in enumerate(seq_lens)])  # fmt: skip
    rows = torch.randn(len(slots), latent + rope, generator=rng)
    want_cache = torch.zeros(5, block_size, 1, latent + rope, dtype=torch.float8_e4m3fn)
    mla_store_ref(rows[:, :latent], rows[:, latent:], want_cache, slots, kv_scale)
    cache = torch.zeros_like(want_cache).to(device)
    rows_d = rows.to(device)
    mla_store(rows_d[:, :latent], rows_d[:, latent:], cache, slots.to(device), kv_scale)
    assert torch.equal(cache.cpu().view(torch.uint8), want_cache.view(torch.uint8))
    stored = want_cache.view(-1, latent + rope)[slots].float() * kv_scale
    assert (stored - rows).abs().max() < 0.1 * rows.abs().max()  # e4m3's rounding, scaled

    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, 5, 14], dtype=torch.int32)
    q_lat, q_pe, q_lat_d, q_pe_d = queries(rng, 14, heads, latent, rope, device)
    scale = 0.3
    config = None if splits is None else MlaConfig(2, 16, splits, num_warps=4)
    want = mla_attention_ref(q_lat, q_pe, want_cache, blocks, starts, lens, scale, 9, kv_scale)
    got = mla_attention(
        q_lat_d, q_pe_d, cache, blocks.to(device), starts.to(device), lens.to(device), scale,
        max(query_lens), kv_scale, config=config,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    unscaled = mla_attention_ref(q_lat, q_pe, want_cache, blocks, starts, lens, scale, 9)
    assert not torch.allclose(unscaled, want, atol=1e-2)  # the scale is applied
    # Decode rows: each sequence's last query.
    last = starts[1:] - 1
    want = mla_attention_ref(
        q_lat[last], q_pe[last], want_cache, blocks, None, lens, scale, 1, kv_scale
    )
    config = None if splits is None else MlaConfig(1, 16, splits)
    got = mla_attention(
        q_lat_d[last.to(device)], q_pe_d[last.to(device)], cache, blocks.to(device), None,
        lens.to(device), scale, 1, kv_scale, config=config,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_rows_store_their_new_rows_as_the_separate_launches_do(
    fp8, splits, rng, device, paged_kv
):
    """Given the raw rows (LatentRows), the decode launch norms c, rotates k_pe and q_pe
    and stores the row before attending: the cache's bytes and the output are those of
    the norm, rotary, store and attention run one after another."""
    latent, rope, heads, kv_scale = 32, 8, 4, 0.37 if fp8 else 1.0
    context_lens = [1, 17, 40, 0]  # the new token is each context's last; the last padded
    cache, _, block_table = paged_kv(context_lens, 1, latent + rope, 16)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    slots = torch.tensor([int(block_table[i, (n - 1) // 16]) * 16 + (n - 1) % 16
                          for i, n in enumerate(context_lens[:3])] + [-1])  # fmt: skip
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    raw = torch.randn(4, latent + rope + 5, generator=rng)[:, : latent + rope]  # strided rows
    half = torch.randn(64, rope // 2, generator=rng)
    new = LatentRows(
        raw, 1.0 + 0.1 * torch.randn(latent, generator=rng), 1e-6,
        Rope(torch.tensor([0, 16, 39, 0]), torch.cat([half.cos(), half.sin()], dim=-1)),
        slots,
    )  # fmt: skip
    q_lat, q_pe, q_lat_d, q_pe_d = queries(rng, 4, heads, latent, rope, device)
    scale = (latent + rope) ** -0.5
    want_cache = cache.cpu()
    q_rot, c, k_pe = finish_rows_ref(q_pe, new)
    mla_store_ref(c, k_pe, want_cache, slots, kv_scale)
    want = mla_attention_ref(
        q_lat, q_rot, want_cache, block_table.cpu(), None, seq_lens, scale, 1, kv_scale
    )
    new_d = LatentRows(
        raw.to(device), new.norm_weight.to(device), new.eps,
        Rope(new.rope.positions.to(device), new.rope.cos_sin.to(device)), slots.to(device),
    )  # fmt: skip
    config = None if splits is None else MlaConfig(1, 16, splits)
    q_pe_before = q_pe_d.clone()
    got = mla_attention(
        q_lat_d, q_pe_d, cache, block_table, None, seq_lens.to(device), scale, 1, kv_scale,
        new_d, config=config,
    ).cpu()  # fmt: skip
    # The norm's sum may run in another order than torch's: within a rounding step (e4m3's
    # is 1/8 of a value; the scale, 0.37, is far outside it).
    step = 0.13 if fp8 else 1e-5
    rows = cache.cpu().view(-1, latent + rope)[slots[:3]].float()
    torch.testing.assert_close(rows, want_cache.view(-1, latent + rope)[slots[:3]].float(),
                               rtol=step, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(q_pe_d, q_pe_before)  # q_pe is read, not written
    # The reference with `new` is the same sequence of ops.
    ref_cache = cache.cpu()
    ref_cache.view(-1, latent + rope)[slots[:3]] = 0
    again = mla_attention_ref(
        q_lat, q_pe, ref_cache, block_table.cpu(), None, seq_lens, scale, 1, kv_scale, new
    )
    assert torch.equal(again, want)
    assert torch.equal(ref_cache.view(torch.uint8), want_cache.view(torch.uint8))
