"""splitk_linear (Triton, split-K reduced in one launch) against linear_ref, and dense()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import (
    SMALL_M,
    LoRADelta,
    RowGroups,
    SplitKConfig,
    SplitKWorkspace,
    dense,
    gelu_tanh_linear_ref,
    keep_groups_ref,
    linear_ref,
    lora_delta_ref,
    splitk_linear,
    splitk_max_rows,
    splitk_pays,
)
from kernels.splits import SplitKPartials

# K = 300 is no multiple of block_k * num_splits (each split ends on a partial tile) and
# N = 72 no multiple of block_n; small tiles keep the interpreter quick.
K, N = 300, 72


def poisoned_workspace(n: int, config: SplitKConfig, device: torch.device) -> SplitKWorkspace:
    # NaN partials prove each split writes its whole share before the last one reads it.
    workspace = SplitKWorkspace(n, device, config=config)
    workspace.partials.fill_(float("nan"))
    return workspace


@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16, 64])
def test_splitk_linear_matches_reference_fp32(m, with_bias, num_splits, rng, device):
    x = torch.randn(m, K, generator=rng)
    weight = 0.1 * torch.randn(N, K, generator=rng)
    bias = torch.randn(N, generator=rng) if with_bias else None
    want = linear_ref(x, weight, bias)

    config = SplitKConfig(num_splits=num_splits, block_n=32, block_k=32)
    workspace = poisoned_workspace(N, config, device)
    on = [t if t is None else t.to(device) for t in (x, weight, bias)]
    got = splitk_linear(*on, workspace)
    assert got.shape == (m, N) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    # The last split of each column tile put its counter back: a replay needs no memset.
    assert not workspace.counters.any()
    again = splitk_linear(*on, workspace)
    assert torch.equal(again, got)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("m", [1, 16])
def test_splitk_linear_gelu_epilogue_is_one_rounding_of_gelu(m, num_splits, rng, device):
    # GPT-2's c_fc: tanh GELU after the bias, of the summed splits (not of each split),
    # rounded once: the fp16 result equals the fp32 reference's rounding up to the order
    # of the sums. The pre-activations span [-4, 4], where tanh GELU bends.
    x = torch.randn(m, K, generator=rng).half()
    weight = (0.12 * torch.randn(N, K, generator=rng)).half()
    bias = torch.randn(N, generator=rng).half()
    want = gelu_tanh_linear_ref(x, weight, bias)
    workspace = poisoned_workspace(N, SplitKConfig(num_splits, block_n=32, block_k=32), device)
    on = [t.to(device) for t in (x, weight, bias)]
    got = splitk_linear(*on, workspace, gelu=True)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=2e-3)
    plain = splitk_linear(*on, workspace)  # the same launch without it is the linear alone
    torch.testing.assert_close(
        plain.cpu(),
        linear_ref(x.float(), weight.float(), bias.float()).half(),
        rtol=2e-3,
        atol=2e-3,
    )
    assert not torch.allclose(got.cpu().float(), plain.cpu().float(), atol=0.1)


@pytest.mark.parametrize("m", [5, 64])
def test_splitk_linear_matches_reference_fp16_default_config(m, rng, device):
    # The default config (block_k 128, 4 splits) over K = 600: the last split gets no K at
    # all (splits take 256 each) and must still count itself in with a zero partial.
    k, n = 600, 200
    x = torch.randn(m, k, generator=rng).half().to(device)
    weight = (0.05 * torch.randn(n, k, generator=rng)).half().to(device)
    bias = torch.randn(n, generator=rng).half().to(device)
    workspace = poisoned_workspace(n, SplitKConfig(), device)
    got = splitk_linear(x, weight, bias, workspace)
    assert got.dtype == torch.float16
    want = linear_ref(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(splitk_linear(x, weight, bias, workspace), got)


def test_splitk_workspace_switches_config_by_rows(rng, device):
    # One workspace, two launch configs (up to SMALL_M rows and more) that differ in
    # tiles and splits, used in turn: both sum right, and each leaves the shared
    # counters at zero for the other.
    few = SplitKConfig(num_splits=4, block_n=32, block_k=32)
    many = SplitKConfig(num_splits=2, block_n=64, block_k=64)
    workspace = SplitKWorkspace(N, device, config=few, rows_config=many)
    workspace.partials.fill_(float("nan"))
    assert workspace.config_for(SMALL_M) == few and workspace.config_for(SMALL_M + 1) == many
    weight = (0.1 * torch.randn(N, K, generator=rng)).to(device)
    for m in (3, 40, 16, 64):
        x = torch.randn(m, K, generator=rng).to(device)
        got = splitk_linear(x, weight, None, workspace)
        torch.testing.assert_close(got, linear_ref(x, weight, None), rtol=1e-4, atol=1e-5)
        assert not workspace.counters.any()


def test_splitk_linear_reads_strided_rows(rng, device):
    # x may be a row-strided view; the workspace may hold more rows than the call.
    wide = torch.randn(3, K + 20, generator=rng).to(device)
    x, weight = wide[:, :K], torch.randn(N, K, generator=rng).to(device)
    workspace = SplitKWorkspace(N, device, config=SplitKConfig(num_splits=2, block_k=64))
    got = splitk_linear(x, weight, None, workspace)
    torch.testing.assert_close(got, linear_ref(x, weight, None), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_dense_on_cpu_is_f_linear(bias, rng):
    x, weight = torch.randn(4, K, generator=rng), torch.randn(N, K, generator=rng)
    b = torch.randn(N, generator=rng) if bias else None
    assert not splitk_pays(x, weight)
    assert torch.equal(dense(x, weight, b), F.linear(x, weight, b))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("m", [1, 17, 64])
def test_splitk_linear_with_fp8_x_and_weights_is_fp8_linear_ref(m, num_splits, rng, device):
    """W8A8: x quantized per token (as `_scaled_mm`'s path does), the dots on e4m3, both
    scales and then the bias applied after the K sum: fp8_linear_ref's product."""
    from kernels.fp8 import fp8_linear_ref, quantize_per_channel, quantize_per_token_ref

    x = torch.randn(m, K, generator=rng).to(torch.float16)
    q, scale = quantize_per_channel(0.1 * torch.randn(N, K, generator=rng))
    bias = torch.randn(N, generator=rng).to(torch.float16)
    want = fp8_linear_ref(x.float(), q, scale, bias.float())
    x_q, x_scale = quantize_per_token_ref(x)

    config = SplitKConfig(num_splits=num_splits, block_n=32, block_k=32)
    workspace = poisoned_workspace(N, config, device)
    on = [t.to(device) for t in (x_q, q, bias)]
    got = splitk_linear(*on, workspace, scale.to(device), x_scale.to(device), torch.float16)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-3, atol=2e-3)
    assert not workspace.counters.any()


