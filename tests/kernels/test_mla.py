"""mla_expand (Triton) against mla_expand_ref: each head's K from its k_nope and the
token's rotary key in the kernels' layout, V padded to K's width."""

from __future__ import annotations

import pytest
import torch

from kernels.mla import mla_expand, mla_expand_for, mla_expand_ref


@pytest.mark.parametrize(
    ("nope", "rope", "v_dim"),
    [(16, 8, 12), (16, 8, 16), (128, 64, 128)],  # the tests' tiny shapes; DeepSeek's
)
def test_mla_expand_matches_reference(nope, rope, v_dim, rng, device):
    heads = 3
    latent = torch.randn(5, 7 + rope, generator=rng)  # pe: a strided slice, as the model's
    kv = torch.randn(5, heads, nope + v_dim, generator=rng)
    pe = latent[:, 7:]
    want_k, want_v = mla_expand_ref(kv, pe, nope)
    got_k, got_v = mla_expand(kv.to(device), pe.to(device), nope)
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    dim, half = nope + rope, (nope + rope) // 2
    # The layout: pe's halves at the start of each half of the head, V zero past v_dim.
    assert torch.equal(want_k[:, 0, : rope // 2], pe[:, : rope // 2])
    assert torch.equal(want_k[:, 1, half : half + rope // 2], pe[:, rope // 2 :])
    assert torch.equal(want_k[:, 2, rope // 2 : half], kv[:, 2, : half - rope // 2])
    assert not want_v[:, :, v_dim:dim].any()


def test_mla_expand_for_picks_reference_off_cuda():
    assert mla_expand_for(torch.device("cpu")) is mla_expand_ref
