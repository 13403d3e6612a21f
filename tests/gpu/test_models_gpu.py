"""The newer families on CUDA at fp32 (Triton attention with windows, the Triton fused MoE,
CUDA graphs): token for token equal to transformers, graphs and eager, up to a near-tie."""

from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_tokenizer
from kernels.fused_moe import fused_moe, fused_moe_ref, select_experts
from tests.gpu.on_cuda import GPU, generate
from tests.reference import PROMPTS, assert_greedy_matches, hf_greedy
from tests.tiny_checkpoints import FAMILY_CONFIGS

pytestmark = GPU

MAX_NEW = 32


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_families_match_transformers_on_cuda(tiny_family_dir, kind):
    model_dir = tiny_family_dir(kind)
    tokenizer = load_tokenizer(model_dir)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    want = [hf_greedy(model_dir, i, MAX_NEW) for i in ids]
    assert_greedy_matches(model_dir, ids, generate(model_dir, PROMPTS, MAX_NEW), want)
    eager = generate(model_dir, PROMPTS, MAX_NEW, enforce_eager=True)
    assert_greedy_matches(model_dir, ids, eager, want)
    # Chunked prefill (prefill graphs) and prefix-cache hits over 4-token blocks (with
    # recurrent layers, from their states' snapshots).
    shared = PROMPTS[3] + " " + PROMPTS[6]
    prompts = [shared + suffix for suffix in ("", " one", " two")] * 2
    ids = [tokenizer.encode(p) for p in prompts]
    want = [hf_greedy(model_dir, i, MAX_NEW) for i in ids]
    chunked = generate(
        model_dir,
        prompts,
        MAX_NEW,
        block_size=4,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    assert_greedy_matches(model_dir, ids, chunked, want)


@pytest.mark.parametrize("kind", ["qwen3_5", "granitemoehybrid", "lfm2", "mamba2"])
def test_recurrent_prefixes_start_from_saved_states_on_cuda(tiny_family_dir, kind):
    """A prompt again and its next turn, from the states saved at its last block
    boundary; one prompt has a single token past it, so the step that restores its
    state is a decode-shaped one (run eagerly around the copies, not by a graph)."""
    from engine import LLM, SamplingParams

    model_dir = tiny_family_dir(kind)
    tokenizer = load_tokenizer(model_dir)
    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        block_size=4,
        max_num_seqs=4,
        enable_prefix_caching=True,
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    long = tokenizer.encode(PROMPTS[5] + " " + PROMPTS[3])
    for first in (long[:21], long[:23]):  # 1 and 3 tokens past the last boundary
        (out,) = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        turn = first + out.outputs[0].token_ids[:5] + long[-4:]
        prompts, got, cached = [first, turn], [], []
        for ids in prompts:
            (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            got.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
        assert cached == [20, 20]
        want = [hf_greedy(model_dir, ids, MAX_NEW) for ids in prompts]
        assert_greedy_matches(model_dir, prompts, got, want)


@pytest.mark.parametrize("kind", ["qwen3_5", "granitemoehybrid", "lfm2"])
def test_recurrent_steps_with_prompts_replay_prefill_graphs(tiny_family_dir, kind, monkeypatch):
    """Prefill graphs up to the walk's length only: a 24-token budget puts the prompts'
    chunks beside decodes in graph steps, two slots reused (their states from zeros), and
    the outputs are transformers'. With the walk capped at 20 tokens, no 24-token graph."""
    import engine.models.gated_delta as gated_delta
    from engine import LLM, SamplingParams

    monkeypatch.setattr(gated_delta, "WALK_MAX_TOKENS", 32)
    model_dir = tiny_family_dir(kind)
    tokenizer = load_tokenizer(model_dir)
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=2, max_num_batched_tokens=24)
    runner = llm.engine.runner
    assert sorted(runner.graphs.prefill) == [16, 24]
    prompts = [PROMPTS[i] * 2 for i in range(5)]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runner.steps_by_path["prefill graph"] > 0
    ids = [tokenizer.encode(p) for p in prompts]
    assert_greedy_matches(model_dir, ids, got, [hf_greedy(model_dir, i, MAX_NEW) for i in ids])
    del llm, runner
    monkeypatch.setattr(gated_delta, "WALK_MAX_TOKENS", 20)
    llm = LLM(model_dir, device="cuda", max_num_seqs=2, max_num_batched_tokens=24)
    assert sorted(llm.engine.runner.graphs.prefill) == [16]


@pytest.mark.parametrize("walk_max_tokens", [0, 10**6])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "granitemoehybrid", "falcon_h1"])
def test_recurrent_prompts_chunked_or_walked_match_transformers(
    tiny_family_dir, kind, walk_max_tokens, monkeypatch
):
    """Prompts of several chunks (and short ones beside them) through the chunked form
    alone (no prefill graph), then token by token alone, prefill graphs included
    (engine/models/gated_delta.py's WALK_MAX_TOKENS)."""
    import engine.models.gated_delta as gated_delta

    monkeypatch.setattr(gated_delta, "WALK_MAX_TOKENS", walk_max_tokens)
    model_dir = tiny_family_dir(kind)
    tokenizer = load_tokenizer(model_dir)
    prompts = [" ".join(PROMPTS), PROMPTS[5], " ".join(PROMPTS[2:])]
    ids = [tokenizer.encode(p) for p in prompts]
    assert max(map(len, ids)) > 2 * gated_delta.CHUNK
    want = [hf_greedy(model_dir, i, MAX_NEW) for i in ids]
    assert_greedy_matches(model_dir, ids, generate(model_dir, prompts, MAX_NEW), want)