@pytest.mark.parametrize(
    ("n", "k", "rows"),
    [
        (768, 768, 64),  # GPT-2's o projection: small weights
        (2304, 768, 64),  # GPT-2's qkv
        (4096, 4096, 64),  # Llama-3-8B's o: 32 MiB in fp16/bf16
        (6144, 4096, 64),  # Llama-3-8B's qkv: 48 MiB
        (8192, 8192, 16),  # Llama-3-70B's o: 128 MiB
        (28672, 4096, 16),  # Llama-3-8B's gate_up
        (4096, 14336, 64),  # Llama-3-8B's down: K >= 2N
        (50257, 64, 16),  # a small vocabulary-wide LM head keeps its own tiles' limit
    ],
)
def test_splitk_max_rows_by_weight(n, k, rows):
    assert splitk_max_rows(n, k, 2) == rows


@pytest.mark.parametrize(
    ("m", "n", "k", "splitk"),
    [
        (1, 96, 64, True),  # few rows: any shape (a weight read)
        (16, 32832, 64, True),  # ... an LM-head-wide one too (its own tile config)
        (32, 96, 64, True),  # more rows, K < 2N, small weights: split-K up to 64 rows
        (65, 96, 64, False),
        (32, 32, 300, True),  # K >= 2N: split-K up to SPLITK_MAX_M rows
        (65, 32, 300, False),
    ],
)
def test_dense_dispatch_and_result(m, n, k, splitk, rng, device):
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k, generator=rng).to(device, dtype)
    weight = (0.1 * torch.randn(n, k, generator=rng)).to(device, dtype)
    bias = torch.randn(n, generator=rng).to(device, dtype)
    assert splitk_pays(x, weight) == (splitk and device.type == "cuda")
    got = dense(x, weight, bias)
    torch.testing.assert_close(got, linear_ref(x, weight, bias), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_splitk_linear_adds_each_rows_lora_delta(m, num_splits, rng, device):
    """Three adapters of 12 columns each (a block of 16, masked), rows on each of them
    and on none: every row gets its own adapter's shrink times its own B."""
    adapters, group = 3, 12
    x = torch.randn(m, K, generator=rng)
    weight = 0.1 * torch.randn(N, K, generator=rng)
    bias = torch.randn(N, generator=rng)
    shrink = torch.randn(m, adapters * group, generator=rng)
    b = torch.randn(adapters * group, N, generator=rng)
    ids = torch.tensor([(i % (adapters + 1)) - 1 for i in range(m)])
    delta = LoRADelta(shrink, b, ids, group)
    want = linear_ref(x, weight, bias) + lora_delta_ref(delta)
    # The reference: row i is its adapter's slice alone.
    for i in range(m):
        a = int(ids[i])
        own = (
            0 if a < 0 else shrink[i, a * group : (a + 1) * group] @ b[a * group : (a + 1) * group]
        )
        torch.testing.assert_close(lora_delta_ref(delta)[i], own + torch.zeros(N))
    config = SplitKConfig(num_splits=num_splits, block_n=32, block_k=32)
    workspace = poisoned_workspace(N, config, device)
    on = LoRADelta(shrink.to(device), b.to(device), ids.to(device), group)
    got = splitk_linear(x.to(device), weight.to(device), bias.to(device), workspace, lora=on)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    assert not workspace.counters.any()


@pytest.mark.parametrize("m", [1, 6, 40])
def test_splitk_linear_keeps_each_rows_column_group(m, rng, device):
    """A LoRA shrink: row m keeps its adapter's 12 columns (of 36), the rest zero."""
    weight = 0.1 * torch.randn(36, K, generator=rng)
    x = torch.randn(m, K, generator=rng)
    ids = torch.tensor([(i + 1) % 4 - 1 for i in range(m)])  # 0, 1, 2, -1 (none), 0, ...
    keep = RowGroups(ids, 12)
    want = keep_groups_ref(linear_ref(x, weight, None), keep)
    assert (want[ids < 0] == 0).all() and (want[ids >= 0] != 0).any(1).all()
    config = SplitKConfig(num_splits=2, block_n=32, block_k=32)
    workspace = poisoned_workspace(36, config, device)
    on = RowGroups(ids.to(device), 12)
    got = splitk_linear(x.to(device), weight.to(device), None, workspace, keep=on)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("m", "num_splits"), [(1, 3), (6, 2), (40, 1)])
