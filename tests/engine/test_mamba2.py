"""Mamba-2's rule in chunks against its recurrence, the convolution's bias, and the mixer's
refusals (Granite 4.0-H's exactness: test_models_exactness.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.distributed import TensorParallel
from engine.models.gated_delta import CHUNK, causal_conv, chunked_rule
from engine.models.mamba2 import Mamba2Mixer, Mamba2Shape
from kernels.conv_step import conv_step


@pytest.mark.parametrize("tokens", [1, 5, CHUNK, 2 * CHUNK + 22])
def test_chunks_equal_the_recurrence_token_by_token(tokens):
    """S <- exp(g) S + k v^T, o = S^T q, over several chunks from a state already written."""
    gen = torch.Generator().manual_seed(tokens)
    f64 = dict(generator=gen, dtype=torch.float64)
    heads, k_dim, v_dim = 3, 16, 8
    q, k = (torch.randn(heads, tokens, k_dim, **f64) for _ in range(2))
    v = torch.randn(heads, tokens, v_dim, **f64)
    g = -torch.rand(heads, tokens, **f64)
    state = torch.randn(heads, k_dim, v_dim, **f64)
    out, final = chunked_rule(q, k, v, g, None, state)
    s, want = state, []
    for t in range(tokens):
        s = s * g[:, t, None, None].exp() + k[:, t, :, None] * v[:, t, None, :]
        want.append((q[:, t, None, :] @ s)[:, 0])
    torch.testing.assert_close(out, torch.stack(want, dim=1))
    torch.testing.assert_close(final, s)


def test_convolution_bias_by_step_and_whole_as_transformers():
    """With a bias (Mamba-2's conv1d has one): the step form equals the whole, which equals
    transformers' causal_conv1d_fn (a padded conv1d, then SiLU)."""
    gen = torch.Generator().manual_seed(0)
    channels, kernel, tokens = 6, 4, 9
    x = torch.randn(1, tokens, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    empty = torch.zeros(1, channels, kernel - 1, dtype=torch.float64)
    whole, state = causal_conv(x, empty, weight, torch.tensor([tokens]), bias)
    padded = F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=kernel - 1, groups=channels)
    torch.testing.assert_close(whole, F.silu(padded[..., :tokens]).transpose(1, 2))
    s, steps = empty, []
    for t in range(tokens):
        out, s = conv_step(x[:, t], s, weight, bias)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, dim=1), whole)
    torch.testing.assert_close(s, state)


def mixer_config(groups: int) -> tuple[SimpleNamespace, Mamba2Shape]:
    config = SimpleNamespace(hidden_size=32, rms_norm_eps=1e-6)
    return config, Mamba2Shape(6, 8, 4, groups, 4, True, False, (0.0, float("inf")), 1e-6)


def test_groups_that_do_not_split_across_ranks_are_refused():
    """3 groups over 2 ranks would split a group's heads and its norm: refused by name.
    One group (Granite 4.0-H's) is read by every rank."""
    tp = TensorParallel(rank=0, size=2)
    with pytest.raises(ValueError, match="3 mamba groups do not divide across 2 ranks"):
        Mamba2Mixer(*mixer_config(3), tp)
    with pytest.raises(ValueError, match="6 mamba heads are not a multiple of 4 groups"):
        Mamba2Mixer(*mixer_config(4))
    one = Mamba2Mixer(*mixer_config(1), tp)
    assert (one.num_heads, one.num_groups, one.norm_shared) == (3, 1, True)
    # z, x for 3 heads of 8; B and C of the one group whole (4 each); dt for 3 heads.
    assert one.sizes == [24, 24, 4, 4, 3]


def test_granite_4_is_recurrent_only_with_mixers():
    """A Granite 4.0 config with Mamba-2 layers runs as a recurrent model (no prefix
    cache); the dense Granite 4.0 models share the model type with attention layers
    only, and keep the prefix cache."""
    from transformers import GraniteMoeHybridConfig

    from engine.models.registry import MODEL_TYPES

    model = MODEL_TYPES["granitemoehybrid"]
    hybrid = GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["mamba", "attention"])
    dense = GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["attention", "attention"])
    assert model.recurrent(hybrid) and not model.recurrent(dense)


def test_nemotron_h_refuses_what_it_does_not_serve():
    """Activations other than relu^2 and SiLU, by name; Nemotron 3's MoE blocks pass."""
    from transformers import NemotronHConfig

    from engine.models.nemotron_h import NemotronHForCausalLM

    NemotronHForCausalLM.check_config(
        NemotronHConfig(layers_block_type=["linear_attention", "moe"])
    )
    gelu = NemotronHConfig(layers_block_type=["linear_attention", "mlp"], mlp_hidden_act="gelu")
    with pytest.raises(ValueError, match="unsupported mlp_hidden_act 'gelu'"):
        NemotronHForCausalLM.check_config(gelu)
    NemotronHForCausalLM.check_config(NemotronHConfig(layers_block_type=["full_attention", "mlp"]))
