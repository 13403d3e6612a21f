"""The CUDA decode path: graphs on/off agree with transformers; pinned buffers are safe."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.bad_words import bad_words_token_ids
from engine.models.loader import load_tokenizer
from engine.scheduler import SchedulerOutput
from tests.gpu.on_cuda import GPU, CountedGraph, generate
from tests.reference import PROMPTS, hf_greedy

pytestmark = GPU

MAX_NEW = 16


@pytest.mark.parametrize("batch", [1, 3, 5, 13])  # buckets 1, 4, 8, 16: padding in all but one
def test_cuda_graphs_match_eager_and_transformers(tiny_model_dir, batch):
    prompts = (PROMPTS * 2)[:batch]
    tokenizer = load_tokenizer(tiny_model_dir)
    want = [hf_greedy(tiny_model_dir, tokenizer.encode(p), MAX_NEW) for p in prompts]
    graphs = generate(tiny_model_dir, prompts, MAX_NEW)
    eager = generate(tiny_model_dir, prompts, MAX_NEW, enforce_eager=True)
    assert graphs == eager
    assert graphs == want


@pytest.mark.parametrize("graphs", [True, False])
def test_steps_with_prefill_match_eager_and_transformers(tiny_model_dir, graphs):
    """A 40-token step budget chunks the long prompts, so most steps mix prefill
    chunks with decodes; prefill graphs pad them to the 16, 32 and 40 buckets, and
    their sequences to max_num_seqs."""
    prompts = [p * 3 for p in PROMPTS]  # 10 to ~90 tokens
    tokenizer = load_tokenizer(tiny_model_dir)
    want = [hf_greedy(tiny_model_dir, tokenizer.encode(p), MAX_NEW) for p in prompts]
    got = generate(
        tiny_model_dir, prompts, MAX_NEW, max_num_batched_tokens=40, prefill_graphs=graphs
    )
    assert got == generate(
        tiny_model_dir, prompts, MAX_NEW, max_num_batched_tokens=40, enforce_eager=True
    )
    assert got == want


def test_prefill_graphs_are_replayed_for_steps_with_prefill(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cuda", max_num_seqs=8, max_num_batched_tokens=40)
    runner = llm.engine.runner
    assert sorted(runner.graphs.prefill) == [16, 32, 40]
    replays: list[int] = []
    for bucket, (graph, logits) in list(runner.graphs.prefill.items()):
        runner.graphs.prefill[bucket] = (CountedGraph(bucket, graph, replays), logits)
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert replays == [32]  # the three prompts' 31 tokens in one step; then decodes
    assert runner.steps_by_path["prefill graph"] == 1


def test_decode_graphs_write_the_block_table_entries_they_open(tiny_model_dir):
    """Block size 4: sequences open blocks on most decode steps, and the decode graph
    writes those entries into the device table from the staging buffer (no copy).
    Outputs must match transformers, and the device table the host mirror."""
    prompts = PROMPTS[:5]
    tokenizer = load_tokenizer(tiny_model_dir)
    want = [hf_greedy(tiny_model_dir, tokenizer.encode(p), 40) for p in prompts]
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32", max_num_seqs=8, block_size=4)
    runner = llm.engine.runner
    table = runner.block_table
    carried = []
    stage = runner.stage_table_changes

    def counting(bucket):
        carried.append(len(table.changed))
        stage(bucket)

    runner.stage_table_changes = counting
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert sum(n > 0 for n in carried) >= 20 and max(carried) > 1
    torch.cuda.synchronize()
    assert torch.equal(table.gpu[: runner.max_num_seqs].cpu(), table.cpu)


def test_graphs_are_replayed_for_decode(tiny_gpt2_dir):
    llm = LLM(tiny_gpt2_dir, device="cuda", max_num_seqs=8)
    runner = llm.engine.runner
    assert sorted(runner.graphs.decode) == [1, 2, 4, 8]
    replays = []
    for bucket, graphs in runner.graphs.decode.items():
        assert len(graphs) == 2  # one per staging buffer
        for graph in graphs:
            original = graph.replay
            graph.replay = lambda b=bucket, f=original: (replays.append(b), f())[1]
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert replays and set(replays) <= {4}  # three sequences decode in the 4-bucket


def test_given_cuda_graph_sizes_are_the_buckets_captured_and_replayed(tiny_gpt2_dir):
    llm = LLM(tiny_gpt2_dir, device="cuda", dtype="float32", max_num_seqs=8, cuda_graph_sizes=[2])
    runner = llm.engine.runner
    assert sorted(runner.graphs.decode) == [2, 8]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    out = llm.generate(PROMPTS[:3], params, use_tqdm=False)  # decodes in the 8-bucket
    assert runner.steps_by_path["graph"] > 0
    eager = generate(tiny_gpt2_dir, PROMPTS[:3], MAX_NEW, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in out] == eager


def test_decode_graph_takes_the_greedy_ids_that_the_sampler_would(tiny_gpt2_dir):
    """The graph's argmax lands in the buffer next step's inputs are gathered from; an
    all-greedy decode uses it as the step's ids, and it is the logits' argmax."""
    llm = LLM(tiny_gpt2_dir, device="cuda", max_num_seqs=8)
    runner = llm.engine.runner
    checked = []
    execute = runner.execute

    def checking(batch):
        logits = execute(batch)
        if runner.argmax is not None:
            checked.append(runner.argmax.tolist() == logits.argmax(-1).tolist())
        return logits

    runner.execute = checking
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert len(checked) >= 4 and all(checked)  # the decode steps after the prefill


def test_sampled_and_greedy_rows_in_one_decode_graph_match_eager(tiny_model_dir):
    """Random rows overwrite the graph's argmax with the sampler's ids; greedy rows
    keep theirs. Seeded, so graphs on and off must agree token for token."""
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, **kw)
        for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}, {"top_k": 5, "seed": 3})
    ]

    def run(**config) -> list[list[int]]:
        llm = LLM(tiny_model_dir, device="cuda", dtype="float32", max_num_seqs=8, **config)
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    graphs = run()
    assert graphs == run(enforce_eager=True)
    assert graphs[1] != graphs[0] or graphs[2] != graphs[0]  # the sampler did run


def test_banned_and_allowed_rows_in_decode_graphs_match_transformers(tiny_gpt2_dir):
    """A bad_words row and an allowed_token_ids row beside a plain greedy one: the graph's
    argmax stands for the plain row only; each equals transformers' generate under the
    same constraint, graphs on and off."""
    tokenizer = load_tokenizer(tiny_gpt2_dir)
    ids = [tokenizer.encode(p) for p in PROMPTS[:3]]
    plain = [hf_greedy(tiny_gpt2_dir, i, MAX_NEW) for i in ids]
    word = tokenizer.decode(plain[1][2:4])
    spellings = bad_words_token_ids([word], lambda t: tokenizer.encode(t, add_special_tokens=False))
    assert plain[1][2:4] in spellings
    allowed = sorted(set(plain[2][1:6]) | {7, 100, 301})
    want = [
        plain[0],
        hf_greedy(tiny_gpt2_dir, ids[1], MAX_NEW, bad_words_ids=spellings),
        hf_greedy(tiny_gpt2_dir, ids[2], MAX_NEW, prefix_allowed_tokens_fn=lambda _b, _i: allowed),
    ]
    assert want[1] != plain[1] and want[2] != plain[2]
    base = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    params = [base, replace(base, bad_words=[word]), replace(base, allowed_token_ids=allowed)]
    for eager in (False, True):
        llm = LLM(
            tiny_gpt2_dir, device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=eager
        )
        assert [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)] == want


def test_half_precision_runs_with_cuda_graphs(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cuda", dtype="bfloat16", max_num_seqs=8)
    outs = llm.generate(
        PROMPTS[:6], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_pinned_buffers_are_not_rewritten_before_their_copy_ran(tiny_gpt2_dir):
    """Hold the stream with a long sleep so the non-blocking H2D copy of step A is
    still queued. Step B writes the other staging buffer; step C, back in A's, must
    wait for A's copy, or A's device tensors would receive C's values."""
    llm = LLM(tiny_gpt2_dir, device="cuda", max_num_seqs=8, enforce_eager=True)
    engine, runner = llm.engine, llm.engine.runner
    prompts = {"a": [11, 12, 13], "b": [21, 22, 23, 24, 25], "c": [31, 32]}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # admitted, block-table rows sent: the steps below grow nothing
    torch.cuda.synchronize()

    def step(rid: str):
        # The prompt again, as one prefill chunk of this request alone.
        req = engine.requests[rid][0]
        n = len(prompts[rid])
        one = np.array([1])
        batch = SchedulerOutput(np.array([req.slot]), 0 * one, n * one, n * one, one > 0, n)
        max_q = runner.fill(batch)
        inp = runner.send(n, 1, max_q, False)
        # What the step's device tensors hold once its copy has run (queued after it).
        seen = (runner.staged.words[inp.input_gather].clone(), inp.positions.clone())
        return runner.parity, seen

    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copies
    parity_a, (ids_a, pos_a) = step("a")
    parity_b, (ids_b, _) = step("b")
    parity_c, (ids_c, _) = step("c")  # must block until A's copy has run
    torch.cuda.synchronize()
    assert parity_a == parity_c != parity_b
    assert ids_a.tolist() == [11, 12, 13] and pos_a.tolist() == [0, 1, 2]
    assert ids_b.tolist() == [21, 22, 23, 24, 25] and ids_c.tolist() == [31, 32]