def test_fused_moe_in_a_cuda_graph_follows_new_routing():
    """Captured once, replayed with other routing (an expert with every token, one with
    none): the replay matches the reference, so nothing was fixed at capture time."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_experts, hidden, inter, tokens, top_k = 16, 256, 128, 64, 4
    x = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.05
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.05
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    logits = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    logits[:, 3] += 100.0  # expert 3 in every token's top-k
    logits[:, 5] -= 100.0  # expert 5 in none
    new_weights, new_ids = select_experts(logits, top_k, renormalize=True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    expected = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("query_len", [1, 37])  # decode rows; query tiles after a prefix
def test_mla_attention_in_bf16_at_deepseek_shape(query_len, fp8):
    """The launch configs the engine picks at DeepSeek-V2-Lite's shape (16 heads, a 512 +
    64 row) in bf16, against the fp32 reference; with fp8, over an e4m3 cache (its
    scale folded into the softmax and the output)."""
    from kernels.mla import mla_attention, mla_attention_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, latent, rope, block_size, seqs, ctx = 16, 512, 64, 16, 3, 300
    blocks = seqs * -(-ctx // block_size)
    cache = torch.randn(blocks, block_size, 1, latent + rope, device="cuda", generator=gen)
    table = torch.randperm(blocks, device="cuda", generator=gen).int().view(seqs, -1)
    lens = torch.tensor([ctx, 5 + query_len, 1], dtype=torch.int32, device="cuda")
    n = seqs * query_len
    starts = (
        None
        if query_len == 1
        else torch.tensor(
            [0, query_len, 2 * query_len, 2 * query_len + 1], dtype=torch.int32, device="cuda"
        )
    )  # the last sequence one row: a decode beside two chunks
    if starts is not None:
        lens[2] = 40
    q_lat = torch.randn(n, heads, latent, device="cuda", generator=gen)
    q_pe = torch.randn(n, heads, rope, device="cuda", generator=gen)
    args = (table, starts, lens, 0.05)
    if fp8:  # the cache holds rows / 0.25, rounded to e4m3
        cache = (cache * 4).to(torch.float8_e4m3fn)
        want = mla_attention_ref(q_lat, q_pe, cache, *args, query_len, 0.25)
        got = mla_attention(q_lat.bfloat16(), q_pe.bfloat16(), cache, *args, query_len, 0.25)
    else:
        want = mla_attention_ref(q_lat, q_pe, cache, *args)
        got = mla_attention(q_lat.bfloat16(), q_pe.bfloat16(), cache.bfloat16(), *args, query_len)
    rows = n if starts is None else 2 * query_len + 1
    torch.testing.assert_close(got[:rows].float(), want[:rows], atol=2e-2, rtol=2e-2)


def test_gemma4_at_its_head_sizes(tmp_path, tokenizer):
    """Gemma 4 31B's heads (256 on sliding layers, 512 on global ones, whose V is K's
    projection) through every CUDA kernel at fp32: equal to transformers up to a near-tie."""
    import transformers

    config_class, model_class, fields = FAMILY_CONFIGS["gemma4"]
    fields = fields | dict(head_dim=256, global_head_dim=512, num_attention_heads=8)
    fields |= dict(num_key_value_heads=4, num_global_key_value_heads=1, hidden_size=128)
    fields |= dict(max_position_embeddings=512)
    config = getattr(transformers, config_class)(
        **fields, intermediate_size=256, num_hidden_layers=2, vocab_size=len(tokenizer),
        initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    want = [hf_greedy(str(tmp_path), i, MAX_NEW) for i in ids]
    assert len({t for w in want for t in w}) > 8  # not one repeated token
    assert_greedy_matches(str(tmp_path), ids, generate(str(tmp_path), PROMPTS, MAX_NEW), want)
    eager = generate(str(tmp_path), PROMPTS, MAX_NEW, enforce_eager=True)
    assert_greedy_matches(str(tmp_path), ids, eager, want)
