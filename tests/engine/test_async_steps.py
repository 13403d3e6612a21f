"""The host runs ahead of the device: decodes take their input ids from the
previous step's sampled ids on the device, and the host reads a step's ids
while the next one or two (inflight_steps) run. These tests pin down what that
must not change."""

from __future__ import annotations

import itertools

import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from tests.conftest import PROMPTS, hf_greedy


@pytest.fixture(scope="module", params=[1, 2], ids=["1-inflight", "2-inflight"])
def llm(tiny_gpt2_dir, request) -> LLM:
    return LLM(tiny_gpt2_dir, device="cpu", block_size=4, inflight_steps=request.param)


def count_rows(engine) -> dict[str, int]:
    """Wrap the runner to count, per request, the steps it was scheduled in."""
    rows: dict[str, int] = {}
    execute = engine.runner.execute

    def counting(batch, on_device=False):
        for req in batch.requests:
            rows[req.request_id] = rows.get(req.request_id, 0) + 1
        return execute(batch, on_device)

    engine.runner.execute = counting
    return rows


def test_next_steps_are_launched_before_the_ids_are_read(llm):
    engine = llm.engine
    depth = engine.depth
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    for k in range(1, depth + 1):
        assert engine.step() == []  # launched; no token read yet
        req = engine.requests["a"][0]
        assert req.num_inflight == k and req.output_token_ids == []
        assert len(engine.inflight) == k
    # The next decode was launched, then the oldest step's token was read.
    (out,) = engine.step()
    assert out.new_token_ids == req.output_token_ids[:1] and req.num_inflight == depth
    # The prompt and the one read token are on the host; every sampled token but the
    # newest is computed, and the newest is the next input, taken from the device.
    assert req.num_tokens == 4 and req.num_computed_tokens == 3 + depth
    while engine.has_unfinished_requests():
        engine.step()
    assert len(req.output_token_ids) == 6 and not engine.inflight


def test_a_length_limit_costs_no_extra_rows(llm):
    engine = llm.engine
    rows = count_rows(engine)
    try:
        for i, n in enumerate([1, 2, 7]):
            engine.add_request(
                f"r{n}", [3 + i, 4, 5], SamplingParams(max_tokens=n, ignore_eos=True)
            )
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.runner.execute
    # A prefill samples the first token; each further token is one decode row.
    assert rows == {"r1": 1, "r2": 2, "r7": 7}


def test_a_stop_string_costs_at_most_one_void_row_per_step_in_flight(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[1])
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    rows = count_rows(engine)
    try:
        (out,) = llm.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]), use_tqdm=False
        )
    finally:
        del engine.runner.execute
    assert out.outputs[0].finish_reason == "stop" and stop not in out.outputs[0].text
    assert rows["0"] <= len(out.outputs[0].token_ids) + engine.depth


def test_penalties_read_every_earlier_token(tiny_gpt2_dir):
    # A penalised request shares the batch with plain greedy ones, which keep the
    # host a step ahead; the penalty must still see the token sampled just before.
    tokenizer = load_tokenizer(tiny_gpt2_dir)
    llm = LLM(tiny_gpt2_dir, device="cpu")
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    penalised = SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8
    )
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, [penalised, plain, penalised, plain], use_tqdm=False)
    for i in (0, 2):
        want = hf_greedy(tiny_gpt2_dir, prompts[i], 16, repetition_penalty=1.8)
        assert outs[i].outputs[0].token_ids == want
    assert outs[1].outputs[0].token_ids == hf_greedy(tiny_gpt2_dir, prompts[1], 16)


def test_without_async_scheduling_ids_are_read_every_step(tiny_gpt2_dir):
    # A budget of 7 tokens: prompts are prefilled in chunks, some steps sample nothing.
    llm = LLM(tiny_gpt2_dir, device="cpu", async_scheduling=False, max_num_batched_tokens=7)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    (out,) = engine.step()  # the prefill's token is read in the same step
    assert len(out.new_token_ids) == 1 and not engine.inflight
    while engine.has_unfinished_requests():
        engine.step()
    tokenizer = load_tokenizer(tiny_gpt2_dir)
    ids = tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    (got,) = llm.generate([ids], params, use_tqdm=False)
    assert got.outputs[0].token_ids == hf_greedy(tiny_gpt2_dir, ids, 10)


def test_a_request_left_out_of_a_step_takes_its_input_from_two_steps_back(tiny_gpt2_dir):
    # The scheduler keeps a decode in every step while it runs; here the token budget
    # alternates between 3 and 16 (the steady state, which ignores it, is left each
    # step), so decodes drop out of every other step and come back with their newest
    # id two steps old, unread, and not in the last step's region: the ring keeps
    # that step's ids on the device for them.
    llm = LLM(tiny_gpt2_dir, device="cpu", max_num_seqs=8, inflight_steps=2)
    engine = llm.engine
    scheduler = engine.scheduler
    tokenizer = load_tokenizer(tiny_gpt2_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    lengths = [9, 14, 6, 12, 10, 7, 13, 11]
    schedule, execute = scheduler.schedule, engine.runner.execute
    budgets = itertools.cycle([3, 16])
    last: set = set()
    two_back = 0

    def alternating():
        scheduler.config.max_num_batched_tokens = next(budgets)
        scheduler._leave_steady()
        return schedule()

    def watching(batch, on_device=False):
        nonlocal last, two_back
        two_back += sum(1 for req in batch.requests if req.num_inflight and req not in last)
        last = set(batch.sampling())
        return execute(batch, on_device)

    scheduler.schedule, engine.runner.execute = alternating, watching
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert two_back >= 5, two_back
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_gpt2_dir, prompt, n)