def test_sampled_ids_reach_the_host_while_later_steps_queue(tiny_gpt2_dir):
    """Each step's ids come back through its own pinned buffer (two, used by alternate
    steps): with the stream held, the next step's copy must not land in the buffer
    the host reads."""
    runner = LLM(tiny_gpt2_dir, device="cuda", max_num_seqs=8).engine.runner
    torch.cuda._sleep(200_000_000)
    runner.next_buffers()  # each step's fill moves to its buffers
    first = runner.keep_sampled(torch.tensor([1, 2, 3], device="cuda"))
    runner.next_buffers()
    second = runner.keep_sampled(torch.tensor([4, 5], device="cuda"))
    assert first.tolist() == [1, 2, 3]  # waits for its own copy, not a later one
    runner.next_buffers()
    third = runner.keep_sampled(torch.tensor([6], device="cuda"))
    assert second.tolist() == [4, 5] and third.tolist() == [6]
    # The last ids stay on the device, where the next step's inputs are gathered from.
    assert runner.staged.gpu["sampled_ids"][:1].tolist() == [6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_fused_gelu_matches_linear_then_tanh_gelu(dtype, num_tokens):
    from transformers import GPT2Config

    from engine.models.gpt2 import GPT2Block

    torch.manual_seed(0)
    block = GPT2Block(GPT2Config(n_embd=64, n_head=4)).to("cuda", dtype)
    h = torch.randn(num_tokens, 64, device="cuda", dtype=dtype)
    want = torch.nn.functional.gelu(block.c_fc(h), approximate="tanh")
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(block.mlp_in(h), want, atol=tol, rtol=tol)
