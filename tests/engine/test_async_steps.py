"""The host runs one step ahead of the device: decodes take their input ids from
the previous step's sampled ids on the device, and the host reads those ids
while the next step runs. These tests pin down what that must not change."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.loader import load_tokenizer
from tests.reference import PROMPTS, hf_greedy


@pytest.fixture(scope="module")
def llm(tiny_gpt2_dir) -> LLM:
    return LLM(tiny_gpt2_dir, device="cpu", block_size=4)


def count_rows(engine) -> dict[str, int]:
    """Wrap the runner to count, per request, the steps it was scheduled in."""
    rows: dict[str, int] = {}
    execute = engine.runner.execute

    def counting(batch):
        for slot in batch.slots.tolist():
            rid = engine.batch.requests[slot].request_id
            rows[rid] = rows.get(rid, 0) + 1
        return execute(batch)

    engine.runner.execute = counting
    return rows


def test_next_step_is_launched_before_the_ids_are_read(llm, monkeypatch):
    engine = llm.engine
    schedule, starts = engine.scheduler.schedule, []

    def traced():
        out = schedule()
        starts.extend(int(s) for s in out.starts[:1])
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", traced)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.step() == []  # the prefill ran; its token is not read yet
    req = engine.requests["a"][0]
    assert req.num_inflight == 1 and req.output_token_ids == []
    (out,) = engine.step()  # the decode of that token was launched, then it was read
    assert out.new_token_ids == req.output_token_ids[:1] and req.num_inflight == 1
    # The decode launched at position 3, the read token's: the unread one is the next input.
    assert starts == [0, 3] and req.num_tokens == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert len(req.output_token_ids) == 4


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


def test_a_stop_string_costs_at_most_one_void_row(llm):
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
    assert rows["0"] <= len(out.outputs[0].token_ids) + 1


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
    assert len(out.new_token_ids) == 1 and engine.inflight is None
    while engine.has_unfinished_requests():
        engine.step()
    tokenizer = load_tokenizer(tiny_gpt2_dir)
    ids = tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    (got,) = llm.generate([ids], params, use_tqdm=False)
    assert got.outputs[0].token_ids == hf_greedy(tiny_gpt2_dir, ids, 10)


def test_a_row_that_the_read_before_sampling_finishes_is_void(llm):
    """A step with a penalty row reads the previous step's ids before sampling; a request
    they stop has a row in that step all the same, whose id must reach no one (not the
    next owner of its slot)."""
    engine = llm.engine
    stop_all = SamplingParams(max_tokens=5, stop_token_ids=list(range(engine.vocab_size)))
    engine.add_request("a", [1, 2, 3], stop_all)
    engine.step()  # a's first token is on the device
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=4, presence_penalty=1.0))
    outs = {}
    for out in engine.step():  # a stops here, before b samples
        outs.setdefault(out.request_id, []).append(out)
    engine.add_request("c", [7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs["a"][-1].finish_reason == "stop" and outs["a"][-1].num_output_tokens == 1
    assert outs["b"][-1].num_output_tokens == 4
    c = outs["c"][-1]  # a's slot: its tokens are its own
    assert c.finish_reason == "length" and c.num_output_tokens == 3
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
