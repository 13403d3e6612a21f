"""Triton kernels on CUDA against their torch references, at realistic sizes and dtypes."""

from __future__ import annotations

import pytest
import torch

from kernels.attention_ref import paged_attention_decode_ref, paged_prefill_attention_ref
from kernels.kv_store import kv_store, kv_store_ref
from kernels.linear import (
    SHORT_K,
    WIDE_N,
    SplitKWorkspace,
    dense,
    linear_ref,
    splitk_linear,
    splitk_pays,
    splitk_workspace,
)
from kernels.norms import add_norm
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import paged_prefill_attention
from kernels.prefill_config import prefill_config
from kernels.splits import SplitKPartials
from tests.gpu.on_cuda import GPU

pytestmark = GPU

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (num_heads, num_kv_heads, head_dim): GPT-2, Qwen2.5-0.5B, Llama-3-8B, a head_dim of 80,
# Gemma 4 31B's sliding and global layers.
SHAPES = [(12, 12, 64), (14, 2, 64), (32, 8, 128), (32, 32, 80), (32, 16, 256), (32, 4, 512)]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp16/bf16 kernels round the softmax probabilities to the input dtype before P @ V.
    return {
        torch.float16: {"rtol": 1e-2, "atol": 2e-3},
        torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2},
        torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    }[dtype]


def paged_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype, device="cuda"), torch.randn(
        shape, dtype=dtype, device="cuda"
    )


def shuffled_block_table(num_seqs: int, max_blocks: int, num_blocks: int) -> torch.Tensor:
    # [num_seqs, max_blocks] int32: distinct blocks, in no particular order.
    blocks = torch.randperm(num_blocks, device="cuda")[: num_seqs * max_blocks]
    return blocks.view(num_seqs, max_blocks).int()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("num_seqs", [1, 37])
def test_decode(
    num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(num_seqs * 1000 + num_heads + head_dim)
    block_size, max_blocks = 16, 160
    k_cache, v_cache = paged_cache(num_seqs * max_blocks, block_size, num_kv_heads, head_dim, dtype)
    block_table = shuffled_block_table(num_seqs, max_blocks, num_seqs * max_blocks)
    context_lens = torch.randint(1, max_blocks * block_size + 1, (num_seqs,), device="cuda").int()
    context_lens[0] = max_blocks * block_size
    query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device="cuda")
    args = (query, k_cache, v_cache, block_table, context_lens, head_dim**-0.5)
    torch.testing.assert_close(
        paged_attention_decode(*args), paged_attention_decode_ref(*args), **tolerance(dtype)
    )


@pytest.mark.parametrize("num_seqs", [1, 8, 64])
def test_decode_replayed_in_cuda_graph(num_seqs: int) -> None:
    torch.manual_seed(num_seqs)
    num_heads, num_kv_heads, head_dim, block_size, max_blocks = 14, 2, 64, 16, 128
    dtype = torch.float16
    num_blocks = num_seqs * max_blocks
    k_cache, v_cache = paged_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    # Static graph inputs, refilled in place before each replay.
    query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device="cuda")
    block_table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda")
    context_lens = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        paged_attention_decode(query, k_cache, v_cache, block_table, context_lens, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_decode(query, k_cache, v_cache, block_table, context_lens, scale)

    max_len = max_blocks * block_size
    for lens in ([1] * num_seqs, [max_len] * num_seqs, None, None):
        if lens is None:  # ragged, with padded entries (context_len 0, block row of zeros)
            lens = torch.randint(0, max_len + 1, (num_seqs,)).tolist()
            lens[-1] = 0
        context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        block_table.copy_(shuffled_block_table(num_seqs, max_blocks, num_blocks))
        block_table[context_lens == 0] = 0
        query.normal_()
        graph.replay()
        expected = paged_attention_decode_ref(
            query, k_cache, v_cache, block_table, context_lens, scale
        )
        torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_prefill(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_heads + head_dim)
    block_size, max_blocks = 16, 64
    # (query_len, seq_len): a long prompt, chunked prefill, a prefix-cache hit, one new token.
    chunks = [(1000, 1000), (256, 700), (37, 37 + 5 * block_size), (1, 513)]
    query_lens, seq_lens = zip(*chunks, strict=True)
    num_seqs = len(chunks)
    k_cache, v_cache = paged_cache(num_seqs * max_blocks, block_size, num_kv_heads, head_dim, dtype)
    block_table = shuffled_block_table(num_seqs, max_blocks, num_seqs * max_blocks)
    query = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device="cuda")
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device="cuda")
    args = (
        query,
        k_cache,
        v_cache,
        block_table,
        query_start_loc.int(),
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        head_dim**-0.5,
        max(query_lens),
    )
    torch.testing.assert_close(
        paged_prefill_attention(*args), paged_prefill_attention_ref(*args), **tolerance(dtype)
    )