def test_splitk_linear_leaves_splits_for_the_residual_add(m, num_splits, fp8, rng, device):
    """defer: a launch of several splits stores each split's product, scales applied and
    the bias in split 0's, and returns them unsummed; their sum is the summed launch's
    output. One split is summed already: a tensor. The shared workspace is untouched."""
    from kernels.fp8 import quantize_per_channel, quantize_per_token_ref

    x = torch.randn(m, K, generator=rng).to(torch.float16)
    weight = (0.1 * torch.randn(N, K, generator=rng)).to(torch.float16)
    bias = torch.randn(N, generator=rng).to(torch.float16)
    scales = ()
    if fp8:
        (x, x_scale), (weight, w_scale) = quantize_per_token_ref(x), quantize_per_channel(weight)
        scales = (w_scale.to(device), x_scale.to(device), torch.float16)
    config = SplitKConfig(num_splits=num_splits, block_n=32, block_k=32)
    workspace = poisoned_workspace(N, config, device)
    on = [t.to(device) for t in (x, weight, bias)]
    want = splitk_linear(*on, workspace, *scales)
    workspace.partials.fill_(float("nan"))
    got = splitk_linear(*on, workspace, *scales, defer=True)
    assert workspace.partials.isnan().all() and not workspace.counters.any()
    if num_splits == 1:
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
        return
    assert isinstance(got, SplitKPartials) and got.shape == (m, N)
    assert got.partials.shape == (num_splits, m, N) and got.dtype == torch.float16
    torch.testing.assert_close(got.total(), want, rtol=1e-3, atol=1e-3)
    # A LoRA delta is added once, by the last split: those launches sum as before.
    delta = LoRADelta(torch.ones(m, 16, device=device), torch.zeros(16, N, device=device),
                      torch.zeros(m, dtype=torch.int64, device=device), 16)  # fmt: skip
    if not fp8:
        assert isinstance(splitk_linear(*on, workspace, lora=delta, defer=True), torch.Tensor)