def replay_prefill_graph(
    shape: tuple[int, int, int],  # (num_heads, num_kv_heads, head_dim)
    dtype: torch.dtype,
    max_tokens: int,
    max_seqs: int,
    max_blocks: int,
    max_query_len: int,
    batches: list[list[tuple[int, int]]],  # per replay, (query_len, seq_len) a sequence
) -> None:
    """Capture the kernel once for max_tokens rows and max_seqs sequences, then replay it
    for each batch (the rest padding: rows past the queries, empty trailing sequences),
    as the engine's graphs for steps with prefill tokens do. The real rows must match
    the reference, every replay."""
    num_heads, num_kv_heads, head_dim = shape
    block_size, num_blocks = 16, max_seqs * max_blocks
    k_cache, v_cache = paged_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    query = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device="cuda")
    block_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device="cuda")
    query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, max_query_len)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_prefill_attention(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_prefill_attention(*args)

    for chunks in batches:
        query_lens, lens = zip(*chunks, strict=True)
        n, total = len(chunks), sum(query_lens)
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        query_start_loc.fill_(total)  # the padded sequences' queries are empty
        query_start_loc[: n + 1] = starts
        seq_lens.zero_()
        seq_lens[:n] = torch.tensor(lens)
        block_table.copy_(shuffled_block_table(max_seqs, max_blocks, num_blocks))
        query.normal_()
        graph.replay()
        real = (query[:total], k_cache, v_cache, block_table[:n], starts.int().cuda())
        want = paged_prefill_attention_ref(*real, seq_lens[:n], scale, max(query_lens))
        torch.testing.assert_close(out[:total], want, **tolerance(dtype))


def test_prefill_replayed_in_cuda_graph_with_padding() -> None:
    """Captured for 1200 token rows and 6 sequences with a bound of 1024 on the query
    length; replayed for decodes beside prompts, as in a serving step."""
    torch.manual_seed(0)
    batches = [
        [(1000, 1000), (1, 513), (1, 17)],
        [(1, 40), (1, 1000), (128, 128), (64, 64 + 3 * 16), (1, 1), (5, 900)],
        [(16, 16)],
    ]
    replay_prefill_graph((14, 2, 64), torch.float16, 1200, 6, 64, 1024, batches)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_prefill_of_few_tiles_splits_the_keys_in_a_cuda_graph(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Steps of few tiles (up to 1 + 4 queries a sequence, as speculative verify steps
    have, over long contexts) in a graph captured for 40 token rows and 8 sequences,
    replayed for fewer of both. The default config splits the keys there."""
    torch.manual_seed(head_dim)
    group, context = num_heads // num_kv_heads, 256 * 16
    device = torch.device("cuda")
    assert prefill_config(5, head_dim, group, 40, num_kv_heads, context, device).num_splits > 1
    # One sequence over 4k keys, eight of mixed lengths, short ones.
    batches = [
        [(5, 4000)],
        [(5, 4096), (1, 9), (3, 700), (5, 2049), (2, 64), (5, 5), (4, 1500), (5, 333)],
        [(2, 17), (5, 40)],
    ]
    shape = (num_heads, num_kv_heads, head_dim)
    replay_prefill_graph(shape, dtype, 40, 8, 256, 5, batches)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(12, 64), (2, 64), (8, 128), (32, 80)])
def test_kv_store(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    num_tokens, num_blocks, block_size = 4096, 512, 16
    k_cache, v_cache = paged_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    slot_mapping = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slot_mapping[::7] = -1  # padding
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv_store_ref(key, value, expected_k, expected_v, slot_mapping)
    kv_store(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# (K, N, bias, dtype): GPT-2's MLP down projection, Qwen2.5-0.5B's down_proj.
DOWN_SHAPES = [(3072, 768, True, torch.float16), (4864, 896, False, torch.bfloat16)]


@pytest.mark.parametrize(("k", "n", "with_bias", "dtype"), DOWN_SHAPES)
@pytest.mark.parametrize("m", [1, 37, 64])
def test_splitk_linear_replayed_in_cuda_graph(
    m: int, k: int, n: int, with_bias: bool, dtype: torch.dtype
) -> None:
    # Replays with new inputs and no memset between them: each must find its counters at 0
    # and read every split's partial only after all of them are stored.
    torch.manual_seed(m + k)
    x = torch.randn(m, k, dtype=dtype, device="cuda")  # static graph input
    weight = 0.02 * torch.randn(n, k, dtype=dtype, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda") if with_bias else None
    workspace = SplitKWorkspace(n, x.device)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        splitk_linear(x, weight, bias, workspace)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [splitk_linear(x, weight, bias, workspace) for _ in range(8)]  # back to back

    for _ in range(3):
        x.normal_()
        graph.replay()
        expected = linear_ref(x.float(), weight.float(), None if bias is None else bias.float())
        for out in outs:
            torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    assert not workspace.counters.any()


@pytest.mark.parametrize("k", [896, 4096])  # Qwen2.5-0.5B's LM head, Llama-3-8B's
@pytest.mark.parametrize("m", [1, 13])
def test_a_wide_outputs_tiles_follow_its_k(m: int, k: int) -> None:
    """LM heads at up to SMALL_M rows: one split, the tiles set by K (SHORT_K)."""
    torch.manual_seed(k + m)
    n = WIDE_N + 1001  # a ragged last column tile
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    weight = 0.02 * torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    assert splitk_pays(x, weight)
    config = splitk_workspace(n, x.device, k=k).config_for(m)
    assert (config.num_splits, config.block_k) == (1, 128 if k <= SHORT_K else 256)
    got = dense(x, weight, None)
    torch.testing.assert_close(got.float(), linear_ref(x.float(), weight.float(), None),
                               **tolerance(torch.bfloat16))  # fmt: skip


@pytest.mark.parametrize(("k", "n", "with_bias", "dtype"), DOWN_SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_splits_left_to_the_residual_add_in_cuda_graph(
    m: int, k: int, n: int, with_bias: bool, dtype: torch.dtype
) -> None:
    """dense(defer=True) then add_norm, as o_proj and its residual add run in a decode
    graph, twice per replay over one workspace: the norm sums the splits into what the
    summed launch's output gives it, bit for bit, and the graph's later GEMMs of the same
    width do not touch the splits it has yet to read."""
    torch.manual_seed(m + k)
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    weight = 0.02 * torch.randn(n, k, dtype=dtype, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda") if with_bias else None
    residual = torch.randn(m, n, dtype=dtype, device="cuda")
    norm = torch.ones(n, dtype=dtype, device="cuda")

    def step() -> list[torch.Tensor]:
        splits = dense(x, weight, bias, defer=True)
        summed = dense(x, weight, bias)  # the same width's workspace, before the sum
        h, total = add_norm(splits, residual, norm, None, 1e-6, True)
        want_h, want_total = add_norm(splitk_total(splits), residual, norm, None, 1e-6, True)
        return [summed, h, total, want_h, want_total]

    assert isinstance(dense(x, weight, bias, defer=True), SplitKPartials)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        x.normal_()
        graph.replay()
        summed, h, total, want_h, want_total = outs
        assert torch.equal(total, want_total) and torch.equal(h, want_h)
        expected = linear_ref(x.float(), weight.float(), None if bias is None else bias.float())
        torch.testing.assert_close(total.float(), expected + residual.float(), **tolerance(dtype))
        torch.testing.assert_close(summed.float(), expected, **tolerance(dtype))


def splitk_total(splits: SplitKPartials) -> torch.Tensor:
    """The splits summed in split order (as the norm sums them), in the output dtype."""
    total = splits.partials[0].clone()
    for part in splits.partials[1:]:
        total += part
    return total.to(splits.dtype)
